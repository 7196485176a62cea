"""speculation.compiled_graph: a lone request's rounds run as one Ray compiled graph (the fast lane).

End to end on a real local cluster: the lane is used (rounds counted in the response's
`speculation`), greedy output equals the target's own greedy output, company falls back to the
ordinary path without a wrong token, and a stream dropped mid-round leaves no state behind and
the lane still works for the next request."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import ray
from ray import serve

from cluster.builder import APP_NAME

from tests.local_server import greedy_reference, serve_tiny_pair
from tests.test_reliability import assert_nothing_held
from tests.test_serving import PROMPTS

pytestmark = pytest.mark.ray
MODEL = "tiny-pair"
IDLE_S = 1.5


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # K pinned: the policy may find that the tiny random pair's drafts do not pay and choose K = 0,
    # and a round that drafts nothing has nothing to send through the lane.
    yield from serve_tiny_pair(tmp_path_factory.mktemp("pair"), MODEL,
                               speculation={"compiled_graph": True, "adaptive": False, "num_draft_tokens": 4,
                                            "compiled_graph_idle_s": IDLE_S})


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def greedy_text(server):
    return greedy_reference(server[1].target.path)


def test_a_lone_greedy_request_runs_in_the_lane_and_equals_target_greedy(client, greedy_text):
    for prompt in PROMPTS:
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
        speculation = response.model_extra["speculation"]
        assert response.choices[0].text == greedy_text(prompt, 40)
        assert speculation["lane_rounds"] > 0 and speculation["lane_rounds"] == speculation["rounds"], speculation


def test_a_lone_sampled_request_runs_in_the_lane(client):
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=30, temperature=1.0, seed=3)
    assert response.usage.completion_tokens == 30
    assert response.model_extra["speculation"]["lane_rounds"] > 0


def test_with_company_requests_take_the_ordinary_path_and_stay_exact(client, greedy_text):
    def one(prompt: str) -> tuple[str, dict]:
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
        return response.choices[0].text, response.model_extra["speculation"]

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(one, PROMPTS * 2))
    for prompt, (text, _) in zip(PROMPTS * 2, answers):
        assert text == greedy_text(prompt, 40)
    assert any(speculation["lane_rounds"] < speculation["rounds"] for _, speculation in answers)


def test_streams_dropped_mid_round_leave_no_state_and_the_lane_still_serves(server, client, greedy_text):
    url = server[0]

    async def drop_after(lines_wanted: int) -> None:
        body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 120, "temperature": 0, "stream": True}
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                lines = 0
                async for line in response.aiter_lines():
                    lines += line.startswith("data: ")
                    if lines >= lines_wanted:
                        return  # leaving the block drops the connection mid-stream

    for lines_wanted in (1, 2, 3, 5, 8):
        asyncio.run(drop_after(lines_wanted))
    assert_nothing_held()
    response = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=40, temperature=0)
    assert response.choices[0].text == greedy_text(PROMPTS[2], 40)
    assert response.model_extra["speculation"]["lane_rounds"] > 0


def test_an_idle_lane_is_torn_down_and_reopened_for_the_next_lone_request(client):
    """An open graph's channels poll (bench.graph_idle), so a lane that carries no round for
    compiled_graph_idle_s is torn down and both engines are free to be claimed again."""
    assert client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20,
                                     temperature=0).model_extra["speculation"]["lane_rounds"] > 0
    time.sleep(IDLE_S + 2.0)
    for name in ("DraftWorker", "TargetWorker"):
        engine = serve.get_deployment_handle(name, APP_NAME).get_engine.remote().result()
        assert ray.get(engine.claim_lane.remote("probe")), f"{name}'s engine is still held by a lane"
        ray.get(engine.free_lane.remote("probe"))
    assert client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20,
                                     temperature=0).model_extra["speculation"]["lane_rounds"] > 0


def test_a_draft_engine_lost_mid_lane_leaves_the_request_to_go_on_target_only(server, greedy_text):
    """Last in this module: it kills the draft engine while a lone request runs in the lane (after
    a few lane rounds). The lane fails, closes, and the round goes the ordinary way, which finds the
    draft gone and continues target-only: same greedy text, one draft failure, no state left."""
    from tests.test_serving import _assert_no_leftovers, _stream_killing_engine_midway

    result = _stream_killing_engine_midway(server[0], PROMPTS[2], 120, "DraftWorker", after_chunks=4)
    text, final = result["text"], result["final"]
    assert text == greedy_text(PROMPTS[2], 120)
    speculation = final["speculation"]
    assert speculation["draft_failures"] == 1 and speculation["num_emitted"] == 120
    assert 0 < speculation["lane_rounds"] < speculation["target_passes"]  # in the lane until the kill
    _assert_no_leftovers(timeout_s=60)  # polls past the dead engine until Serve replaces it
