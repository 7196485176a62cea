"""Distil the draft on captured verify rows (decoding/capture.py) and judge a candidate
(docs/online-learning.md).

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
from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.nn.functional as F

from specserve.decoding.capture import CapturedBlock

PLAIN_HEAD_MODELS = {"llama", "qwen2", "mistral"}  # logits = output embedding of the base model's last hidden state
REJECTED_WEIGHT = 2.0  # a position at or after the block's first rejection counts this much more


@dataclass(frozen=True)
class PositionBatch:
    """Drafted positions as model inputs. A block's K positions share one row, its context plus
    all but its last drafted token, so one forward scores them all (a row per position would
    repeat the context K times); position n's logits are row position_row[n] at position_index[n]."""

    input_ids: torch.Tensor       # [R, T] right-padded with 0
    row_lengths: torch.Tensor     # [R]
    position_row: torch.Tensor    # [N]
    position_index: torch.Tensor  # [N]
    top_ids: torch.Tensor         # [N, k]
    top_logprobs: torch.Tensor    # [N, k]
    weights: torch.Tensor         # [N]

    @property
    def num_positions(self) -> int:
        return len(self.position_row)

    @property
    def num_rows(self) -> int:
        return len(self.row_lengths)

    def to(self, device: str) -> "PositionBatch":
        return PositionBatch(*(getattr(self, f.name).to(device) for f in fields(self)))


@dataclass(frozen=True)
class TrainingDevice:
    """Where a draft trains and how: the model and each batch on `device`; forwards in float32
    (autocast_dtype None) or autocast to autocast_dtype, the weights and optimizer state staying
    float32 (mixed precision, as a training script on a GPU does)."""

    device: str = "cpu"
    autocast_dtype: torch.dtype | None = None

    def autocast(self):
        return torch.autocast(torch.device(self.device).type, dtype=self.autocast_dtype,
                              enabled=self.autocast_dtype is not None)


def training_device(num_gpus: float, cuda_available: bool, bf16_supported: bool) -> TrainingDevice:
    """A trainer granted a GPU that this process sees trains there, with bf16 autocast when the
    device supports it (else float32: fp16 would need loss scaling); otherwise on the CPU in
    float32 (bf16 matrix products are slower there)."""
    if num_gpus > 0 and cuda_available:
        return TrainingDevice("cuda", torch.bfloat16 if bf16_supported else None)
    return TrainingDevice()


def this_process_training_device(num_gpus: float) -> TrainingDevice:
    """training_device for this process's hardware (the only CUDA query of training)."""
    cuda = torch.cuda.is_available()
    return training_device(num_gpus, cuda, cuda and torch.cuda.is_bf16_supported())


