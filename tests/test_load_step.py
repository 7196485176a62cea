"""A load step against pools autoscaled 1..2 (policy actor + Serve autoscaling, short Serve delays),
on the shipped default pair: 1 stream, then 8, then 1, then none.

On this CPU the target pool is the bottleneck under load (its verify queue grows, it is busy
nearly all the time), so it must grow to 2 replicas during the 8-stream phase, and every pool
must be back to 1 once the load is gone (the draft pool may grow too, when the target idles
waiting for blocks). No request may fail, whether it ran during a scale-up or on a replica being
removed (it re-prefills elsewhere).

The depth under load is the goodput model's choice at the load the policy measured, and it moves
away from the one-stream depth exactly where that load moves the model's optimum. Which way it
moves is for the measured costs to say, not the test: on two shared cores the per-round overhead
the routers measure under load swings with whatever else the box runs, and the model's optimum
with it, from below the one-stream depth (cheap rounds: a CPU's verify cost is linear in tokens)
to the deepest (costly rounds), while at one stream several depths lie within the decider's keep
margin of each other, so the one-stream depth itself differs from run to run (docs/testing.md).
Timing-sensitive, so measured in this run: the one-stream depth's goodput at each load seen under
8 streams, as a ratio of the optimum's there; the policy is held to the model at that load rather
than to a direction."""

import re

import pytest

from specserve.bench.load_step import Phase, autoscaled_config, run_load_step, step_bodies
from specserve.common.config import load_config
from specserve.cluster.local import start_local, stop_local
from specserve.policies.cost_curve import CostCurve
from specserve.common.naming import policy_actor_name
from specserve.policies.decision import PolicySettings
from specserve.policies.goodput import KEEP_MARGIN, ClassLoad, choose_depths, goodput_tokens_per_s, planned_loads
from tests.local_server import free_port


def _target_grew(point: dict) -> bool:
    return point["replicas"]["target"] == 2


def _back_to_minimum(point: dict) -> bool:
    return point["replicas"] == {"target": 1, "draft": 1}


# Waits for what it checks, each with a generous bound: a slower machine takes longer to start a
# replica (and to see the load), a faster one ends the phase sooner.
PHASES = [Phase(1, 15.0), Phase(8, 30.0, max_s=180.0, until=_target_grew), Phase(1, 10.0),
          Phase(0, 15.0, max_s=180.0, until=_back_to_minimum)]


@pytest.mark.ray
@pytest.mark.slow  # minutes at best on 2 cores: `make reliability`, beside the node-loss tests
def test_a_load_step_grows_the_target_pool_moves_k_with_the_model_and_both_come_back_without_failures():
    config = autoscaled_config(load_config(None), max_replicas=2, port=free_port())
    url = start_local(config)
    try:
        step = run_load_step(url, step_bodies(config.model_name, "thirdparty", max_tokens=32), PHASES,
                             policy_actor_name(config.model_name))
    finally:
        stop_local()
    summary = [(p["t_s"], p["streams"], p["replicas"], p["policy_num_draft_tokens"]) for p in step.trace]
    assert step.failures == [] and step.requests >= 20, step.failures[:3]
    assert max(point["replicas"]["target"] for point in step.phase(8)) == 2, summary
    assert step.trace[-1]["replicas"] == {"target": 1, "draft": 1}, summary[-20:]
    # The decisions under load were made from the load: the policy's model saw the 8 streams.
    seen_n = [_greedy_requests_seen(p) for p in step.phase(8)]
    assert max(n for n in seen_n if n is not None) >= 4, f"the policy never saw the load: {seen_n}"
    # The policy's first samples are transients (no measurements yet): the one-stream depth is the
    # one it settled on in the first phase.
    quiet = [p["policy_num_draft_tokens"] for p in step.trace[:15] if p["policy_num_draft_tokens"] is not None]
    assert quiet, "the policy set no depth in the first one-stream phase"
    settled_quiet = quiet[-1]
    settings = PolicySettings.from_config(config)
    judged = [_depth_at_its_load(p["policy_load"], settled_quiet, settings) for p in step.phase(8)
              if _decided_by_the_model(p.get("policy_load"))]
    assert len(judged) >= 10, f"only {len(judged)} of the 8-stream samples carry the load a decision was made from"
    # Every depth decided under load is the model's choice at the load it was decided from: within
    # KEEP_MARGIN of the optimum's goodput (the decider keeps an incumbent that close). Where the
    # one-stream depth falls outside that margin at the measured load, the load moved the optimum,
    # and the depth must have moved with it.
    off_the_model = [j for j in judged if j["decided"] != j["kept"]]
    assert not off_the_model, f"depths under load that are not the model's at their load: {off_the_model[:3]}"
    moved = [j for j in judged if j["quiet_ratio"] < 1 / (1 + KEEP_MARGIN)]
    assert all(j["decided"]["greedy"] != settled_quiet for j in moved), \
        f"K stayed at its one-stream value {settled_quiet} where the load moved the optimum: {moved[:3]}"


