"""Target worker: scores a draft block in ONE forward and returns the processed target rows."""

from __future__ import annotations

import time
from collections.abc import Sequence

from ray import serve

from decoding.model_runner import ModelRunner
from decoding.sampling import SamplingParams
from decoding.speculation import target_rows
from deployments.engine_host import EngineHost, to_wire


class TargetEngine:
    """Holds the target model and one KV cache per request id (the Ray actor on the data path)."""

    def __init__(self, model_spec: dict) -> None:
        self.runner = ModelRunner.from_spec(model_spec)

    def ping(self) -> bool:
        return True

    def verify(self, seq_id: str, token_ids: Sequence[int], num_rows: int,
               params: SamplingParams) -> tuple[object, float]:
        """Rows for the last num_rows positions of token_ids (argmax ids when greedy, else probs),
        and the seconds spent computing them. Prefill is the same call with num_rows=1."""
        started = time.perf_counter()
        logits = self.runner.forward(seq_id, token_ids, num_rows)
        rows = to_wire(target_rows(logits, params))
        return rows, time.perf_counter() - started

    def release(self, seq_id: str) -> None:
        self.runner.release(seq_id)

    def active_sequences(self) -> list[str]:
        return self.runner.active_sequences()


@serve.deployment
class TargetWorker(EngineHost):
    engine_class = TargetEngine
