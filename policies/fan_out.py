"""How many blocks a request pre-drafts per round (the speculation cache's fan-out) under load.

Pre-drafts are optional work on the draft pool: on a hit they take the draft off the round's
critical path, but every block pre-drafted costs draft forwards whether it is used or not. While
the draft pool has room, the configured fan-out costs nothing the rounds wait on; as the pool's
busy share from work the rounds wait on (proposes and prefills, not pre-drafts:
policies.load._busy_share) climbs towards saturation, the pre-drafts would delay those calls, so
the fan-out shrinks linearly to 0 (plain rounds). The thresholds are where the draft pool's own
autoscaling acts (policies.replicas.ScalingThresholds): fan-out gives way before replicas are added.
docs/speculation-cache.md has the measurements.
"""

from __future__ import annotations

from policies.replicas import PoolLoad, ScalingThresholds


def fan_out_under_load(configured: int, draft: PoolLoad | None,
                       thresholds: ScalingThresholds = ScalingThresholds()) -> int:
    """The fan-out for the draft pool's load: configured below thresholds.busy_low, 0 at or above
    thresholds.busy_high, linear between; configured when the pool has not reported."""
    if configured <= 0 or draft is None:
        return max(configured, 0)
    low, high = thresholds.busy_low, thresholds.busy_high
    if draft.busy_share <= low:
        return configured
    if draft.busy_share >= high:
        return 0
    return int(configured * (high - draft.busy_share) / (high - low))
