"""When the cluster has room for background work (the draft's online training, docs/online-learning.md).

Slack is spare capacity: a target pool busy at most a share of the time (and, optionally, few
enough requests in flight). By busy share, a steady trickle of requests leaves slack, so learning
goes on under light traffic instead of waiting for a silence that may never come. Training yields
as soon as this turns false, so the thresholds trade how often training runs against how much
serving it touches (docs/online-learning.md has the measured cost of overlapping on a shared CPU).
A trainer with a device of its own takes nothing the engines use: it trains beside serving."""

from __future__ import annotations


def has_slack(active_requests: int, target_busy_share: float | None, max_active_requests: int | None,
              max_busy_share: float) -> bool:
    """True when the target pool is busy at most max_busy_share of the time and, when
    max_active_requests is set, at most that many requests run (no target report yet counts as
    idle: nothing is served)."""
    busy = 0.0 if target_busy_share is None else target_busy_share
    if max_active_requests is not None and active_requests > max_active_requests:
        return False
    return busy <= max_busy_share


def has_own_device(num_gpus: float) -> bool:
    """A trainer granted at least one whole GPU has a device no engine shares (Ray gives whole
    GPUs exclusively); a fraction may share one with an engine."""
    return num_gpus >= 1