def position_batch(blocks: Sequence[CapturedBlock], max_context: int, rejected_weight: float = REJECTED_WEIGHT) -> PositionBatch:
    """One row per block, one entry per drafted position. A row keeps its last max_context
    tokens, so when it is cut the block's earlier positions see up to K - 1 fewer leading tokens
    than the last (a negligible loss at max_context in the hundreds)."""
    rows, rows_of, indices, top_ids, top_logprobs, weights = [], [], [], [], [], []
    for block in blocks:
        count = block.num_positions
        if count == 0:
            continue
        row = (list(block.context) + list(block.drafted[:-1]))[-max_context:]
        first = len(row) - count  # index scoring drafted[0]
        if first < 0:  # the block alone is longer than max_context: keep its positions that fit
            continue
        for i in range(count):
            rows_of.append(len(rows))
            indices.append(first + i)
            weights.append(rejected_weight if i >= block.accepted else 1.0)
        rows.append(row)
        top_ids.append(torch.as_tensor(np.asarray(block.top_ids), dtype=torch.long))
        top_logprobs.append(torch.as_tensor(np.asarray(block.top_logprobs), dtype=torch.float32))
    width = max(len(row) for row in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    for n, row in enumerate(rows):
        input_ids[n, : len(row)] = torch.tensor(row)
    return PositionBatch(input_ids, torch.tensor([len(row) for row in rows]), torch.tensor(rows_of),
                         torch.tensor(indices), torch.cat(top_ids), torch.cat(top_logprobs), torch.tensor(weights))


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
    """Draft logits [N, V] at every position of batch, one forward over its rows. The output
    head runs only at the captured positions (K of a row's T tokens): over a large vocabulary it
    is most of a small draft's cost. Models whose head is not a plain output embedding (logit
    scaling, soft-capping) get their full forward."""
    attention = (torch.arange(batch.input_ids.shape[1], device=batch.input_ids.device)
                 < batch.row_lengths.unsqueeze(-1)).long()
    head = model.get_output_embeddings()
    if getattr(model.config, "model_type", None) in PLAIN_HEAD_MODELS and head is not None:
        hidden = model.base_model(input_ids=batch.input_ids, attention_mask=attention).last_hidden_state
        return head(hidden[batch.position_row, batch.position_index])
    logits = model(input_ids=batch.input_ids, attention_mask=attention).logits
    return logits[batch.position_row, batch.position_index]


@torch.no_grad()
def mean_expected_acceptance(model: torch.nn.Module, batch: PositionBatch, rows_per_chunk: int = 16,
                             on: TrainingDevice = TrainingDevice()) -> float:
    """The canary's figure for one draft (on `on.device`) on held-back positions (kept on the CPU)."""
    model.eval()
    total = 0.0
    for chunk in _row_chunks(batch, torch.arange(batch.num_rows), rows_per_chunk):
        chunk = chunk.to(on.device)
        with on.autocast():
            logits = _position_logits(model, chunk)
        total += float(expected_acceptance(logits, chunk.top_ids, chunk.top_logprobs).sum())
    return total / max(batch.num_positions, 1)


def _rows(batch: PositionBatch, rows: torch.Tensor) -> PositionBatch:
    """The sub-batch of these rows and all their positions."""
    renumber = torch.full((batch.num_rows,), -1, dtype=torch.long)
    renumber[rows] = torch.arange(len(rows))
    kept = renumber[batch.position_row] >= 0
    width = int(batch.row_lengths[rows].max())
    return PositionBatch(batch.input_ids[rows, :width], batch.row_lengths[rows], renumber[batch.position_row[kept]],
                         batch.position_index[kept], batch.top_ids[kept], batch.top_logprobs[kept], batch.weights[kept])


def _row_chunks(batch: PositionBatch, order: torch.Tensor, rows_per_chunk: int):
    for start in range(0, len(order), rows_per_chunk):
        yield _rows(batch, order[start : start + rows_per_chunk])


@dataclass(frozen=True)
class DistillSettings:
    lr: float = 1e-4
    epochs: int = 4
    batch_size: int = 32  # positions per optimizer step, in whole blocks (at least one)
    seed: int = 0
    on: TrainingDevice = TrainingDevice()   # the model is there; batches move there a step at a time


def distill_on_positions(model: torch.nn.Module, batch: PositionBatch, settings: DistillSettings,
                         should_stop=lambda: False, optimizer: torch.optim.Optimizer | None = None,
                         steps_done: int = 0) -> int:
    """Train model in place on captured positions (weighted forward KL); -> optimizer steps taken
    in all. should_stop is polled between steps, so a trainer yields within one step when load
    returns; a stopped run resumes where it stopped when called again with the same model, batch,
    settings and optimizer and steps_done, its return value (the step order is seeded)."""
    generator = torch.Generator().manual_seed(settings.seed)
    optimizer = optimizer if optimizer is not None else torch.optim.AdamW(model.parameters(), lr=settings.lr)
    model.train()
    steps = 0
    positions_per_row = max(1, round(batch.num_positions / max(batch.num_rows, 1)))
    rows_per_step = max(1, settings.batch_size // positions_per_row)
    for _ in range(settings.epochs):
        for part in _row_chunks(batch, torch.randperm(batch.num_rows, generator=generator), rows_per_step):
            if steps < steps_done:   # trained before the run stopped
                steps += 1
                continue
            if should_stop():
                model.eval()
                return steps
            part = part.to(settings.on.device)
            with settings.on.autocast():
                logits = _position_logits(model, part)
            losses = topk_forward_kl(logits, part.top_ids, part.top_logprobs)
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
