"""EAGLE-3 head checkpoints as users download them: which format a folder is, which target layers
it reads, and its weights loaded into decoding.eagle3_head.Eagle3Head for a given target.

Two formats exist in the field, told apart by config.json (docs/eagle3.md has both layouts):

- the EAGLE authors' (SafeAILab/EAGLE; `yuhuili/EAGLE3-*` heads): a flat Llama config naming an
  Eagle3 architecture, with `draft_vocab_size`; weights `midlayer.*`, `fc`, `norm`, `lm_head`,
  `d2t`, `t2d` (pytorch_model.bin or model.safetensors);
- vllm-project/speculators': `speculators_model_type: eagle3`, the layer's Llama config under
  `transformer_layer_config`, `draft_vocab_size`, `norm_before_residual`, `target_hidden_size`,
  `eagle_aux_hidden_state_layer_ids`; weights `layers.0.*` and the same others.

Why refuse rather than adapt: a head trained for another target (another hidden size, another
vocabulary) or missing its draft -> target map would still draft, only nonsense or wrong ids,
and no error would ever say why acceptance is zero. Each check names what is wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from specserve.decoding.eagle3_head import Eagle3Head, Eagle3Shape
from specserve.decoding.weight_layout import input_major_linears

EAGLE3_FORMATS = ("eagle", "speculators")
# The decoder layer's weights under each format's prefix, by our module's names.
_LAYER_WEIGHTS = {
    "input_layernorm.weight": "input_layernorm", "hidden_norm.weight": "hidden_norm",
    "post_attention_layernorm.weight": "post_attention_layernorm",
    "self_attn.q_proj.weight": "q_proj.weight", "self_attn.k_proj.weight": "k_proj.weight",
    "self_attn.v_proj.weight": "v_proj.weight", "self_attn.o_proj.weight": "o_proj.weight",
    "mlp.gate_proj.weight": "gate_proj.weight", "mlp.up_proj.weight": "up_proj.weight",
    "mlp.down_proj.weight": "down_proj.weight",
}
_LAYER_PREFIX = {"eagle": "midlayer.", "speculators": "layers.0."}
_OTHER_WEIGHTS = {"fc.weight": "fc.weight", "norm.weight": "norm", "lm_head.weight": "lm_head.weight"}
# Saved beside the weights and not needed to draft: the target -> draft map (the inverse of d2t)
# and speculators' frozen copies of the verifier's norm and head (used only in training).
_IGNORED = ("t2d", "verifier_norm.weight", "verifier_lm_head.weight")


class Eagle3CheckpointError(ValueError):
    """The folder is not an EAGLE-3 head this target can use (the message says why)."""


@dataclass(frozen=True)
class LoadedHead:
    head: Eagle3Head
    aux_layers: tuple[int, int, int]   # the target layers whose inputs the head fuses, low to high
    format: str                        # one of EAGLE3_FORMATS
    path: str

    def describe(self) -> str:
        """For the start-up line: what was loaded and what it reads."""
        shape = self.head.shape
        return (f"{self.path}: EAGLE-3 head ({self.format} format), hidden {shape.hidden_size}, "
                f"{shape.draft_vocab_size} of {shape.vocab_size} tokens, target layers {list(self.aux_layers)}")


def _config(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / "config.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def head_format(folder: str | Path) -> str | None:
    """'speculators', 'eagle' (the EAGLE authors': a flat Llama config naming an Eagle3
    architecture), or None when the folder's config.json is not an EAGLE-3 head's (a draft model)."""
    config = _config(Path(folder))
    if config.get("speculators_model_type") == "eagle3":
        return "speculators"
    if "hidden_size" in config and any("eagle3" in str(name).lower() for name in config.get("architectures") or []):
        return "eagle"
    return None


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers a head reads when its config does not say: a low, a middle and a high one
    (2, n // 2, n - 3), as vLLM picks for Llama targets; clamped into range for targets of fewer
    than six layers (only look-alikes are that small)."""
    return tuple(min(max(layer, 0), num_layers - 1) for layer in (2, num_layers // 2, num_layers - 3))


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    safetensors = folder / "model.safetensors"
    if safetensors.is_file():
        return load_file(str(safetensors))
    binary = folder / "pytorch_model.bin"
    if binary.is_file():
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise Eagle3CheckpointError(f"{folder}: no model.safetensors or pytorch_model.bin")


def _layer_config(config: dict[str, Any], form: str) -> dict[str, Any]:
    return dict(config.get("transformer_layer_config") or {}) if form == "speculators" else config


def _aux_layers(config: dict[str, Any], num_target_layers: int) -> tuple[int, int, int]:
    named = (config.get("eagle_aux_hidden_state_layer_ids")
             or (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
    if named is None:
        return default_aux_layers(num_target_layers)
    layers = tuple(int(layer) for layer in named)
    if len(layers) != 3 or not all(0 <= layer < num_target_layers for layer in layers):
        raise Eagle3CheckpointError(f"eagle_aux_hidden_state_layer_ids {list(layers)} must name 3 of the target's "
                                    f"{num_target_layers} layers (0..{num_target_layers - 1})")
    return layers


def _check(condition: bool, folder: Path, why: str) -> None:
    if not condition:
        raise Eagle3CheckpointError(f"{folder}: not an EAGLE-3 head for this target: {why}")


def load_eagle3_head(folder: str | Path, target_model) -> LoadedHead:
    """The head in `folder` built for target_model (a transformers causal LM): in the target's dtype
    and device, drafting with the target's input embeddings unless the checkpoint ships its own.
    Eagle3CheckpointError naming why when the folder is not a head, not a head this code runs (more
    than one layer), or not one for this target (hidden size, vocabulary, draft -> target map,
    layer ids out of range)."""
    folder = Path(folder)
    form = head_format(folder)
    if form is None:
        raise Eagle3CheckpointError(f"{folder}: config.json names no EAGLE-3 head (an Eagle3 architecture or "
                                    "speculators_model_type eagle3)")
    config = _config(folder)
    layer = _layer_config(config, form)
    target_config = target_model.config.get_text_config(decoder=True)
    target_hidden, target_vocab = int(target_config.hidden_size), int(target_config.vocab_size)
    hidden = int(layer["hidden_size"])
    vocab = int(layer.get("vocab_size", target_vocab))
    draft_vocab = int(config.get("draft_vocab_size") or layer.get("draft_vocab_size") or vocab)
    head_target_hidden = int(config.get("target_hidden_size") or layer.get("target_hidden_size") or hidden)
    _check(int(layer.get("num_hidden_layers", 1)) == 1, folder,
           f"{layer.get('num_hidden_layers')} decoder layers (specserve runs one-layer heads)")
    _check(head_target_hidden == target_hidden, folder,
           f"it fuses features of hidden size {head_target_hidden}, the target's hidden size is {target_hidden}")
    _check(vocab == target_vocab, folder, f"its vocabulary has {vocab} tokens, the target's {target_vocab}")
    heads = int(layer["num_attention_heads"])
    shape = Eagle3Shape(
        hidden_size=hidden, target_hidden_size=head_target_hidden, intermediate_size=int(layer["intermediate_size"]),
        num_heads=heads, num_kv_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or hidden // heads), vocab_size=vocab, draft_vocab_size=draft_vocab,
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        norm_before_residual=bool(config.get("norm_before_residual", layer.get("norm_before_residual", False))),
        rope_config=_rope_config(layer, hidden, heads))
    weights = _weights(folder)
    prefix = _LAYER_PREFIX[form]
    renamed: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name.startswith(prefix) and name[len(prefix):] in _LAYER_WEIGHTS:
            renamed[_LAYER_WEIGHTS[name[len(prefix):]]] = tensor
        elif name in _OTHER_WEIGHTS:
            renamed[_OTHER_WEIGHTS[name]] = tensor
        elif name not in (*_IGNORED, "d2t", "embed_tokens.weight"):
            raise Eagle3CheckpointError(f"{folder}: unexpected weight {name!r} for a one-layer EAGLE-3 head "
                                        f"({form} format)")
    fc = renamed.get("fc.weight")
    _check(fc is not None and tuple(fc.shape) == (hidden, 3 * target_hidden), folder,
           f"its fusion layer fc is {None if fc is None else tuple(fc.shape)}, a head for this target has "
           f"({hidden}, {3 * target_hidden}) (3 layers x hidden size {target_hidden})")
    lm_head = renamed.get("lm_head.weight")
    _check(lm_head is not None and tuple(lm_head.shape) == (draft_vocab, hidden), folder,
           f"lm_head is {None if lm_head is None else tuple(lm_head.shape)}, draft_vocab_size {draft_vocab} x "
           f"hidden {hidden} expected")
    draft_to_target = _draft_to_target(weights.get("d2t"), draft_vocab, target_vocab, folder)
    embed = _embedding(weights.get("embed_tokens.weight"), target_model, hidden, target_vocab, folder)
    target_device = next(target_model.parameters()).device
    dtype = next(target_model.parameters()).dtype
    head = Eagle3Head(shape, embed)
    missing = sorted(set(head.state_dict()) - set(renamed) - {"embed.weight"})
    _check(not missing, folder, f"missing weights {missing}")
    head.load_state_dict({**renamed, "embed.weight": embed.weight}, strict=True)
    head.draft_to_target = draft_to_target
    head.to(device=target_device, dtype=dtype)
    # The rotary frequencies stay float32 whatever the weights' dtype, as the target's.
    head.rotary = LlamaRotaryEmbedding(shape.rope_config).to(target_device)
    head.eval().requires_grad_(False)
    input_major_linears(head)   # on the CPU, as the engines' weights (decoding/weight_layout.py)
    return LoadedHead(head, _aux_layers({**layer, **config}, int(target_config.num_hidden_layers)), form, str(folder))


def _rope_config(layer: dict[str, Any], hidden: int, heads: int) -> LlamaConfig:
    keys = ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings", "head_dim",
            "partial_rotary_factor")
    return LlamaConfig(hidden_size=hidden, num_attention_heads=heads,
                       **{key: layer[key] for key in keys if layer.get(key) is not None})


def _draft_to_target(d2t: torch.Tensor | None, draft_vocab: int, target_vocab: int, folder: Path) -> torch.Tensor:
    """Absolute target ids of the head's rows. d2t stores offsets (target id = draft id + d2t[id]),
    as both formats save it; a head over the whole vocabulary may leave it out."""
    if d2t is None:
        _check(draft_vocab == target_vocab, folder,
               f"no d2t (draft -> target id map) for a reduced vocabulary of {draft_vocab} of {target_vocab} tokens")
        return torch.arange(draft_vocab)
    _check(tuple(d2t.shape) == (draft_vocab,), folder,
           f"d2t has shape {tuple(d2t.shape)}, one offset per draft token ({draft_vocab}) expected")
    ids = torch.arange(draft_vocab) + d2t.long()
    _check(bool(((ids >= 0) & (ids < target_vocab)).all()), folder,
           f"d2t maps draft tokens outside the target's vocabulary of {target_vocab}")
    _check(ids.unique().numel() == draft_vocab, folder, "d2t maps two draft tokens to one target token")
    return ids


def _embedding(own: torch.Tensor | None, target_model, hidden: int, target_vocab: int, folder: Path) -> torch.nn.Embedding:
    """The checkpoint's embeddings when it ships them, else the target's (shared, not copied)."""
    if own is not None:
        _check(tuple(own.shape) == (target_vocab, hidden), folder,
               f"embed_tokens is {tuple(own.shape)}, ({target_vocab}, {hidden}) expected")
        return torch.nn.Embedding.from_pretrained(own, freeze=True)
    embed = target_model.get_input_embeddings()
    _check(embed.weight.shape[1] == hidden, folder,
           f"it ships no embeddings and its hidden size {hidden} is not the target's {embed.weight.shape[1]}")
    return embed


class TargetEmbeddings(torch.nn.Module):
    """What a head needs of its target, without the target's layers: its config and its input
    embeddings, read from the target's folder. A draft engine serving a head loads this, not the
    target (docs/eagle3.md#serving)."""

    def __init__(self, config, embed: torch.Tensor) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = torch.nn.Embedding.from_pretrained(embed, freeze=True)

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.embed_tokens


def target_embeddings(target_path: str | Path, dtype: torch.dtype, device: str | torch.device) -> TargetEmbeddings:
    """The target's config and input embedding matrix from its safetensors (one file or an
    index), in dtype on device; Eagle3CheckpointError when no embedding weight is found. On the
    meta device only its shape is read: a check that a head fits the target needs no more, and
    the matrix of a large target is gigabytes."""
    folder = Path(target_path)
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    index = folder / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
             else ["model.safetensors"])
    for name in files:
        if not (folder / name).is_file():
            continue
        with safe_open(str(folder / name), framework="pt") as weights:
            key = next((key for key in weights.keys() if key.endswith("embed_tokens.weight")), None)
            if key is None:
                continue
            if torch.device(device).type == "meta":
                return TargetEmbeddings(config, torch.empty(weights.get_slice(key).get_shape(), dtype=dtype,
                                                            device="meta"))
            return TargetEmbeddings(config, weights.get_tensor(key).to(device=device, dtype=dtype))
    raise Eagle3CheckpointError(f"{folder}: no embed_tokens weight in its safetensors files (an EAGLE-3 head "
                                "drafts with its target's input embeddings)")
