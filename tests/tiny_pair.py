"""A tiny random draft/target pair on the shipped tokenizer, built in tests (no download, fast).

The draft is the target with perturbed weights, so rounds see a real mix of accepted and
rejected tokens (an unrelated random draft would reject almost everything).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoTokenizer,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from specserve.common.config import DEFAULT_MODELS_DIR, SpecServeConfig

TOKENIZER_DIR = DEFAULT_MODELS_DIR / "tokenizer"


def tiny_config(vocab_size: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                       tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def tiny_llama(vocab_size: int = 96, seed: int = 0, max_position_embeddings: int = 128) -> LlamaForCausalLM:
    """A tiny random Llama for unit tests (no tokenizer), with logits large enough to be decisive."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_position_embeddings, initializer_range=0.2,
                         bos_token_id=0, eos_token_id=1, pad_token_id=None)
    return LlamaForCausalLM(config).eval()


ARCHITECTURES = ("llama", "qwen2", "mistral", "gpt2", "qwen3", "qwen3_moe", "gemma3", "gemma2", "phi3")
# Windows shorter than the test prompts, so a layer that ignored its window would be caught.
SHORT_WINDOW = 8


def tiny_model(architecture: str, seed: int = 0, vocab_size: int = 96, max_position_embeddings: int = 128,
               attn_implementation: str = "sdpa", **overrides) -> PreTrainedModel:
    """A tiny random causal LM of one architecture (2 layers, GQA where it exists), fp32, eval mode.
    Large initial weights make logits decisive, so a wrong position or mask moves them visibly."""
    shared = dict(vocab_size=vocab_size, initializer_range=0.2, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    rope = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=max_position_embeddings, **shared)
    if architecture == "llama":
        config, cls = LlamaConfig(**rope, **overrides), LlamaForCausalLM
    elif architecture == "qwen2":
        config, cls = Qwen2Config(**rope, **overrides), Qwen2ForCausalLM
    elif architecture == "mistral":
        config, cls = MistralConfig(**{"sliding_window": None, **rope, **overrides}), MistralForCausalLM
    elif architecture == "qwen3":   # per-head q/k norms
        config, cls = Qwen3Config(**rope, head_dim=8, **overrides), Qwen3ForCausalLM
    elif architecture == "qwen3_moe":   # q/k norms and a routed-experts MLP
        config = Qwen3MoeConfig(**rope, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                **overrides)
        cls = Qwen3MoeForCausalLM
    elif architecture == "gemma3":   # sliding-window layers beside a global one, scaled embeddings
        config = Gemma3TextConfig(**{**rope, "num_hidden_layers": 3}, head_dim=8, query_pre_attn_scalar=8,
                                  sliding_window=SHORT_WINDOW, **{"layer_types": ["sliding_attention",
                                                                                  "sliding_attention",
                                                                                  "full_attention"], **overrides})
        cls = Gemma3ForCausalLM
    elif architecture == "gemma2":   # attention logit soft-capping and windows on alternate layers
        config = Gemma2Config(**rope, head_dim=8, query_pre_attn_scalar=8, sliding_window=SHORT_WINDOW,
                              attn_logit_softcapping=5.0, final_logit_softcapping=10.0, **overrides)
        cls = Gemma2ForCausalLM
    elif architecture == "phi3":   # fused qkv and gate_up projections, a window on every layer
        config, cls = Phi3Config(**{"sliding_window": 12, **rope, **overrides}), Phi3ForCausalLM
    elif architecture == "gpt2":
        config = GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=max_position_embeddings, **shared,
                            **overrides)
        cls = GPT2LMHeadModel
    else:
        raise ValueError(f"unknown architecture {architecture!r}")
    # Gemma 2 soft-caps attention logits, which transformers' sdpa cannot.
    config._attn_implementation = "eager" if architecture == "gemma2" else attn_implementation
    torch.manual_seed(seed)
    return cls(config).eval()


def make_tiny_pair(root: Path, seed: int = 0, noise: float = 0.3) -> tuple[Path, Path]:
    """Save target and draft (with the shipped tokenizer) under root; return their paths."""
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    torch.manual_seed(seed)
    target = LlamaForCausalLM(tiny_config(len(tokenizer)))
    # Larger logits make greedy/argmax chains less flat and the draft's agreement meaningful.
    with torch.no_grad():
        target.model.embed_tokens.weight.mul_(20)
    draft = LlamaForCausalLM(tiny_config(len(tokenizer)))
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(noise * param.std() * torch.randn_like(param))
    paths = root / "target", root / "draft"
    for model, path in zip((target, draft), paths):
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return paths


def tiny_pair_config(root: Path, model_name: str, port: int, **sections: dict) -> SpecServeConfig:
    """A config serving a fresh tiny pair under root on port, with extra config sections."""
    target_path, draft_path = make_tiny_pair(root)
    return SpecServeConfig.model_validate({"model_name": model_name, "target": {"path": str(target_path)},
                                           "draft": {"path": str(draft_path)}, "http": {"port": port},
                                           **sections})
