"""On a cluster with (fake) GPUs the draft and target engines get distinct GPUs, and the policy
actor can die under load without failing a request."""

from __future__ import annotations

import threading
import time

import pytest
import ray
from ray import serve

from cluster.builder import APP_NAME
from policies.actor import POLICY_NAMESPACE, policy_actor_name
from tests.test_serving import MODEL, PROMPTS

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def gpu_server(tiny_pair_server):
    """The shared served tiny pair: its cluster offers four fake GPUs and each engine asks for one
    (tests/local_server.py), enough to prove placement on this CPU box."""
    url, config = tiny_pair_server
    assert config.target_workers.num_gpus == config.draft_workers.num_gpus == 1
    return url


def engine_stats(deployment: str):
    engine = serve.get_deployment_handle(deployment, APP_NAME).get_engine.remote().result()
    return ray.get(engine.stats.remote())


def test_draft_and_target_engines_hold_distinct_gpus(gpu_server):
    target, draft = engine_stats("TargetWorker"), engine_stats("DraftWorker")
    assert len(target.gpu_ids) == 1 and len(draft.gpu_ids) == 1
    assert target.gpu_ids != draft.gpu_ids


def test_killing_the_policy_actor_under_load_fails_no_request_and_it_comes_back(gpu_server):
    import httpx

    failures: list[str] = []

    def stream(i: int) -> None:
        body = {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 60, "temperature": 0}
        for _ in range(3):
            response = httpx.post(f"{gpu_server}/v1/completions", json=body, timeout=120)
            if response.status_code != 200 or response.json()["usage"]["completion_tokens"] != 60:
                failures.append(response.text)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    actor_name = policy_actor_name(MODEL)   # this app's own policy actor
    deadline = time.monotonic() + 30
    while True:  # the routers create the actor with their first request
        try:
            policy = ray.get_actor(actor_name, namespace=POLICY_NAMESPACE)
            break
        except ValueError:
            assert time.monotonic() < deadline, f"no policy actor {actor_name!r} appeared"
            time.sleep(0.2)
    first_start = ray.get(policy.load.remote())["started_at"]
    ray.kill(policy, no_restart=False)
    for thread in threads:
        thread.join(timeout=300)
    assert not failures
    deadline = time.monotonic() + 60
    while True:  # Ray restarts it (max_restarts=-1) and it answers again
        try:
            restarted = ray.get(ray.get_actor(actor_name, namespace=POLICY_NAMESPACE).load.remote(), timeout=5)
            if restarted["started_at"] != first_start:
                break
        except Exception:
            pass
        assert time.monotonic() < deadline, "the policy actor did not come back"
        time.sleep(0.5)