def _decided_by_the_model(policy_load: dict | None) -> bool:
    """Whether this sample's decision came from the goodput model (both pools' cost curves were
    measurable; before that the decider holds the configured depth)."""
    return bool(policy_load) and policy_load["num_draft_tokens"] is not None \
        and {"target", "draft"} <= set(policy_load["cost_curves"])


def _depth_at_its_load(policy_load: dict, quiet_k: int, settings: PolicySettings) -> dict:
    """The goodput model at the load a decision was made from (PolicyActor.load): the decided
    depths, what the decider keeps of them there (the same depths when they are within
    KEEP_MARGIN of the optimum), the optimum, and the one-stream depth's goodput as a ratio of the
    optimum's."""
    classes = {c: ClassLoad(v["active_requests"], v["accept_rate"], tuple(v["accept_by_position"]))
               for c, v in policy_load["classes"].items()}
    target, draft = (CostCurve(**policy_load["cost_curves"][pool]) for pool in ("target", "draft"))
    replicas = [policy_load["pools"].get(pool, {}).get("replicas", 1) for pool in ("target", "draft")]
    decided = policy_load["num_draft_tokens"]
    model = dict(target_cost=target, draft_cost=draft, target_replicas=replicas[0], draft_replicas=replicas[1],
                 min_k=settings.min_k, max_k=settings.max_k, allow_target_only=settings.allow_target_only,
                 overhead_s=policy_load["round_overhead_s"])
    best, best_goodput = choose_depths(classes, **model)
    kept, _ = choose_depths(classes, incumbent=decided, **model)
    quiet = {**decided, "greedy": quiet_k}
    quiet_goodput = goodput_tokens_per_s(planned_loads(classes), quiet, target, draft, replicas[0], replicas[1],
                                         policy_load["round_overhead_s"])
    return {"decided": decided, "kept": kept, "best": best, "quiet_ratio": round(quiet_goodput / best_goodput, 4),
            "n": classes["greedy"].active_requests, "replicas": replicas,
            "overhead_s": round(policy_load["round_overhead_s"], 4)}


def _greedy_requests_seen(point: dict) -> int | None:
    """n in the policy's reason 'depth: greedy K=8 (n=8, alpha=0.89), ...' for this sample."""
    for reason in point.get("policy_reasons") or []:
        found = re.search(r"greedy K=\d+ \(n=(\d+)", reason)
        if found:
            return int(found.group(1))
    return None


def test_a_phase_ends_at_its_condition_after_its_minimum_or_at_its_bound():
    grown = {"replicas": {"target": 2, "draft": 1}}
    still = {"replicas": {"target": 1, "draft": 1}}
    phase = Phase(8, 30.0, max_s=180.0, until=_target_grew)
    assert not phase.over(10.0, grown)  # the minimum holds even when the condition is met
    assert not phase.over(31.0, still) and phase.over(31.0, grown)
    assert phase.over(180.0, still)  # the bound ends it (the test's assertion then fails, it never hangs)
    assert not Phase(1, 10.0).over(9.0, still) and Phase(1, 10.0).over(10.0, still)
