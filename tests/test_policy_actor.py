"""The policy actor on a small local Ray cluster: reports become decisions, it survives being
killed, and Serve scales a deployment through `policies.autoscaling.PoolPolicy`. Both detached
actors (the policy actor, the draft trainer) follow a redeploy's new config."""

import threading
import time

import pytest
import ray
from ray import serve

from specserve.common.messages import ClassReport, EngineStats, PolicyDecision, RouterReport
from specserve.policies.actor import POLICY_ACTOR_NAME, POLICY_NAMESPACE, get_or_create_policy_actor, kill_policy_actor
from specserve.common.naming import policy_actor_name
from specserve.policies.decision import PolicySettings
from specserve.policies.replicas import ScalingThresholds
from tests.local_server import wait_for

pytestmark = pytest.mark.ray
SETTINGS = PolicySettings(target_bounds=(1, 3), draft_bounds=(1, 3), thresholds=ScalingThresholds(cooldown_s=0.0),
                          report_ttl_s=3.0, decide_interval_s=0.2)
COST_SAMPLES = tuple((tokens, 0.010 + 0.00001 * tokens) for tokens in (1, 2, 4, 8, 16))


class Reporter:
    """Plays target engines, a draft engine and a router, reporting every 0.3 s."""

    def __init__(self, target_busy: float, draft_busy: float, active: int, target_replicas: int = 1) -> None:
        self.shares = {"target": target_busy, "draft": draft_busy}
        self.replicas = {"target": target_replicas, "draft": 1}
        self.active = active
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        clock = 0.0
        while not self._stop.is_set():
            clock += 0.3
            try:
                actor = ray.get_actor(POLICY_ACTOR_NAME, namespace=POLICY_NAMESPACE)
                for pool, share in self.shares.items():
                    for replica in range(self.replicas[pool]):
                        actor.report_engine.remote(EngineStats(
                            pool, f"{pool}-{replica}", sequences=self.active, free_slots=8, queue_depth=0,
                            forwards=1, batch_rows_total=1, busy_s=share * clock, idle_s=(1 - share) * clock,
                            cost_samples=COST_SAMPLES))
                actor.report_router.remote(RouterReport("r1", self.active, {"greedy": self.active, "sampled": 0},
                                                        {"greedy": ClassReport(10, 40, 30)}))
            except (ValueError, ray.exceptions.RayError):
                pass  # actor restarting: report again next tick
            self._stop.wait(0.3)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def cluster(tiny_pair_server):
    """The default application's policy actor, on the shared served tiny pair's cluster (whose own
    app, model "tiny-pair", has an actor of another name); removed after, leaving the cluster as
    it was."""
    actor = get_or_create_policy_actor(SETTINGS)
    yield actor
    kill_policy_actor()


def decision(actor) -> PolicyDecision:
    return ray.get(actor.decision.remote(), timeout=10)


def test_get_or_create_returns_the_same_actor(cluster):
    again = get_or_create_policy_actor(SETTINGS)
    assert again._actor_id == cluster._actor_id


def test_each_application_has_its_own_policy_actor(cluster):
    """Two apps in one cluster (settings built from configs with different model names) get two
    actors: one app's load reports never reach the other's decisions."""
    from dataclasses import replace

    other_settings = replace(SETTINGS, actor_name=policy_actor_name("another-model"))
    other = get_or_create_policy_actor(other_settings)
    try:
        assert other._actor_id != cluster._actor_id
        other.report_router.remote(RouterReport("r-other", 5, {"greedy": 5, "sampled": 0}, {}))
        wait_for(lambda: ray.get(other.load.remote(), timeout=10)["active_requests"] == 5, what="the report")
        assert ray.get(cluster.load.remote(), timeout=10)["active_requests"] != 5
    finally:
        kill_policy_actor(other_settings.actor_name)


def test_a_redeploy_with_new_settings_reaches_the_running_policy_actor(cluster):
    """The actor outlives `serve deploy`; the redeployed routers' lookup brings the new settings."""
    from dataclasses import replace

    first = replace(SETTINGS, actor_name=policy_actor_name("redeployed-model"), default_k=3)
    actor = get_or_create_policy_actor(first)
    try:
        wait_for(lambda: set(decision(actor).num_draft_tokens.values()) == {3}, what="the first settings' K")
        again = get_or_create_policy_actor(replace(first, default_k=5))
        assert again._actor_id == actor._actor_id
        wait_for(lambda: set(decision(actor).num_draft_tokens.values()) == {5}, timeout_s=20,
                 what="the redeployed settings' K")
    finally:
        kill_policy_actor(first.actor_name)


