"""A load step against pools autoscaled 1..2 (policy actor + Serve autoscaling, short Serve delays),
on the shipped default pair: 1 stream, then 8, then 1, then none.

On this CPU the target pool is the bottleneck under load (its verify queue grows, it is busy
nearly all the time), so it must grow to 2 replicas during the 8-stream phase, and every pool
must be back to 1 once the load is gone (the draft pool may grow too, when the target idles
waiting for blocks). The depth the policy allows a greedy request must change with the load,
and no request may fail, whether it ran during a scale-up or on a replica being removed (it
re-prefills elsewhere)."""

import pytest

from bench.load_step import autoscaled_config, run_load_step, step_bodies
from cluster.config import load_config
from cluster.local import start_local, stop_local
from tests.local_server import free_port

SCHEDULE = [(10.0, 1), (45.0, 8), (10.0, 1), (30.0, 0)]  # (seconds, streams)


@pytest.mark.ray
def test_a_load_step_grows_the_target_pool_moves_k_and_both_come_back_without_failures():
    config = autoscaled_config(load_config(None), max_replicas=2, port=free_port())
    url = start_local(config)
    try:
        step = run_load_step(url, step_bodies(config.model_name, "thirdparty", max_tokens=32), SCHEDULE)
    finally:
        stop_local()
    summary = [(p["t_s"], p["streams"], p["replicas"], p["policy_num_draft_tokens"]) for p in step.trace]
    assert step.failures == [] and step.requests >= 20, step.failures[:3]
    assert max(point["replicas"]["target"] for point in step.phase(8)) == 2, summary
    assert step.trace[-1]["replicas"] == {"target": 1, "draft": 1}, summary[-20:]
    depths = [point["policy_num_draft_tokens"] for point in step.trace if point["policy_num_draft_tokens"] is not None]
    assert len(set(depths)) > 1, f"the policy's depth never moved: {depths}"
    quiet_before = [p["policy_num_draft_tokens"] for p in step.trace[:10]]
    loaded = [p["policy_num_draft_tokens"] for p in step.phase(8)]
    assert set(loaded) - set(quiet_before), f"K under load {loaded} never left its quiet values {quiet_before}"
