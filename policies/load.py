"""Cluster-wide load from the reports engines and routers send the policy actor (no Ray here).

Engines send their `EngineStats` about once a second (common.messages), busy_s and idle_s
cumulative, cost_samples the (batch_tokens, seconds) of forwards since the last report.
Routers send a `RouterReport`: active requests by class and, per class, cumulative round
counters (`ClassReport`; by draft position too, policies.acceptance.count_round_positions). A
source that stops reporting (dead replica, scaled down) expires after `ttl_s`, so the view only
counts what is alive. Busy shares and acceptance come from differences between reports, i.e. the
recent past, not the lifetime.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any

from specserve.common.messages import (MAX_DRAFT_TOKENS, POOL_COST_SAMPLES_KEPT, REQUEST_CLASSES, ClassReport, EngineStats,
                              RouterReport)
from specserve.policies.acceptance import acceptance_from_tokens_per_round, estimate_acceptance_rate, position_accept_rates
from specserve.policies.goodput import ClassLoad
from specserve.policies.replicas import PoolLoad

ACCEPT_WINDOW_S = 30.0       # acceptance is measured over this trailing window
MAX_ACCEPT_RATE = 0.99
MAX_POSITIONS = MAX_DRAFT_TOKENS  # acceptance is tracked at every draft position a config allows


def accept_rate_from_rounds(rounds: float, drafted: float, accepted: float) -> float:
    """Per-token acceptance alpha from round counters, fitted so E(alpha, mean K) = 1 + accepted
    per round (accepted / drafted under-estimates it: at K = 4 and alpha = 0.8 it reads 0.59).
    No rounds: the depth policy's prior. Capped at 0.99: a perfect streak is not a certainty."""
    if rounds <= 0 or drafted <= 0:
        return estimate_acceptance_rate(0, 0, 0)
    return min(MAX_ACCEPT_RATE, acceptance_from_tokens_per_round(1.0 + accepted / rounds, drafted / rounds))


@dataclass(frozen=True)
class ClusterLoad:
    """What the decision functions see."""

    pools: dict[str, PoolLoad]
    sequences: dict[str, int]
    classes: dict[str, ClassLoad]
    active_requests: int
    cost_samples: dict[str, list[tuple[float, float]]]
    round_overhead_s: float = 0.0  # per-round orchestration (RPC hops, router work) routers measure


@dataclass
class _EngineSeen:
    at: float
    stats: EngineStats
    busy_share: float
    busy_share_all: float   # pre-drafts counted too


@dataclass
class _RouterSeen:
    at: float
    report: RouterReport
    history: deque = field(default_factory=deque)  # (time, {class: ClassReport}) within the window


def _busy_share(previous: EngineStats | None, current: EngineStats, optional_work: bool = False) -> float:
    """Share of wall time in forwards the rounds wait on: a draft engine's pre-drafts (optional
    work, dropped first under load) count as idle, so they never scale the pool up. With
    optional_work, they count as busy: how full the device is (the fan-out's signal)."""
    def split(stats: EngineStats) -> tuple[float, float]:
        optional = 0.0 if optional_work else stats.speculative_s
        return stats.busy_s - optional, stats.idle_s + optional

    busy, idle = split(current)
    if previous is not None:
        before_busy, before_idle = split(previous)
        d_busy, d_idle = busy - before_busy, idle - before_idle
        if d_busy >= 0 and d_idle >= 0 and d_busy + d_idle > 0:  # same engine, counters moved
            return d_busy / (d_busy + d_idle)
    return busy / (busy + idle) if busy + idle > 0 else 0.0


def _minus(last: Any, first: Any) -> Any:
    """Counter growth: numbers, or sequences element by element (one may have grown longer)."""
    if isinstance(last, (tuple, list)):
        return [float(v) - (float(first[i]) if i < len(first) else 0.0) for i, v in enumerate(last)]
    return float(last) - float(first)


def _add(totals: dict[str, Any], name: str, value: Any) -> None:
    if isinstance(totals[name], list):
        total = totals[name]
        total.extend([0.0] * (len(value) - len(total)))
        for i, v in enumerate(value):
            total[i] += float(v)
    else:
        totals[name] += float(value)


