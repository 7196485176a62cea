"""A tiny random draft/target pair on the shipped tokenizer, built in tests (no download, fast).

The draft is the target with perturbed weights, so rounds see a real mix of accepted and
rejected tokens (an unrelated random draft would reject almost everything).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from cluster.config import DEFAULT_MODELS_DIR

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
