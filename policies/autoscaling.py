"""Serve's custom autoscaling policy for a worker pool: it reads the policy actor's decision.

Serve 2.60 builds `PoolPolicy(**policy_kwargs)` once on the controller and calls it every
control-loop tick (~0.1 s) with an `AutoscalingContext`; it returns (replicas, policy_state) and
Serve then applies its up/downscale delays and clamps to min/max. The controller's loop must
never block, so the actor is polled, not awaited: one `decision.remote()` is kept outstanding
and read with `ray.wait(timeout=0)` on a later tick. When the actor is missing, dead or silent
for too long, or has no opinion on this pool, the policy returns Serve's current target: the
pool stays as it is, it never shrinks because the policy is unreachable.

Only the name lookup (`ray.get_actor`, a quick GCS call) is synchronous; it runs at most once
per `lookup_interval_s` while no actor is known. With `settings` (PolicySettings.to_dict()) the
policy also creates the actor when it is missing, so autoscaling works before any router ran.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray

from specserve.common.messages import PolicyDecision
from specserve.policies.actor import POLICY_ACTOR_NAME, POLICY_NAMESPACE, get_or_create_policy_actor

logger = logging.getLogger(__name__)


class PoolPolicy:
    """policy_function for one pool ("target" or "draft"): replicas = the policy actor's decision."""

    def __init__(self, pool: str, settings: dict[str, Any] | None = None, poll_interval_s: float = 0.5,
                 lookup_interval_s: float = 5.0, max_decision_age_s: float = 15.0,
                 actor_name: str = POLICY_ACTOR_NAME) -> None:
        """actor_name: the policy actor to read when no settings are given (with settings, theirs)."""
        if pool not in ("target", "draft"):
            raise ValueError(f"pool must be 'target' or 'draft', got {pool!r}")
        self.pool = pool
        self._settings = settings
        self._actor_name = settings["actor_name"] if settings and "actor_name" in settings else actor_name
        self._poll_interval_s = poll_interval_s
        self._lookup_interval_s = lookup_interval_s
        self._max_decision_age_s = max_decision_age_s
        self._actor: Any = None
        self._pending: Any = None
        self._next_poll = 0.0
        self._next_lookup = 0.0
        self._decision: PolicyDecision | None = None
        self._decision_at = float("-inf")

    def _lookup(self, now: float) -> None:
        if now < self._next_lookup:
            return
        self._next_lookup = now + self._lookup_interval_s
        try:
            if self._settings is not None:
                from specserve.policies.decision import PolicySettings
                self._actor = get_or_create_policy_actor(PolicySettings.from_dict(self._settings))
            else:
                self._actor = ray.get_actor(self._actor_name, namespace=POLICY_NAMESPACE)
        except Exception as error:  # no actor yet: keep the pool as it is and look again later
            logger.info("specserve policy actor not available for %s pool: %s", self.pool, error)

    def _poll(self, now: float) -> None:
        """Collect a finished decision call, or start one; never waits."""
        if self._actor is None:
            self._lookup(now)
            if self._actor is None:
                return
        if self._pending is not None:
            ready, _ = ray.wait([self._pending], timeout=0)
            if not ready:
                return
            pending, self._pending = self._pending, None
            try:
                self._decision, self._decision_at = ray.get(pending), now
            except ray.exceptions.RayActorError:  # killed for good: find (or create) it again
                self._actor = None
                return
            except ray.exceptions.RayError as error:  # restarting: the same handle works again soon
                logger.info("specserve policy actor call failed: %s", error)
        if now >= self._next_poll:
            self._next_poll = now + self._poll_interval_s
            self._pending = self._actor.decision.remote()

    def wanted_replicas(self, now: float) -> int | None:
        """The decision's count for this pool, or None (no fresh decision / no opinion)."""
        if self._decision is None or now - self._decision_at > self._max_decision_age_s:
            return None
        return self._decision.replicas(self.pool)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        now = time.monotonic()
        self._poll(now)
        state = dict(ctx.policy_state or {})
        wanted = self.wanted_replicas(now)
        if wanted is None:
            return ctx.target_num_replicas, state
        state["specserve_policy_version"] = self._decision.version if self._decision else None
        return int(wanted), state
