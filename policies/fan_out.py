"""How many blocks a request pre-drafts per round (the speculation cache's fan-out) under load.

Pre-drafts are optional work on the draft pool: on a hit they take the draft off the round's
critical path, but every block pre-drafted costs draft forwards whether it is used or not. While
the draft devices have room, the configured fan-out costs nothing the rounds wait on; as their busy
share (pre-drafts included: PoolLoad.busy_share_all) climbs towards saturation, pre-drafts would
delay the calls rounds wait on, so the fan-out shrinks linearly to 0 (plain rounds). Pre-drafts
count as idle in the share that scales the pool (busy_share): optional work gives way before
replicas are added. The thresholds are the autoscaler's (policies.replicas.ScalingThresholds).
docs/speculation-cache.md has the measurements.
"""

from __future__ import annotations

from specserve.policies.replicas import PoolLoad, ScalingThresholds


def fan_out_under_load(configured: int, draft: PoolLoad | None,
                       thresholds: ScalingThresholds = ScalingThresholds()) -> int:
    """The fan-out for the draft pool's load: configured while its busy share (pre-drafts
    included) is at most thresholds.busy_low, 0 at or above thresholds.busy_high, linear between;
    configured when the pool has not reported."""
    if configured <= 0 or draft is None:
        return max(configured, 0)
    share = draft.busy_share if draft.busy_share_all is None else draft.busy_share_all
    low, high = thresholds.busy_low, thresholds.busy_high
    if share <= low:
        return configured
    if share >= high:
        return 0
    return int(configured * (high - share) / (high - low))
