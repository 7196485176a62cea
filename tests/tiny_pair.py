"""A tiny random draft/target pair on the shipped tokenizer, built in tests (no download, fast).

The draft is the target with perturbed weights, so rounds see a real mix of accepted and
rejected tokens (an unrelated random draft would reject almost everything).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from cluster.config import DEFAULT_MODELS_DIR, SpecServeConfig

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


ARCHITECTURES = ("llama", "qwen2", "mistral", "gpt2")


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
    elif architecture == "gpt2":
        config = GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=max_position_embeddings, **shared,
                            **overrides)
        cls = GPT2LMHeadModel
    else:
        raise ValueError(f"unknown architecture {architecture!r}")
    config._attn_implementation = attn_implementation
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
