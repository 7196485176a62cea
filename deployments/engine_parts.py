"""The small pieces an engine actor keeps beside its step (deployments.engine_core.EngineCore).

Each one owns one kind of state and knows nothing of the engine that holds it:
- `ReleasedIds`: request ids released lately, so a call that arrives after its release is refused;
- `IdleSequences`: when each sequence was last run, so sequences whose router died are forgotten;
- `LoadReporter`: forward costs, and the load reports that carry them to the policy actor;
- `CallLog`: recent calls' spans for bench.round_profile, kept only while round profiling is on.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace

import ray

from specserve.common.messages import ENGINE_COST_SAMPLES_KEPT, CallSpan, CostSample, EngineStats
from specserve.deployments.engine_loop import SequenceReleasedError

RELEASED_IDS_KEPT = 4096  # recently released request ids: calls that arrive late for them are refused
CALL_LOG_KEPT = 4096  # recent calls, for bench.round_profile
REPORT_INTERVAL_S = 1.0  # how often an engine reports its load to the policy actor


class ReleasedIds:
    """Request ids are never reused, so a call for a released one is late, never new. Running it
    would create KV state nobody ever releases, and it can come late: a verify waits in the
    engine for its draft block, and an asyncio actor does not run a caller's calls in the order
    sent (a propose sent before the release can start after it)."""

    def __init__(self, kept: int = RELEASED_IDS_KEPT) -> None:
        self._kept = kept
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, seq_id: str) -> None:
        self._ids[seq_id] = None
        while len(self._ids) > self._kept:
            self._ids.popitem(last=False)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._ids

    def check(self, seq_id: str) -> None:
        """Raise SequenceReleasedError if seq_id was released."""
        if seq_id in self:
            raise SequenceReleasedError(f"sequence {seq_id!r} released")


class IdleSequences:
    """A safety net, not the release path: sequences untouched for ttl_s belong to a router that
    died before it could release them."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._last_used_s: dict[str, float] = {}

    def touch(self, seq_ids: Iterable[str], now: float) -> None:
        for seq_id in seq_ids:
            self._last_used_s[seq_id] = now

    def forget(self, seq_id: str) -> None:
        self._last_used_s.pop(seq_id, None)

    def expired(self, now: float) -> list[str]:
        cutoff = now - self.ttl_s
        return [seq_id for seq_id, last_used in self._last_used_s.items() if last_used < cutoff]


class LoadReporter:
    """Keeps the engine's recent forward costs and, once started, sends the policy actor the
    engine's stats about once a second (if one runs: the router starts it). Each cost sample goes
    out once: the actor accumulates them."""

    def __init__(self, policy_actor: str | None) -> None:
        """policy_actor: the application's policy actor name; None: the default application's."""
        self.policy_actor = policy_actor
        self.recent: deque[CostSample] = deque(maxlen=ENGINE_COST_SAMPLES_KEPT)
        self._unreported: deque[CostSample] = deque(maxlen=ENGINE_COST_SAMPLES_KEPT)
        self._task: asyncio.Task | None = None

    def record(self, samples: Iterable[CostSample]) -> None:
        for sample in samples:
            self.recent.append(sample)
            self._unreported.append(sample)

    def start(self, read_stats: Callable[[], Awaitable[EngineStats]]) -> None:
        """Report read_stats() from now on (again, if the task ended); from the engine's event loop."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._report(read_stats))

    async def _report(self, read_stats: Callable[[], Awaitable[EngineStats]]) -> None:
        from specserve.policies.actor import POLICY_ACTOR_NAME, POLICY_NAMESPACE

        while True:
            await asyncio.sleep(REPORT_INTERVAL_S)
            try:
                policy = ray.get_actor(self.policy_actor or POLICY_ACTOR_NAME, namespace=POLICY_NAMESPACE)
                report = replace(await read_stats(), cost_samples=tuple(self._unreported))
                self._unreported.clear()
                policy.report_engine.remote(report)
            except Exception:  # no policy actor (yet, or restarting): the engine works on regardless
                pass


class CallLog:
    """(kind, sequence id, entered, left) of recent calls, perf_counter seconds: bench.round_profile
    times rounds from the engines' side with it, an outside check on the router's accounting.
    Benchmark instrumentation: kept only when enabled (deployments.round_stages.profiling_enabled)."""

    def __init__(self, enabled: bool) -> None:
        self._calls: deque[tuple[str, str, float, float]] | None = deque(maxlen=CALL_LOG_KEPT) if enabled else None

    def record(self, kind: str, seq_id: str, span: CallSpan) -> None:
        if self._calls is not None:
            self._calls.append((kind, seq_id, span.entered_s, span.left_s))

    def calls(self) -> list[tuple[str, str, float, float]]:
        return [] if self._calls is None else list(self._calls)
