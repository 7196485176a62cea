"""The router's side of online draft training (docs/online-learning.md): which rounds are
captured, and what a verified round tells the trainer and the metrics.

Per round the round loop asks `top_k_for_round()` before it sends the verify (None: this round is
not captured and the target returns its usual answer; one round in sample_every is), and the
round's observer (deployments/round_record.py) hands the verified round to `observe`. Every round's drafted and accepted counts go to the metrics by draft
version; with training on, captured blocks and those counts are batched and pushed to the trainer
about once a second, fire-and-forget: a slow or dead trainer never holds a round. With training
off nothing is captured, pushed or written.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from specserve.common.config import SpecServeConfig
from specserve.common.messages import PositionCounts
from specserve.decoding.capture import CaptureBuffer, CapturedBlock
from specserve.common.metrics import RouterMetrics

PUSH_INTERVAL_S = 1.0       # least time between two pushes of one router
PUSH_BLOCKS = 32            # ... unless this many blocks wait
TRAINER_RETRY_S = 5.0       # after a failed trainer lookup, wait this long before the next

logger = logging.getLogger("ray.serve")


class RoundCapture:
    def __init__(self, config: SpecServeConfig, metrics: RouterMetrics) -> None:
        self.config = config
        self.spec = config.draft_training
        self.metrics = metrics
        self._sampler = CaptureBuffer(1, self.spec.sample_every) if self.spec.enabled else None
        self._blocks: list[CapturedBlock] = []
        self._live: dict[int, PositionCounts] = {}   # per draft version, since the last push
        self._pushed_at = time.monotonic()
        self._trainer = None
        self._last_push = None
        self._lookup_failed_at = float("-inf")

    def top_k_for_round(self) -> int | None:
        """The top-k the target should return for this round's drafted positions, or None."""
        if self._sampler is None or not self._sampler.wants_next():
            return None
        return self.spec.top_k

    def observe(self, draft_version: int, drafted: int, accepted: int, block: CapturedBlock | None = None) -> None:
        """One verified round: drafted tokens of draft_version, how many were kept, and the
        captured block if the round was captured."""
        if not drafted:
            return
        self.metrics.record_version_round(draft_version, drafted, accepted)
        if self._sampler is None:
            return
        self._live.setdefault(draft_version, PositionCounts([], [])).add(PositionCounts.of_round(drafted, accepted))
        if block is not None:  # training keeps only the last max_context tokens of a context
            self._blocks.append(replace(block, context=block.context[-self.spec.max_context:]))
        if len(self._blocks) >= PUSH_BLOCKS or time.monotonic() - self._pushed_at >= PUSH_INTERVAL_S:
            self._push()

    def _push(self) -> None:
        blocks = self._blocks
        live = {version: (tuple(counts.drafted), tuple(counts.accepted)) for version, counts in self._live.items()}
        self._blocks, self._live, self._pushed_at = [], {}, time.monotonic()
        if self._last_push is not None and _failed(self._last_push):
            self._trainer = None  # it died: look it up (or start a new one) again
        trainer = self._trainer_handle()
        if trainer is None:
            return  # no trainer: these blocks are dropped, serving goes on
        try:
            self._last_push = trainer.push.remote(blocks, live)
        except Exception:
            self._trainer = self._last_push = None

    def _trainer_handle(self):
        if self._trainer is None and time.monotonic() - self._lookup_failed_at > TRAINER_RETRY_S:
            from specserve.deployments.draft_trainer import get_or_create_draft_trainer

            try:
                self._trainer = get_or_create_draft_trainer(self.config)
            except Exception:
                logger.warning("draft trainer unavailable; captured rounds are dropped", exc_info=True)
                self._lookup_failed_at = time.monotonic()
        return self._trainer


def _failed(answer) -> bool:
    """Whether a finished push failed (an unfinished one has not, yet)."""
    import ray

    ready, _ = ray.wait([answer], timeout=0)
    if not ready:
        return False
    try:
        ray.get(ready[0], timeout=0)
    except Exception:
        return True
    return False
