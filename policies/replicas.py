"""Replica counts for the draft and target pools: scale the pool that is the bottleneck.

A speculative round alternates between the pools, so each one's load shows in the other:
- the TARGET pool is the bottleneck when verify calls queue up (queue depth per replica over a
  threshold) or its engines are busy nearly all the time;
- the DRAFT pool is the bottleneck when target engines sit idle while requests are active
  (they wait for blocks) and the draft engines are busy nearly all the time;
- a pool is over-provisioned when it is mostly idle, and would still be comfortably below the
  scale-up threshold with one replica fewer (the projected share busy * R / (R - 1)), or when
  it has more replicas than there are active requests (one of them serves nobody).
A pool only grows while there are more active requests than replicas: a request stays on the
engines it started on, so a replica added for a lone stream gets no work. On a small CPU box
one stream keeps its target engine busy nearly all the time; that is latency, not a bottleneck
another replica could relieve (measured: a load step flapped to 2 target replicas at 1 stream).
Hysteresis: different thresholds up and down, one replica per step, and a cool-down after each
change so the next decision sees load measured on the new replica count. Serve's own
upscale/downscale delays then apply on top. A pool nobody reports on gets no opinion (None):
the autoscaler keeps its current target rather than act on nothing (e.g. just after a restart).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from specserve.common.messages import POOLS


@dataclass(frozen=True)
class PoolLoad:
    """One pool over the last report interval, from its engines' own statistics."""

    replicas: int          # engines reporting
    busy_share: float      # fraction of wall time in forwards the rounds wait on, mean over engines (0..1)
    queue_depth: float     # calls waiting for a batch, mean per engine
    # busy_share with the draft's optional pre-drafts counted too: how full the device really is
    # (what the speculation cache's fan-out answers to, policies.fan_out)
    busy_share_all: float | None = None


@dataclass(frozen=True)
class ScalingThresholds:
    busy_high: float = 0.85          # scale up at or above this busy share
    busy_low: float = 0.30           # may scale down below this busy share ...
    projected_busy_max: float = 0.60  # ... if one replica fewer stays below this share
    queue_high: float = 2.0          # verify calls waiting per target engine
    target_idle_high: float = 0.50   # target idle share that means "waiting for blocks"
    cooldown_s: float = 10.0         # no second change to a pool within this time


def _scale_down_ok(load: PoolLoad, active_requests: int, thresholds: ScalingThresholds) -> bool:
    if load.replicas <= 1 or load.queue_depth >= 0.5:
        return False
    if active_requests < load.replicas:
        return True
    projected = load.busy_share * load.replicas / (load.replicas - 1)
    return load.busy_share < thresholds.busy_low and projected < thresholds.projected_busy_max


def _wanted(pool: str, loads: Mapping[str, PoolLoad | None], active_requests: int,
            thresholds: ScalingThresholds) -> tuple[int, str | None]:
    """+1, -1 or 0 for one pool, and why."""
    load, target = loads.get(pool), loads.get("target")
    assert load is not None
    has_work_for_another = active_requests > load.replicas
    if pool == "target" and has_work_for_another:
        if load.queue_depth > thresholds.queue_high:
            return 1, f"target: {load.queue_depth:.1f} verify calls queued per engine > {thresholds.queue_high}"
        if load.busy_share >= thresholds.busy_high:
            return 1, f"target: busy {load.busy_share:.0%} >= {thresholds.busy_high:.0%}"
    elif (pool == "draft" and has_work_for_another and target is not None
          and load.busy_share >= thresholds.busy_high and 1.0 - target.busy_share >= thresholds.target_idle_high):
        return 1, (f"draft: busy {load.busy_share:.0%} while target idles {1 - target.busy_share:.0%} "
                   f"with {active_requests} requests active")
    if _scale_down_ok(load, active_requests, thresholds):
        if active_requests < load.replicas:
            return -1, f"{pool}: {active_requests} active requests for {load.replicas} replicas"
        return -1, f"{pool}: busy {load.busy_share:.0%}, one replica fewer would stay below " \
                   f"{thresholds.projected_busy_max:.0%}"
    return 0, None


def decide_replicas(loads: Mapping[str, PoolLoad | None], active_requests: int,
                    bounds: Mapping[str, tuple[int, int]], seconds_since_change: Mapping[str, float],
                    previous: Mapping[str, int | None] | None = None,
                    thresholds: ScalingThresholds = ScalingThresholds()) -> tuple[dict[str, int | None], list[str]]:
    """Wanted replicas per pool (None: no opinion) and the reasons, one step from what runs now.

    bounds: (min_replicas, max_replicas) per pool; seconds_since_change: since this pool's wanted
    count last changed; previous: the counts wanted before, held during the cool-down (new
    replicas take a while to start and report)."""
    wanted: dict[str, int | None] = {}
    reasons: list[str] = []
    for pool in POOLS:
        load = loads.get(pool)
        if pool not in bounds or load is None or load.replicas == 0:
            wanted[pool] = None
            continue
        low, high = bounds[pool]
        step, reason = _wanted(pool, loads, active_requests, thresholds)
        held = (previous or {}).get(pool)
        # Measured from what reports, but a replica asked for and still starting is kept.
        count = load.replicas + step if held is None or step < 0 else max(load.replicas + step, held)
        count = min(high, max(low, count))
        if seconds_since_change.get(pool, float("inf")) < thresholds.cooldown_s:
            count = load.replicas if held is None else held
            if reason is not None:
                reasons.append(f"{pool}: cooling down, holding {count} ({reason})")
        elif reason is not None:
            reasons.append(f"{reason}: {pool} wants {count} (bounds {low}..{high})")
        wanted[pool] = count
    return wanted, reasons
