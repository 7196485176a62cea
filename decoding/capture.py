"""What verification already computed, kept to teach the draft (docs/online-learning.md): a bounded buffer of the
target's distributions at drafted positions.

Why top-k plus the residual: a full row is the vocabulary wide, and the forward KL the draft is
trained on needs only the target's mass where it is large. Keeping the k most likely ids, their
log-probabilities and (implicitly) the mass left over gives the KL between the target and the draft
over the partition {each top-k id, everything else}: a proper divergence that is zero only when the
draft matches the target on that partition (training/online_distill.py). Expected acceptance
sum_x min(p, q) over the top-k ids is a lower bound of the true one, the same bound for every
candidate draft, so comparing candidates on it is fair.

Nothing here is on by default and nothing is written to disk unless asked: it is users' traffic.
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass(frozen=True)
class CapturedBlock:
    """One verified block: the target's top-k at each of its K drafted positions.

    Position i scored the token after context + drafted[:i]; drafted[i] is what the draft
    proposed there and `accepted` how many of the block verification kept."""

    request_id: str
    context: tuple[int, ...]
    drafted: tuple[int, ...]
    accepted: int
    top_ids: np.ndarray        # int32 [K, k]
    top_logprobs: np.ndarray   # float32 [K, k]
    draft_version: int = 0

    @property
    def num_positions(self) -> int:
        return len(self.drafted)

    @property
    def held_back(self) -> bool:
        """In the validation slice: decided by the request id, so one request's blocks never
        land on both sides (its positions are correlated)."""
        return hashlib.sha256(self.request_id.encode()).digest()[0] % HELD_BACK_EVERY == 0


HELD_BACK_EVERY = 5  # one request in five is held back for the canary


def top_rows(logits: torch.Tensor, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [n, k], log-probabilities float32 [n, k]) of the k most likely tokens of each
    row of logits (or log-probabilities) [n, V]: what a target worker sends back for a captured
    round, k columns instead of V."""
    top = torch.topk(torch.log_softmax(logits.float(), dim=-1), min(top_k, logits.shape[-1]), dim=-1)
    return top.indices.to(torch.int32).cpu().numpy(), top.values.cpu().numpy()


def capture_rows(request_id: str, context: Sequence[int], drafted: Sequence[int], accepted: int,
                 target_logprobs: torch.Tensor, top_k: int, draft_version: int = 0) -> CapturedBlock:
    """A CapturedBlock from the target's log-probability rows [>= K, V] of one verify."""
    top_ids, top_logprobs = top_rows(target_logprobs[: len(drafted)], top_k)
    return captured_block(request_id, context, drafted, accepted, top_ids, top_logprobs, draft_version)


def captured_block(request_id: str, context: Sequence[int], drafted: Sequence[int], accepted: int,
                   top_ids: np.ndarray, top_logprobs: np.ndarray, draft_version: int = 0) -> CapturedBlock:
    """A CapturedBlock from top_rows' answer for a verify's first len(drafted) rows."""
    count = len(drafted)
    return CapturedBlock(request_id, tuple(int(t) for t in context), tuple(int(t) for t in drafted), int(accepted),
                         np.asarray(top_ids[:count], np.int32), np.asarray(top_logprobs[:count], np.float32),
                         draft_version)


class CaptureBuffer:
    """Newest blocks up to `max_positions` drafted positions in all; the oldest go first.

    sample_every: keep one verified block in this many (counted, not random, so the cost on the
    round path is a counter increment for the blocks not kept)."""

    def __init__(self, max_positions: int, sample_every: int = 1) -> None:
        if max_positions < 1 or sample_every < 1:
            raise ValueError("max_positions and sample_every must be at least 1")
        self.max_positions = max_positions
        self.sample_every = sample_every
        self._blocks: deque[CapturedBlock] = deque()
        self._positions = 0
        self._offered = 0
        self.total_positions = 0  # ever captured, for `specserve status`

    def wants_next(self) -> bool:
        """Whether the next verified block is to be captured (call once per block)."""
        self._offered += 1
        return self._offered % self.sample_every == 0

    def add(self, block: CapturedBlock) -> None:
        if block.num_positions == 0:
            return
        self._blocks.append(block)
        self._positions += block.num_positions
        self.total_positions += block.num_positions
        while self._positions > self.max_positions and self._blocks:
            self._positions -= self._blocks.popleft().num_positions

    @property
    def num_positions(self) -> int:
        return self._positions

    def blocks(self) -> list[CapturedBlock]:
        return list(self._blocks)

    def split(self) -> tuple[list[CapturedBlock], list[CapturedBlock]]:
        """(training blocks, held-back blocks)."""
        blocks = self.blocks()
        return [b for b in blocks if not b.held_back], [b for b in blocks if b.held_back]


def save_blocks(blocks: Sequence[CapturedBlock], directory: str | Path, name: str) -> Path:
    """Write blocks as one .npz shard plus a JSON index of their token ids (only when asked:
    draft_training.capture_dir)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.npz"
    meta = [{"request_id": b.request_id, "context": list(b.context), "drafted": list(b.drafted),
             "accepted": b.accepted, "draft_version": b.draft_version} for b in blocks]
    np.savez_compressed(path, meta=np.array(json.dumps(meta)),
                        **{f"ids_{i}": b.top_ids for i, b in enumerate(blocks)},
                        **{f"logprobs_{i}": b.top_logprobs for i, b in enumerate(blocks)})
    return path


def load_blocks(directory: str | Path) -> Iterator[CapturedBlock]:
    """Every block of every shard under directory, in shard-name order."""
    for path in sorted(Path(directory).glob("*.npz")):
        with np.load(path) as shard:
            for i, item in enumerate(json.loads(str(shard["meta"]))):
                yield CapturedBlock(item["request_id"], tuple(item["context"]), tuple(item["drafted"]),
                                    item["accepted"], shard[f"ids_{i}"], shard[f"logprobs_{i}"],
                                    item["draft_version"])