class LoadTracker:
    """Latest report per source, expiry, and the aggregate `ClusterLoad`. Time is passed in."""

    def __init__(self, ttl_s: float = 5.0) -> None:
        self.ttl_s = ttl_s
        self._engines: dict[tuple[str, str], _EngineSeen] = {}
        self._routers: dict[str, _RouterSeen] = {}
        self._samples: dict[str, deque] = {}

    def add_engine(self, stats: EngineStats, now: float) -> None:
        key = (stats.pool, stats.replica)
        seen = self._engines.get(key)
        previous = seen.stats if seen else None
        self._engines[key] = _EngineSeen(now, stats, _busy_share(previous, stats),
                                         _busy_share(previous, stats, optional_work=True))
        samples = self._samples.setdefault(stats.pool, deque(maxlen=POOL_COST_SAMPLES_KEPT))
        samples.extend((float(tokens), float(seconds)) for tokens, seconds in stats.cost_samples)

    def add_router(self, report: RouterReport, now: float) -> None:
        seen = self._routers.setdefault(report.router, _RouterSeen(now, report))
        seen.at, seen.report = now, report
        seen.history.append((now, report.by_class))
        while len(seen.history) > 2 and seen.history[1][0] <= now - ACCEPT_WINDOW_S:
            seen.history.popleft()  # keep one point at or before the window start

    def expire(self, now: float) -> None:
        for key in [k for k, seen in self._engines.items() if now - seen.at > self.ttl_s]:
            del self._engines[key]
        for name in [n for n, seen in self._routers.items() if now - seen.at > self.ttl_s]:
            del self._routers[name]

    def _class_load(self, request_class: str, active: int) -> ClassLoad:
        window = {"rounds": 0.0, "drafted": 0.0, "accepted": 0.0, "reached": [], "accepted_at": []}
        lifetime = {name: [] if isinstance(value, list) else 0.0 for name, value in window.items()}
        for seen in self._routers.values():
            first = seen.history[0][1].get(request_class, ClassReport())
            last = seen.history[-1][1].get(request_class, ClassReport())
            since = first if len(seen.history) > 1 else ClassReport()
            for name in (f.name for f in fields(ClassReport)):
                _add(lifetime, name, getattr(last, name))
                _add(window, name, _minus(getattr(last, name), getattr(since, name)))
        # No drafting in the window (K = 0 for this class, or no traffic): fall back to the lifetime.
        counters = window if window["drafted"] > 0 else lifetime
        alpha = accept_rate_from_rounds(counters["rounds"], counters["drafted"], counters["accepted"])
        by_position = position_accept_rates(counters["reached"], counters["accepted_at"], MAX_POSITIONS, alpha) \
            if counters["reached"] else ()
        return ClassLoad(active, alpha, by_position)

    def snapshot(self, now: float) -> ClusterLoad:
        self.expire(now)
        pools: dict[str, PoolLoad] = {}
        sequences: dict[str, int] = {}
        for pool in {key[0] for key in self._engines}:
            seen = [s for (p, _), s in self._engines.items() if p == pool]
            pools[pool] = PoolLoad(replicas=len(seen),
                                   busy_share=sum(s.busy_share for s in seen) / len(seen),
                                   queue_depth=sum(s.stats.queue_depth for s in seen) / len(seen),
                                   busy_share_all=sum(s.busy_share_all for s in seen) / len(seen))
            sequences[pool] = sum(s.stats.sequences for s in seen)
        by_class_active: dict[str, int] = {c: 0 for c in REQUEST_CLASSES}
        for seen in self._routers.values():
            for c, active in seen.report.active_by_class.items():
                by_class_active[c] = by_class_active.get(c, 0) + active
        active = sum(seen.report.active_requests for seen in self._routers.values())
        classes = {c: self._class_load(c, by_class_active.get(c, 0)) for c in by_class_active}
        overheads = [seen.report.round_overhead_s for seen in self._routers.values()
                     if seen.report.round_overhead_s is not None]
        return ClusterLoad(pools, sequences, classes, active,
                           {pool: list(samples) for pool, samples in self._samples.items()},
                           sum(overheads) / len(overheads) if overheads else 0.0)
