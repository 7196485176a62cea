"""A load step against pools autoscaled 1..2 (policy actor + Serve autoscaling, short Serve delays),
on the shipped default pair: 1 stream, then 8, then 1, then none.

On this CPU the target pool is the bottleneck under load (its verify queue grows, it is busy
nearly all the time), so it must grow to 2 replicas during the 8-stream phase, and every pool
must be back to 1 once the load is gone (the draft pool may grow too, when the target idles
waiting for blocks). The depth the policy allows a greedy request must change with the load,
and no request may fail, whether it ran during a scale-up or on a replica being removed (it
re-prefills elsewhere)."""

import re
from collections import Counter

import pytest

from specserve.bench.load_step import Phase, autoscaled_config, run_load_step, step_bodies
from specserve.common.config import load_config
from specserve.cluster.local import start_local, stop_local
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
def test_a_load_step_grows_the_target_pool_moves_k_and_both_come_back_without_failures():
    config = autoscaled_config(load_config(None), max_replicas=2, port=free_port())
    url = start_local(config)
    try:
        step = run_load_step(url, step_bodies(config.model_name, "thirdparty", max_tokens=32), PHASES)
    finally:
        stop_local()
    summary = [(p["t_s"], p["streams"], p["replicas"], p["policy_num_draft_tokens"]) for p in step.trace]
    assert step.failures == [] and step.requests >= 20, step.failures[:3]
    assert max(point["replicas"]["target"] for point in step.phase(8)) == 2, summary
    assert step.trace[-1]["replicas"] == {"target": 1, "draft": 1}, summary[-20:]
    # The decisions under load were made from the load: the policy's model saw the 8 streams.
    seen_n = [_greedy_requests_seen(p) for p in step.phase(8)]
    assert max(n for n in seen_n if n is not None) >= 4, f"the policy never saw the load: {seen_n}"
    # The depth follows the load where the load moves the model's optimum. The policy's first
    # samples are transients (no measurements yet): compare the depth it settled on for one stream
    # with the depth it held most of the time under load. Where both are the deepest allowed, the
    # optimum did not move on this machine (a slow one pays so much per round that K = max pays at
    # any load); that the optimum moves with the cost curves is tested without Ray in test_goodput.
    quiet = [p["policy_num_draft_tokens"] for p in step.trace[:15] if p["policy_num_draft_tokens"] is not None]
    assert quiet, "the policy set no depth in the first one-stream phase"
    settled_quiet = quiet[-1]
    loaded = [p["policy_num_draft_tokens"] for p in step.phase(8)]
    loaded_mode = Counter(loaded).most_common(1)[0][0]
    deepest = config.speculation.max_draft_tokens
    assert loaded_mode != settled_quiet or settled_quiet == deepest, \
        f"K under load {loaded} stayed at its one-stream value {settled_quiet}, below the deepest ({deepest})"


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
