"""Under abuse: past capacity the excess gets 503 with Retry-After, a request past its deadline
ends with what it has, a storm of dropped connections leaves no state anywhere, and a router
that dies mid-stream ends its streams with an error at once and leaves nothing on the engines
(last: Serve replaces the router).

One small server whose limits are tight on purpose: 3 requests run at once, 3 may wait (up to
2 s), and a request may run for 1.5 s."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import ray
from ray import serve

from specserve.cluster.builder import APP_NAME
from tests.local_server import serve_tiny_pair
from tests.test_serving import MODEL, PROMPTS

pytestmark = [pytest.mark.ray, pytest.mark.slow]   # make reliability: a server of its own costs a minute
MAX_ACTIVE, MAX_QUEUED = 3, 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    limits = {"max_tokens": 200, "max_active_requests": MAX_ACTIVE, "max_queued_requests": MAX_QUEUED,
              "queue_timeout_s": 2.0, "request_timeout_s": 1.5}
    for url, _ in serve_tiny_pair(tmp_path_factory.mktemp("pair"), MODEL, limits=limits):
        yield url


def held_state() -> dict:
    """How many requests the router runs or queues, and the ids of the sequences every engine
    holds (named, so a leak says whose: a request's, or one of its pre-drafts')."""
    router = serve.get_deployment_handle("Router", APP_NAME).status.remote().result()
    held = {"router_active": router["active_requests"], "router_queued": router["queued_requests"]}
    for name in ("TargetWorker", "DraftWorker"):
        engine = serve.get_deployment_handle(name, APP_NAME).get_engine.remote().result()
        held[name] = ray.get(engine.actor.active_sequences.remote())
    return held


def assert_nothing_held(timeout_s: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while any((held := held_state()).values()):
        if time.monotonic() > deadline:
            raise AssertionError(f"state left behind: {held}")
        time.sleep(0.2)


def body(prompt: str, max_tokens: int, stream: bool = False, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream, **extra}


def test_a_request_past_its_deadline_ends_with_its_tokens_so_far(server):
    # The tiny pair needs well over 1.5 s for 200 tokens only if something stalls it, so make the
    # deadline bite for sure: several long requests share the engines.
    results = []

    def one():
        results.append(httpx.post(f"{server}/v1/completions", json=body(PROMPTS[0], 200), timeout=60))

    threads = [threading.Thread(target=one) for _ in range(MAX_ACTIVE)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(r.status_code == 200 for r in results), [r.text for r in results]
    finishes = {r.json()["choices"][0]["finish_reason"] for r in results}
    assert finishes <= {"length", "timeout"}
    for r in results:
        if r.json()["choices"][0]["finish_reason"] == "timeout":
            assert 0 < r.json()["usage"]["completion_tokens"] < 200
    assert_nothing_held()


def test_past_capacity_the_excess_gets_503_with_retry_after_and_the_admitted_finish(server):
    async def scenario():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*[client.post(f"{server}/v1/completions", json=body(PROMPTS[1], 150))
                                          for _ in range(3 * (MAX_ACTIVE + MAX_QUEUED))])

    responses = asyncio.run(scenario())
    refused = [r for r in responses if r.status_code == 503]
    served = [r for r in responses if r.status_code == 200]
    assert len(refused) + len(served) == len(responses), {r.status_code for r in responses}
    assert refused and len(served) >= MAX_ACTIVE + MAX_QUEUED
    for response in refused:
        assert float(response.headers["retry-after"]) > 0
        error = response.json()["error"]
        assert error["type"] and error["message"]
    for response in served:
        assert response.json()["usage"]["completion_tokens"] > 0
    assert_nothing_held()


STORM_PLANS = ["during_prefill", "before_first_byte", "first_chunk", "mid_stream", "complete"]


def test_a_storm_of_dropped_connections_leaves_no_state(server):
    """500 streaming requests, 8 at a time, dropped at random: during prefill (the client gives up
    before any response, after a few milliseconds, on a long prompt), right after the response
    starts, after the first chunk, or mid-stream; some read to the end (~20 s here)."""
    rng = random.Random(7)
    plans = [(rng.choice(STORM_PLANS), rng.uniform(0.002, 0.05)) for _ in range(500)]
    long_prompt = " ".join(PROMPTS)  # the longest prompt the tiny pair's context leaves room for

    async def one(client: httpx.AsyncClient, plan: str, prompt: str) -> None:
        async with client.stream("POST", f"{server}/v1/completions",
                                 json=body(prompt, 120, stream=True)) as response:
            if plan == "before_first_byte" or response.status_code != 200:
                return
            lines = 0
            async for line in response.aiter_lines():
                lines += line.startswith("data: ")
                if plan == "first_chunk" and lines >= 1 or plan == "mid_stream" and lines >= 4:
                    return  # leaving the block drops the connection

    async def storm():
        semaphore = asyncio.Semaphore(8)
        async with httpx.AsyncClient(timeout=60) as client:
            async def bounded(i: int, plan: str, give_up_s: float):
                async with semaphore:
                    try:
                        if plan == "during_prefill":
                            await asyncio.wait_for(one(client, plan, long_prompt), give_up_s)
                        else:
                            await one(client, plan, PROMPTS[i % len(PROMPTS)])
                    except (httpx.HTTPError, asyncio.TimeoutError):
                        pass

            await asyncio.gather(*[bounded(i, plan, give_up_s) for i, (plan, give_up_s) in enumerate(plans)])

    asyncio.run(storm())
    assert_nothing_held(timeout_s=60)
    # The operator's view says the same: `specserve status --json` from another process.
    shown = subprocess.run([str(Path(sys.executable).with_name("specserve")), "status", "--json", "--address",
                            ray.get_runtime_context().gcs_address], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    status = json.loads(shown.stdout)
    assert status["load"]["active_requests"] == 0
    for pool in ("draft", "target"):
        assert status["pools"][pool]["replicas"] == 1
        assert status["pools"][pool]["sequences"] == 0


def test_a_router_that_dies_mid_stream_ends_the_stream_with_an_error_and_its_replacement_serves(server):
    """A request's chunks come over the router's channel to the ingress, and its one Serve call
    carries the router's death: the client reads an in-band error within seconds, not a stream
    that hangs; the engines free what it held as its channels close, not after the idle timeout.
    The router is frozen the moment the first chunk arrives (so the request cannot finish first),
    then killed. Runs last: Serve then replaces the router."""
    name = next(actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
                if actor["namespace"] == "serve" and "#Router#" in actor["name"])
    router = ray.get_actor(name, namespace="serve")
    pid = ray.get(router.__ray_call__.remote(lambda _: os.getpid()))
    events, started = [], time.monotonic()
    with httpx.stream("POST", f"{server}/v1/completions", json=body(PROMPTS[0], 200, stream=True),
                      timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
                if len(events) == 1:
                    os.kill(pid, signal.SIGSTOP)
                    ray.kill(router, no_restart=False)
    assert "error" in events[-1] and "choices" in events[0], events[-1]
    assert time.monotonic() - started < 60
    deadline = time.monotonic() + 120
    while True:   # the replacement router serves
        answer = httpx.post(f"{server}/v1/completions", json=body(PROMPTS[1], 8), timeout=60)
        if answer.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert answer.status_code == 200, answer.text
    assert_nothing_held(timeout_s=60)   # the engines freed what the dead router held when its channels closed
