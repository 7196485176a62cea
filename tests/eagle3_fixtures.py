"""Tiny look-alikes of the EAGLE-3 heads users download, for a look-alike target folder: random
weights at the target's width, each format's exact layout (decoding.eagle3_checkpoint's docstring):

- the EAGLE authors' (as yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): a flat Llama config with
  architectures ["LlamaForCausalLMEagle3"], num_hidden_layers 1, draft_vocab_size, torch_dtype
  float16, no layer ids (the reader picks the default); weights in pytorch_model.bin named
  midlayer.*, fc, norm, lm_head, d2t (offsets), t2d (a bool mask over the target's vocabulary),
  no embed_tokens (the target's are used);
- speculators' (vllm-project/speculators Eagle3SpeculatorConfig): speculators_model_type eagle3,
  architectures ["Eagle3Speculator"], the layer's Llama config under transformer_layer_config,
  draft_vocab_size, norm_before_residual, target_hidden_size, eagle_aux_hidden_state_layer_ids,
  speculators_config naming the verifier; weights in model.safetensors named layers.0.*.

The reduced vocabulary is a seeded random subset of the target's ids (sorted, as the authors'
frequency-ranked maps are stored by id), so the map is neither the identity nor a prefix.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

LAYER_NAMES = ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
               "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def head_weights(hidden: int, heads: int, kv_heads: int, intermediate: int, draft_ids: torch.Tensor,
                 target_vocab: int, prefix: str, seed: int, scale: float = 0.2,
                 lm_head_scale: float = 0.8) -> dict[str, torch.Tensor]:
    """Random weights of a one-layer head in a format's names (prefix 'midlayer.' or 'layers.0.');
    lm_head_scale sets how peaked its rows are (small: q spread over the reduced vocabulary)."""
    generator = torch.Generator().manual_seed(seed)
    head_dim = hidden // heads

    def randn(*shape):
        return scale * torch.randn(*shape, generator=generator)

    def norm():
        return 1.0 + 0.1 * torch.randn(hidden, generator=generator)

    layer = {"input_layernorm.weight": norm(), "hidden_norm.weight": norm(), "post_attention_layernorm.weight": norm(),
             "self_attn.q_proj.weight": randn(heads * head_dim, 2 * hidden),
             "self_attn.k_proj.weight": randn(kv_heads * head_dim, 2 * hidden),
             "self_attn.v_proj.weight": randn(kv_heads * head_dim, 2 * hidden),
             "self_attn.o_proj.weight": randn(hidden, heads * head_dim),
             "mlp.gate_proj.weight": randn(intermediate, hidden), "mlp.up_proj.weight": randn(intermediate, hidden),
             "mlp.down_proj.weight": randn(hidden, intermediate)}
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    return {**{prefix + name: tensor for name, tensor in layer.items()},
            "fc.weight": randn(hidden, 3 * hidden), "norm.weight": norm(),
            "lm_head.weight": lm_head_scale / scale * randn(len(draft_ids), hidden),
            "d2t": draft_ids - torch.arange(len(draft_ids)), "t2d": t2d}


def draft_vocabulary(target_vocab: int, draft_vocab: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(target_vocab, generator=generator)[:draft_vocab].sort().values


def build_eagle3_head(target_dir: Path, folder: Path, form: str, draft_vocab: int = 256, seed: int = 7,
                      aux_layers: list[int] | None = None, lm_head_scale: float = 0.8) -> Path:
    """An EAGLE-3 head look-alike for the target in target_dir, in `form` ('eagle' or 'speculators')."""
    target = json.loads((target_dir / "config.json").read_text())
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    heads, kv_heads = target["num_attention_heads"], target["num_key_value_heads"]
    intermediate = target["intermediate_size"]
    draft_ids = draft_vocabulary(vocab, draft_vocab, seed)
    layer = {"hidden_size": hidden, "intermediate_size": intermediate, "num_attention_heads": heads,
             "num_key_value_heads": kv_heads, "num_hidden_layers": 1, "hidden_act": "silu",
             "rms_norm_eps": target.get("rms_norm_eps", 1e-5), "vocab_size": vocab,
             "max_position_embeddings": target["max_position_embeddings"],
             "rope_theta": target.get("rope_theta", 10000.0),
             **({"rope_scaling": target["rope_scaling"]} if target.get("rope_scaling") else {}),
             "bos_token_id": target.get("bos_token_id"), "eos_token_id": target.get("eos_token_id")}
    folder.mkdir(parents=True, exist_ok=True)
    if form == "eagle":
        config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **layer,
                  "draft_vocab_size": draft_vocab, "tie_word_embeddings": False, "torch_dtype": "float16",
                  "transformers_version": "4.28.1", "use_cache": True, "pad_token_id": 0}
        if aux_layers is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers}
        weights = head_weights(hidden, heads, kv_heads, intermediate, draft_ids, vocab, "midlayer.", seed,
                               lm_head_scale=lm_head_scale)
        torch.save({name: tensor.to(torch.float16) if tensor.is_floating_point() else tensor
                    for name, tensor in weights.items()}, folder / "pytorch_model.bin")
    elif form == "speculators":
        config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                  "transformer_layer_config": {"model_type": "llama", **layer, "torch_dtype": "bfloat16"},
                  "draft_vocab_size": draft_vocab, "norm_before_residual": True, "target_hidden_size": hidden,
                  "eagle_aux_hidden_state_layer_ids": aux_layers, "embed_requires_grad": False,
                  "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                         "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                         "verifier": {"name_or_path": str(target_dir),
                                                      "architectures": target.get("architectures")}},
                  "speculators_version": "0.3.0", "torch_dtype": "bfloat16"}
        weights = head_weights(hidden, heads, kv_heads, intermediate, draft_ids, vocab, "layers.0.", seed,
                               lm_head_scale=lm_head_scale)
        save_file({name: (tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor).contiguous()
                   for name, tensor in weights.items()}, str(folder / "model.safetensors"))
    else:
        raise ValueError(f"unknown head format {form!r}")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


# The layers the speculators look-alike names (of the Llama-3 look-alike target's two); the EAGLE
# authors' look-alike names none and takes the default.
SPECULATORS_LAYERS = [1, 0, 1]


def llama3_with_heads(root: Path):
    """(the Llama-3 look-alike family (tests.checkpoint_fixtures.build_llama3), {format: head folder})."""
    from tests.checkpoint_fixtures import build_llama3

    family = build_llama3(root)
    return family, {"eagle": build_eagle3_head(family.target, root / "head-eagle", "eagle"),
                    "speculators": build_eagle3_head(family.target, root / "head-speculators", "speculators",
                                                     aux_layers=SPECULATORS_LAYERS)}