@pytest.mark.slow   # make reliability: two trainers' start-ups take a third of a minute
def test_a_redeploy_with_a_new_draft_replaces_the_draft_trainer(cluster):
    """A trainer built for the old draft would offer versions of it to engines serving the new
    one: the lookup with the new config makes the old trainer exit and a new one take over; the
    same config keeps the running trainer."""
    from specserve.common.config import SpecServeConfig
    from specserve.deployments.draft_trainer import get_or_create_draft_trainer
    from specserve.common.naming import ENGINE_NAMESPACE, draft_trainer_name

    def config(draft_path: str) -> SpecServeConfig:
        return SpecServeConfig.model_validate({"model_name": "redeployed-trainer", "draft": {"path": draft_path},
                                               "draft_training": {"enabled": True, "num_cpus": 0.1}})

    def serving_path() -> str:
        return ray.get(get_or_create_draft_trainer(new).status.remote(), timeout=10)["versions"][0]["path"]

    old, new = config("/models/draft-a"), config("/models/draft-b")
    first = get_or_create_draft_trainer(old)
    try:
        assert ray.get(first.status.remote(), timeout=30)["versions"][0]["path"] == "/models/draft-a"
        assert get_or_create_draft_trainer(old)._actor_id == first._actor_id
        wait_for(lambda: serving_path() == "/models/draft-b", timeout_s=30, what="a trainer for the new draft")
        assert get_or_create_draft_trainer(new)._actor_id != first._actor_id
    finally:
        for _ in range(2):
            try:
                ray.kill(ray.get_actor(draft_trainer_name("redeployed-trainer"), namespace=ENGINE_NAMESPACE),
                         no_restart=True)
            except ValueError:
                break


def test_reports_become_a_decision_that_scales_the_bottleneck(cluster):
    reporter = Reporter(target_busy=0.3, draft_busy=0.95, active=4)
    try:
        final = wait_for(lambda: (d := decision(cluster)).draft_replicas == 2 and d, what="draft pool scale-up")
    finally:
        reporter.stop()
    assert final.target_replicas == 1
    assert set(final.num_draft_tokens) == {"greedy", "sampled"}
    assert any("draft: busy" in reason for reason in final.reasons)


def test_a_killed_actor_comes_back_and_decides_again(cluster):
    started = ray.get(cluster.load.remote())["started_at"]
    ray.kill(cluster, no_restart=False)
    reporter = Reporter(target_busy=0.95, draft_busy=0.5, active=4)
    try:
        wait_for(lambda: ray.get(cluster.load.remote(), timeout=10)["started_at"] != started, what="actor restart")
        final = wait_for(lambda: (d := decision(cluster)).target_replicas == 2 and d, what="decision after restart")
    finally:
        reporter.stop()
    assert final.version >= 1


def test_serve_scales_a_deployment_through_the_pool_policy(cluster):
    @serve.deployment(autoscaling_config={
        "min_replicas": 1, "max_replicas": 3, "initial_replicas": 1, "upscale_delay_s": 0, "downscale_delay_s": 0,
        "policy": {"policy_function": "specserve.policies.autoscaling:PoolPolicy", "policy_kwargs": {"pool": "target"}}},
        ray_actor_options={"num_cpus": 0.1})
    class Pool:
        def __call__(self) -> str:
            return "ok"

    def running() -> int:
        status = serve.status().applications["pool"].deployments["Pool"]
        return status.replica_states.get("RUNNING", 0)

    # Start from an actor with no decision yet (earlier tests left it asking for 2 targets): a fresh
    # one has no opinion, so Serve keeps initial_replicas until reports say otherwise.
    kill_policy_actor()
    get_or_create_policy_actor(SETTINGS)
    serve.run(Pool.bind(), name="pool", route_prefix=None)
    assert running() == 1
    reporter = Reporter(target_busy=0.95, draft_busy=0.5, active=4)
    try:
        wait_for(lambda: running() == 2, timeout_s=90, what="Serve to add the replica the policy asked for")
    finally:
        reporter.stop()
    reporter = Reporter(target_busy=0.05, draft_busy=0.05, active=0, target_replicas=2)
    try:
        wait_for(lambda: running() == 1, timeout_s=90, what="Serve to remove the idle replica")
    finally:
        reporter.stop()
    serve.delete("pool")


def test_pool_policy_never_blocks_and_falls_back_to_the_current_target(cluster):
    from types import SimpleNamespace

    from specserve.policies.autoscaling import PoolPolicy

    policy = PoolPolicy(pool="target", poll_interval_s=0.1, max_decision_age_s=2.0)
    context = SimpleNamespace(target_num_replicas=3, policy_state={"kept": True})
    started = time.monotonic()
    replicas, state = policy(context)
    assert time.monotonic() - started < 0.5  # a name lookup and a .remote(): no waiting on the actor
    assert (replicas, state) == (3, {"kept": True})  # no decision read yet: keep what Serve has
    reporter = Reporter(target_busy=0.95, draft_busy=0.5, active=4)
    try:
        wait_for(lambda: policy(context)[0] == 2, what="the actor's decision through the policy")
    finally:
        reporter.stop()
    kill_policy_actor()
    wait_for(lambda: policy(context)[0] == 3, what="fallback once the decision is stale")
