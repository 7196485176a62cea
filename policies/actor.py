"""The policy actor: one per application (named after its model, `policy_actor_name`), gathers
load reports and publishes `PolicyDecision`s.

A thin Ray shell over `LoadTracker` (reports -> load) and `Decider` (load -> decision), both
pure. It decides about once a second in a background task. It keeps no state worth
persisting: after a crash Ray restarts it (max_restarts=-1), it answers "no opinion" on replicas
until reports arrive again, and routers keep their last decision meanwhile. It is detached
(owned by no process) because whoever creates it first — a router replica, the Serve
controller's autoscaling policy, a test — may go away before the application does. Being
detached, it outlives a redeploy: every `get_or_create_policy_actor` hands it the caller's
settings (`configure`), so a redeployed application's routers and autoscaling policy bring their
new config to it, and after a restart (Ray rebuilds it from its first settings) the next lookup
does again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict
from typing import Any

import ray

from specserve.common.messages import POOLS, RAY_NAMESPACE, EngineStats, PolicyDecision, RouterReport
from specserve.policies.cost_curve import fit_cost_curve
from specserve.policies.decision import Decider, PolicySettings
from specserve.policies.load import ClusterLoad, LoadTracker
from specserve.policies.slack import has_slack

POLICY_ACTOR_NAME = PolicySettings().actor_name   # the default application's (model "specserve-default")
POLICY_NAMESPACE = RAY_NAMESPACE

__all__ = ["POLICY_ACTOR_NAME", "POLICY_NAMESPACE", "PolicyActor", "get_or_create_policy_actor",
           "kill_policy_actor"]

logger = logging.getLogger(__name__)


@ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=64)
class PolicyActor:
    """report_engine/report_router in, decision() out; `_decide` runs every decide_interval_s."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self._settings = PolicySettings.from_dict(settings)
        self._tracker = LoadTracker(ttl_s=self._settings.report_ttl_s)
        self._decider = Decider(self._settings)
        self._decided_from: ClusterLoad | None = None  # the load the last decision was made from
        self._loop_task: asyncio.Task | None = None
        self._started_at = time.time()
        from specserve.common.metrics import PolicyMetrics  # the one place metric names live

        self._metrics = PolicyMetrics()

    async def configure(self, settings: dict[str, Any]) -> bool:
        """Take these settings if they differ from the current ones (-> True): the decider starts
        afresh under them; the load reports it holds stay. Idempotent."""
        new = PolicySettings.from_dict(settings)
        if new == self._settings:
            return False
        logger.info("policy actor %s: new settings from a redeploy", new.actor_name)
        self._settings = new
        self._tracker.ttl_s = new.report_ttl_s
        self._decider = Decider(new)
        self._decided_from = None
        return True

    async def settings(self) -> dict[str, Any]:
        """The settings it decides under (what the last configure gave it)."""
        return self._settings.to_dict()

    def _ensure_loop(self) -> None:
        # Started from the first call: __init__ does not run inside the actor's event loop.
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            try:
                self._decide()
            except Exception:  # a bad report must not stop the policy; it is logged and retried
                logger.exception("policy decision failed")
            await asyncio.sleep(self._settings.decide_interval_s)

    def _decide(self) -> PolicyDecision:
        load = self._tracker.snapshot(time.monotonic())
        decision = self._decider.decide(load, time.monotonic())
        self._decided_from = load
        replicas = {pool: decision.replicas(pool) for pool in POOLS if decision.replicas(pool) is not None}
        self._metrics.record_decision(decision.num_draft_tokens, replicas)
        return decision

    async def report_engine(self, stats: EngineStats) -> None:
        self._ensure_loop()
        self._tracker.add_engine(stats, time.monotonic())

    async def report_router(self, report: RouterReport) -> None:
        self._ensure_loop()
        self._tracker.add_router(report, time.monotonic())

    async def decision(self) -> PolicyDecision:
        """The latest decision."""
        self._ensure_loop()
        return self._decider.decision

    async def slack(self, max_active_requests: int | None, max_busy_share: float) -> bool:
        """Whether background work (the draft trainer) may run now (policies.slack.has_slack)."""
        self._ensure_loop()
        load = self._tracker.snapshot(time.monotonic())
        target = load.pools.get("target")
        return has_slack(load.active_requests, None if target is None else target.busy_share,
                         max_active_requests, max_busy_share)

    async def load(self) -> dict[str, Any]:
        """The load the last decision saw and the depths it chose from it (`num_draft_tokens`,
        None before the first decision, when the load is the reports so far), for `specserve
        status` and debugging: with the cost curves, each class's acceptance by position and the
        overhead, policies.goodput can evaluate any depth at exactly that load."""
        self._ensure_loop()
        decided = self._decided_from is not None
        load = self._decided_from if decided else self._tracker.snapshot(time.monotonic())
        return {"active_requests": load.active_requests,
                "num_draft_tokens": dict(self._decider.decision.num_draft_tokens) if decided else None,
                "pools": {pool: {"replicas": p.replicas, "busy_share": p.busy_share, "queue_depth": p.queue_depth,
                                 "sequences": load.sequences.get(pool, 0)} for pool, p in load.pools.items()},
                "classes": {c: {"active_requests": cl.active_requests, "accept_rate": cl.accept_rate,
                                "accept_by_position": list(cl.accept_by_position)}
                            for c, cl in load.classes.items()},
                "cost_curves": {pool: asdict(curve) for pool, samples in load.cost_samples.items()
                                if (curve := fit_cost_curve(samples)) is not None},
                "round_overhead_s": load.round_overhead_s,
                "started_at": self._started_at}


def get_or_create_policy_actor(settings: PolicySettings | Any) -> ray.actor.ActorHandle:
    """The application's policy actor (`settings.actor_name`), created if missing (idempotent,
    safe against a creation race).

    settings: a PolicySettings or a specserve config (see PolicySettings.from_config). A running
    actor is sent these settings (`configure`, not waited for: the Serve controller's autoscaling
    policy calls this and must not block), so a redeploy with a new config reaches it."""
    if not isinstance(settings, PolicySettings):
        settings = PolicySettings.from_config(settings)
    # get_if_exists looks the name up, creates on a miss, and on ActorAlreadyExistsError (another
    # creator won the race) looks it up again: Ray 2.60's own get-or-create.
    actor = PolicyActor.options(name=settings.actor_name, namespace=POLICY_NAMESPACE, lifetime="detached",
                                get_if_exists=True).remote(settings.to_dict())
    actor.configure.remote(settings.to_dict())
    return actor


def kill_policy_actor(actor_name: str = POLICY_ACTOR_NAME) -> bool:
    """Remove a detached policy actor for good (e.g. after `serve shutdown`); False if none."""
    try:
        ray.kill(ray.get_actor(actor_name, namespace=POLICY_NAMESPACE), no_restart=True)
    except ValueError:
        return False
    return True
