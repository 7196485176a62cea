"""When the cluster has room for background work (the draft's online training, docs/online-learning.md).

Slack is judged from the policy actor's load view: few enough requests in flight and a target
pool that is mostly idle. Training yields as soon as this turns false, so the thresholds trade
how often training runs against how much of a returning burst it can touch (about one optimizer
step)."""

from __future__ import annotations


def has_slack(active_requests: int, target_busy_share: float | None, max_active_requests: int,
              max_busy_share: float) -> bool:
    """True when at most max_active_requests requests run and the target pool is busy at most
    max_busy_share of the time (no target report yet counts as idle: nothing is served)."""
    busy = 0.0 if target_busy_share is None else target_busy_share
    return active_requests <= max_active_requests and busy <= max_busy_share
