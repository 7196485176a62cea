"""What one speculative round did, and the one place that turns it into stats and metrics.

The round loop (deployments/round_loop.py) emits a `RoundRecord` per round and nothing else;
`RoundObserver` feeds it to the router's depth chooser (policies/depth_chooser.py), its Prometheus
metrics and the request's `RoundTimings` (the response's `speculation` timings), so the loop
carries no bookkeeping and every consumer sees the same figures.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from specserve.decoding.capture import CapturedBlock
from specserve.common.metrics import RouterMetrics
from specserve.deployments.round_capture import RoundCapture
from specserve.policies.depth_chooser import DepthChooser


@dataclass(frozen=True)
class RoundRecord:
    """One round: overhead = wall time minus engine compute, of which hops = the RPC hops of the
    calls the round waited on, and the rest the router's own work."""

    request_class: str
    num_drafted: int
    num_accepted: int
    wall_s: float
    draft_s: float                 # draft engine seconds the round waited on (0 when drafted ahead)
    target_s: float                # target engine seconds
    hops_s: float
    alone: bool                    # the request was the router's only one from start to end
    draft_calls: tuple[tuple[float, int], ...] = ()  # (engine seconds, tokens) of drafting calls answered
    draft_version: int = 0         # the draft weights that drafted the block
    captured: CapturedBlock | None = None  # the target's top-k at the block, on a captured round
    target_passes: int = 1         # target forwards it committed from (a target-only round's steps)
    # A steady round for the fan-out's payoff (policies.fan_out.FanOutPayoff): True, it pre-drafted
    # and so did the round before; False, neither did; None, the fan-out changed between them (or
    # it is the request's first round).
    predrafting: bool | None = None

    @property
    def overhead_s(self) -> float:
        return self.wall_s - self.draft_s - self.target_s


@dataclass
class RoundTimings:
    """Where a request's wall time went, round by round (the response's `speculation` timings)."""

    round_wall_s: list[float] = field(default_factory=list)
    round_overhead_s: list[float] = field(default_factory=list)
    round_hops_s: list[float] = field(default_factory=list)
    draft_depths: list[int] = field(default_factory=list)
    first_token_s: float | None = None
    round_stages: list[dict[str, float]] | None = None  # per round, when profiling (round_stages.py)
    # When profiling, the first token's wait in the router: Serve's engine lookup, then the
    # prefill's hops and its time in the target engine (round_stages.EngineCall.stages).
    first_token_stages: dict[str, float] | None = None

    def add(self, record: RoundRecord) -> None:
        self.round_wall_s.append(record.wall_s)
        self.round_overhead_s.append(record.overhead_s)
        self.round_hops_s.append(record.hops_s)
        self.draft_depths.append(record.num_drafted)

    def to_dict(self) -> dict[str, Any]:
        def median_ms(values: list[float]) -> float | None:
            return round(1000 * statistics.median(values), 3) if values else None

        timings = {
            "median_round_ms": median_ms(self.round_wall_s),
            "median_overhead_ms": median_ms(self.round_overhead_s),
            "mean_draft_tokens": round(statistics.fmean(self.draft_depths), 3) if self.draft_depths else 0.0,
            "time_to_first_token_ms": None if self.first_token_s is None else round(1000 * self.first_token_s, 3),
        }
        if self.round_stages is not None:  # profiling (bench.round_profile): the overhead split, every stage
            timings["median_hops_ms"] = median_ms(self.round_hops_s)
            timings["median_router_ms"] = median_ms([o - h for o, h in zip(self.round_overhead_s, self.round_hops_s)])
            timings["round_stages_ms"] = [{name: round(1000 * seconds, 4) for name, seconds in stages.items()}
                                          for stages in self.round_stages]
            timings["first_token_stages_ms"] = {name: round(1000 * seconds, 4)
                                                for name, seconds in (self.first_token_stages or {}).items()}
        return timings


class RoundObserver:
    """One request's rounds -> its timings, the router's depth chooser and metrics."""

    def __init__(self, timings: RoundTimings, chooser: DepthChooser, metrics: RouterMetrics,
                 capture: RoundCapture | None = None) -> None:
        self.timings = timings
        self.chooser = chooser
        self.metrics = metrics
        self.capture = capture

    def capture_top_k(self) -> int | None:
        """The top-k the next round's verify should also return for online training, or None."""
        return None if self.capture is None else self.capture.top_k_for_round()

    def first_token(self, seconds: float, stages: dict[str, float] | None = None) -> None:
        self.timings.first_token_s = seconds
        self.timings.first_token_stages = stages
        self.metrics.record_first_token(seconds)

    def draft_lost(self) -> None:
        self.metrics.record_draft_failure()

    def round(self, record: RoundRecord) -> None:
        self.timings.add(record)
        for engine_s, num_tokens in record.draft_calls:
            self.chooser.observe_draft(engine_s, num_tokens)
        self.chooser.observe_round(record.request_class, record.num_drafted, record.num_accepted, record.wall_s,
                                   record.target_s / max(1, record.target_passes), record.overhead_s, record.alone)
        if record.predrafting is not None and record.num_drafted:
            self.chooser.observe_fan_out_round(record.request_class, record.num_drafted, record.predrafting,
                                               record.wall_s)
        self.metrics.record_round(record.wall_s, record.num_drafted)
        if self.capture is not None:
            self.capture.observe(record.draft_version, record.num_drafted, record.num_accepted, record.captured)

    def fan_out(self, num_blocks: int) -> None:
        """Blocks the round asked the draft engine to pre-draft for its outcomes."""
        self.metrics.record_fan_out(num_blocks)

    def speculation_cache(self, request_class: str, hit: bool) -> None:
        """A round whose previous round pre-drafted: whether its block was there."""
        self.chooser.observe_cache(request_class, hit)

    def round_stages(self, stages: dict[str, float]) -> None:
        """A profiled round's stages (deployments/round_stages.py), after its chunk went out."""
        if self.timings.round_stages is not None:
            self.timings.round_stages.append(stages)
