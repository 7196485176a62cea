"""On a cluster with (fake) GPUs the draft and target engines get distinct GPUs, requests sharing a
prompt prefix go to the target replica that holds it, and the policy actor can die under load
without failing a request."""

from __future__ import annotations

import threading
import time

import pytest
import ray
from ray import serve

from specserve.cluster.builder import APP_NAME
from specserve.cluster.local import RAY_SYSTEM_CONFIG, init_local_ray
from specserve.common.naming import ENGINE_NAMESPACE, parse_engine_actor_name
from specserve.common.naming import policy_actor_name
from specserve.policies.actor import POLICY_NAMESPACE
from tests.local_server import serve_tiny_pair
from tests.test_serving import MODEL, PROMPTS

# In make reliability: a cluster of its own (fake GPUs, two target replicas) costs make test a
# Serve start; the bundles each engine asks for are checked in process (tests/test_builder.py).
pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory):
    # Ray places by logical resources: four "GPUs" on this CPU box are enough to prove placement.
    engine = {"num_gpus": 1, "num_cpus": 0.5}
    init_local_ray(num_cpus=4, num_gpus=4, include_dashboard=False, _system_config=RAY_SYSTEM_CONFIG)
    for url, _ in serve_tiny_pair(tmp_path_factory.mktemp("pair"), MODEL, target_workers={**engine, "num_replicas": 2},
                                  draft_workers=engine):
        yield url


def engine_stats(deployment: str):
    engine = serve.get_deployment_handle(deployment, APP_NAME).get_engine.remote().result()
    return ray.get(engine.actor.stats.remote())


def test_draft_and_target_engines_hold_distinct_gpus(gpu_server):
    target, draft = engine_stats("TargetWorker"), engine_stats("DraftWorker")
    assert len(target.gpu_ids) == 1 and len(draft.gpu_ids) == 1
    assert target.gpu_ids != draft.gpu_ids


def target_engines_prefix_queries() -> dict[str, int]:
    """Prompt tokens each target engine has looked up in its prefix cache so far, by engine name."""
    names = [actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
             if (parse_engine_actor_name(actor["name"]) or ("",))[0] == "target"]
    return {name: ray.get(ray.get_actor(name, namespace=ENGINE_NAMESPACE).stats.remote()).kv.prefix_cache_queries
            for name in names}


def test_requests_sharing_a_prompt_prefix_go_to_the_target_replica_that_holds_it(gpu_server):
    """Two target replicas: six prompts sharing their first blocks all prefill on one of them
    (policies.prefix_routing), each after the first finding the shared blocks cached. Routed by
    load alone, all six would meet on one replica about 3% of the time."""
    import httpx

    before = target_engines_prefix_queries()
    assert len(before) == 2
    shared = "# a shared system prompt\n" + "def double(x):\n    return x * 2\n" * 12
    cached = []
    for i in range(6):
        body = {"model": MODEL, "prompt": shared + f"# question {i}\n", "max_tokens": 2, "temperature": 0}
        response = httpx.post(f"{gpu_server}/v1/completions", json=body, timeout=120).json()
        cached.append(response["usage"]["prompt_tokens_details"]["cached_tokens"])
    after = target_engines_prefix_queries()
    assert sorted(after[name] > before[name] for name in after) == [False, True], (before, after)
    assert cached[0] == 0 and all(tokens >= 64 for tokens in cached[1:]), cached


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
