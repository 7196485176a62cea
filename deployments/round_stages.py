"""Where one speculative round's wall time goes, stage by stage, for `bench.round_profile`.

The router always times each engine call (`EngineCall`: four moments on the one CLOCK_MONOTONIC
every process of a machine shares, plus when the engine's forward began), which is what its
`speculation.median_overhead_ms` comes from and its depth choice learns from.

SPECSERVE_PROFILE_ROUNDS=1 in the cluster's environment is the one switch for benchmark
instrumentation on the served path (`profiling_enabled`): the finer split below (the router's
Python between the calls, each hop, each engine's loop wait and compute), the response's
`median_hops_ms` / `median_router_ms`, and the engines' call logs (deployments.engine_parts.CallLog).
Off, `RoundStages.mark` is one attribute test and the engines log nothing.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from specserve.common.messages import CallSpan

PROFILE_ENV = "SPECSERVE_PROFILE_ROUNDS"


def profiling_enabled() -> bool:
    return os.environ.get(PROFILE_ENV, "") not in ("", "0")


@dataclass(frozen=True)
class EngineCall:
    """One engine call's moments, perf_counter seconds: the router sent it, the engine took it,
    the engine's forward for it began, the engine answered, the router had the answer."""

    sent_s: float
    entered_s: float
    started_s: float
    left_s: float
    answered_s: float
    cached_tokens: int = 0   # the span's: what the engine's prefix cache held of the sequence

    @classmethod
    def from_span(cls, sent_s: float, span: CallSpan, answered_s: float) -> "EngineCall":
        return cls(sent_s, span.entered_s, span.started_s, span.left_s, answered_s, span.cached_tokens)

    @classmethod
    def queued(cls, round_started_s: float, span: CallSpan, answered_s: float) -> "EngineCall":
        """A call sent before its round began (a target-only round queued behind the one before,
        deployments.round_loop): its moments counted from when the round began, so what the
        engine did before that is not the round's, and its hop out is none."""
        left_s = max(span.left_s, round_started_s)

        def clamped(moment: float) -> float:
            return min(max(moment, round_started_s), left_s)
        return cls(round_started_s, clamped(span.entered_s), clamped(span.started_s), left_s, answered_s,
                   span.cached_tokens)

    @property
    def engine_s(self) -> float:
        """Seconds inside the engine: its batching loop's wait and the forward."""
        return self.left_s - self.entered_s

    @property
    def hops_s(self) -> float:
        """Both hops: pickling, the channel's transport and each event loop picking the message up."""
        return (self.entered_s - self.sent_s) + (self.answered_s - self.left_s)

    def stages(self, pool: str) -> dict[str, float]:
        return {f"{pool}_hop_out": self.entered_s - self.sent_s, f"{pool}_loop_wait": self.started_s - self.entered_s,
                f"{pool}_compute": self.left_s - self.started_s, f"{pool}_hop_back": self.answered_s - self.left_s}


class RoundStages:
    """Named moments of one round in the router; `stages()` turns them into durations (seconds).

    Marks, in order: start, depth (K chosen), proposed (block in hand), accepted (accept_round and
    counters done), recorded (timings and metrics), chunked (the chunk queued for the stream)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.marks: dict[str, float] = {}
        self.draft: EngineCall | None = None
        self.target: EngineCall | None = None

    def mark(self, name: str) -> None:
        if self.enabled:
            self.marks[name] = time.perf_counter()

    def stages(self) -> dict[str, float]:
        """Durations that add up to the round's wall time (give or take a few event-loop turns):
        the router's Python (policy, propose, launch, accept, record, chunk), the hops and the
        engine time of the calls it waited on."""
        m = self.marks
        out = {"wall": m["chunked"] - m["start"], "policy": m["depth"] - m["start"]}
        if self.draft is not None:
            out.update(self.draft.stages("draft"))
        draft_total = 0.0 if self.draft is None else self.draft.answered_s - self.draft.sent_s
        out["router_propose"] = m["proposed"] - m["depth"] - draft_total
        if self.target is not None:
            out.update(self.target.stages("target"))
            out["launch"] = self.target.sent_s - m["proposed"]
            out["accept"] = m["accepted"] - self.target.answered_s
        out["record"] = m["recorded"] - m["accepted"]
        out["chunk"] = m["chunked"] - m["recorded"]
        return out
