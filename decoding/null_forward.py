"""A forward that costs nothing, for measuring what the serving stack itself can carry.

Why: the stack's capacity (ingress, router, channels, engine loops, scheduler, block manager) is
hidden behind the models' arithmetic on a small CPU box, so its limits and regressions cannot be
seen there. With `null_forward_agreement` set (a model spec's option, for benches) the engine's own
runner changes one thing: its model call returns `null_logits` of the kept positions instead of
computing them. Everything around it (the step's plan, the pool, the layout, the blocks, the
logits' copy and split) runs as it does for a real model, over the real checkpoint's tokenizer,
vocabulary and KV layout.

The rule: the reference token after position p, whose token is t, is a hash of (t, p) over the
ids that are not EOS, so a stream runs to its length. A runner whose `agreement` is a
predicts that token with probability a and another one otherwise, decided by a second hash of
(t, p): a draft with agreement a, verified by a target with agreement 1, has its tokens accepted
at rate a, as a draft's acceptance rate would be, and every run sees the same outcomes.
The logits are one-hot (0 for the predicted token, a large negative number elsewhere), so greedy and
sampled decoding both follow the rule.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

OFF_LOGIT = -1e4              # every token but the predicted one: exp() of it is 0 in float32
AGREEMENT_RESOLUTION = 1 << 16


def _mix(tokens: torch.Tensor, positions: torch.Tensor, salt: int) -> torch.Tensor:
    """A non-negative int64 hash of (token, position, salt), elementwise (a multiply-xorshift mix,
    every product kept under 2 ** 62 so nothing overflows)."""
    value = tokens.long() * 0x9E3779B1 + positions.long() * 0x85EBCA77 + salt * 0xC2B2AE3D
    value = (value ^ (value >> 15)) & 0xFFFFFFFF
    value = value * 0x2C1B3C6D
    return value ^ (value >> 29)


def allowed_tokens(vocab_size: int, eos_token_ids: Iterable[int]) -> torch.Tensor:
    """The ids the rule may predict: every id of the vocabulary but EOS."""
    eos = set(int(token) for token in eos_token_ids)
    return torch.tensor([token for token in range(vocab_size) if token not in eos], dtype=torch.long)


def predicted_tokens(tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
                     agreement: float) -> torch.Tensor:
    """What a runner with this agreement predicts after each (token, position), one of `allowed`:
    the reference token (a hash of the pair) where a second hash falls under the agreement, the
    next allowed id after it elsewhere."""
    reference = _mix(tokens, positions, 1) % allowed.numel()
    agrees = _mix(tokens, positions, 2) % AGREEMENT_RESOLUTION < round(agreement * AGREEMENT_RESOLUTION)
    return allowed[torch.where(agrees, reference, (reference + 1) % allowed.numel())]


def null_logits(tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor, agreement: float,
                width: int) -> torch.Tensor:
    """float32 logits [N, width] that put all mass on `predicted_tokens` of the N (token, position) pairs."""
    predicted = predicted_tokens(tokens, positions, allowed, agreement)
    logits = torch.full((tokens.numel(), width), OFF_LOGIT, dtype=torch.float32, device=tokens.device)
    return logits.scatter_(1, predicted.view(-1, 1), 0.0)
