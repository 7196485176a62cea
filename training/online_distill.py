"""Distil the draft on captured verify rows (decoding/capture.py) and judge a candidate (issue 31).

The loss is the forward KL from the target to the draft over the partition {each captured top-k
id, everything else}: KL(p || q) = sum_top p log(p / q) + r log(r / q_rest), with r the target's
mass outside its top k and q_rest the draft's. It is zero exactly when the draft puts the
target's mass on every top-k id, and it never asks the draft for a distribution the capture did
not see. Positions the draft got wrong (rejected, or after a rejection in the block) weigh more:
they are where acceptance is lost (Online Speculative Decoding, Liu et al. 2024).

The canary's figure is expected acceptance, the mean over held-back positions of
sum_{x in top k} min(p(x), q(x)): a lower bound of sum_x min(p, q), the probability that
rejection sampling keeps a draft token; the bound is the same for every candidate, so
comparing candidates on it is fair. A candidate replaces the serving draft only if it beats it by
a margin: distillation with too high a learning rate can make a matched draft worse.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from decoding.capture import CapturedBlock

REJECTED_WEIGHT = 2.0  # a position at or after the block's first rejection counts this much more


@dataclass(frozen=True)
class PositionBatch:
    """Drafted positions as model inputs: each row is a context ending just before the position."""

    input_ids: torch.Tensor     # [N, T] right-padded with 0
    last_index: torch.Tensor    # [N] index in each row whose logits score the position
    top_ids: torch.Tensor       # [N, k]
    top_logprobs: torch.Tensor  # [N, k]
    weights: torch.Tensor       # [N]


def position_batch(blocks: Sequence[CapturedBlock], max_context: int, rejected_weight: float = REJECTED_WEIGHT) -> PositionBatch:
    """One row per drafted position of blocks, its context cut to the last max_context tokens."""
    rows, last, top_ids, top_logprobs, weights = [], [], [], [], []
    for block in blocks:
        for i in range(block.num_positions):
            context = (list(block.context) + list(block.drafted[:i]))[-max_context:]
            rows.append(context)
            last.append(len(context) - 1)
            top_ids.append(torch.as_tensor(block.top_ids[i], dtype=torch.long))
            top_logprobs.append(torch.as_tensor(block.top_logprobs[i], dtype=torch.float32))
            weights.append(rejected_weight if i >= block.accepted else 1.0)
    width = max(len(row) for row in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    for n, row in enumerate(rows):
        input_ids[n, : len(row)] = torch.tensor(row)
    return PositionBatch(input_ids, torch.tensor(last), torch.stack(top_ids), torch.stack(top_logprobs),
                         torch.tensor(weights))


def topk_forward_kl(draft_logits: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row over {top-k ids, the rest}: draft logits [N, V], target top-k [N, k]."""
    draft_logprobs = F.log_softmax(draft_logits.float(), dim=-1)
    q_top = draft_logprobs.gather(-1, top_ids)                                       # [N, k]
    p_top = top_logprobs.exp()
    residual = (1.0 - p_top.sum(-1)).clamp(min=0.0)                                  # [N]
    q_rest = torch.log1p(-q_top.exp().sum(-1).clamp(max=1.0 - 1e-6))                 # log of the draft's rest
    kl_top = (p_top * (top_logprobs - q_top)).sum(-1)
    kl_rest = torch.where(residual > 0, residual * (torch.log(residual.clamp(min=1e-12)) - q_rest),
                          torch.zeros_like(residual))
    return kl_top + kl_rest


def expected_acceptance(draft_logits: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor) -> torch.Tensor:
    """sum_{x in top k} min(p(x), q(x)) per row (a lower bound of the true acceptance)."""
    q_top = F.softmax(draft_logits.float(), dim=-1).gather(-1, top_ids)
    return torch.minimum(top_logprobs.exp(), q_top).sum(-1)


def _position_logits(model: torch.nn.Module, batch: PositionBatch) -> torch.Tensor:
    attention = (torch.arange(batch.input_ids.shape[1]) <= batch.last_index.unsqueeze(-1)).long()
    logits = model(input_ids=batch.input_ids, attention_mask=attention).logits
    return logits[torch.arange(len(batch.last_index)), batch.last_index]


@torch.no_grad()
def mean_expected_acceptance(model: torch.nn.Module, batch: PositionBatch, chunk: int = 64) -> float:
    """The canary's figure for one draft on held-back positions."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(batch.last_index), chunk):
        part = _slice(batch, slice(start, start + chunk))
        total += float(expected_acceptance(_position_logits(model, part), part.top_ids, part.top_logprobs).sum())
        count += len(part.last_index)
    return total / max(count, 1)


def _slice(batch: PositionBatch, index) -> PositionBatch:
    return PositionBatch(batch.input_ids[index], batch.last_index[index], batch.top_ids[index],
                         batch.top_logprobs[index], batch.weights[index])


@dataclass(frozen=True)
class DistillSettings:
    lr: float = 1e-4
    epochs: int = 4
    batch_size: int = 32
    seed: int = 0


def distill_on_positions(model: torch.nn.Module, batch: PositionBatch, settings: DistillSettings,
                         should_stop=lambda: False) -> int:
    """Train model in place on captured positions (weighted forward KL); -> optimizer steps taken.
    should_stop is polled between steps, so a trainer yields within one step when load returns."""
    generator = torch.Generator().manual_seed(settings.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    model.train()
    steps = 0
    for _ in range(settings.epochs):
        order = torch.randperm(len(batch.last_index), generator=generator)
        for start in range(0, len(order), settings.batch_size):
            if should_stop():
                model.eval()
                return steps
            part = _slice(batch, order[start : start + settings.batch_size])
            losses = topk_forward_kl(_position_logits(model, part), part.top_ids, part.top_logprobs)
            loss = (losses * part.weights).sum() / part.weights.sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
    model.eval()
    return steps


def canary_accepts(current: float, candidate: float, margin: float) -> bool:
    """Replace the serving draft only if the candidate's expected acceptance beats it by margin."""
    return candidate >= current + margin
