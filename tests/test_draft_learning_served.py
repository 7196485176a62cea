"""Online draft training end to end on the tiny pair (docs/online-learning.md): real Ray Serve, HTTP and the
official openai client. Traffic comes in, the trainer distils the draft while the cluster is
idle, the canary passes, every draft engine swaps, and the next responses carry a trained
draft_version with greedy texts still equal to the target's own; `specserve status` shows the version and the
acceptance before and after, and the captured rows were persisted only because capture_dir asked."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import ray

from specserve.cluster.status import render_table, summarize, trainer_status
from specserve.decoding.capture import load_blocks
from tests.local_server import greedy_reference, serve_tiny_pair

pytestmark = [pytest.mark.ray, pytest.mark.slow]   # in `make reliability`: docs/testing.md
MODEL = "tiny-learning"
PROMPTS = [f"def {name}(items):\n    " for name in ("total", "largest", "reverse", "flatten", "unique", "count",
                                                    "merge", "window", "pairs", "chunks", "sorted_by", "first")]
TRAIN_TIMEOUT_S = 90.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("learning")
    training = {"enabled": True, "sample_every": 1, "min_new_positions": 300, "lr": 1e-3, "epochs": 3,
                "canary_margin": 0.002, "capture_dir": str(root / "captures"), "versions_dir": str(root / "versions"),
                "num_cpus": 0.5}
    yield from serve_tiny_pair(root / "pair", MODEL, draft_training=training)


def complete(client: openai.OpenAI, prompt: str, temperature: float, seed: int | None = None, model: str = MODEL):
    return client.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=temperature, seed=seed)


def traffic(client: openai.OpenAI, model: str = MODEL) -> list:
    """A greedy request per prompt and 12 seeded sampled ones, 4 at a time; -> the greedy responses."""
    with ThreadPoolExecutor(4) as pool:
        greedy = list(pool.map(lambda p: complete(client, p, 0.0, model=model), PROMPTS))
        list(pool.map(lambda n: complete(client, PROMPTS[n % len(PROMPTS)], 0.8, seed=n, model=model), range(12)))
    return greedy


def wait_for_a_trained_version(timeout_s: float, more_traffic: Callable[[], object]) -> dict | None:
    """The trainer's status once it serves a trained version and every engine it knows serves it
    (or the last status seen when timeout_s passes). After a refused pass (its candidate did not
    beat the serving draft by the canary margin on the held-back positions: the trainer doing its
    job) more_traffic() is sent, as a live server would get it, so that the next pass has the new
    positions it waits for."""
    deadline, status, refused = time.monotonic() + timeout_s, None, 0
    while time.monotonic() < deadline:
        status = trainer_status()
        if status and status["draft_version"] >= 1 and set(status["engines"].values()) == {status["draft_version"]}:
            break
        if status and status["passes"]["refused"] > refused:
            refused = status["passes"]["refused"]
            more_traffic()
        time.sleep(0.5)
    return status


def test_traffic_in_a_new_draft_version_out(server):
    url, config = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    before = traffic(client)
    assert {r.model_extra["speculation"]["draft_version"] for r in before} == {0}
    status = wait_for_a_trained_version(TRAIN_TIMEOUT_S, lambda: traffic(client))  # trains, canaries, swaps
    assert status and status["draft_version"] >= 1, status
    assert status["expected_acceptance_after"] > status["expected_acceptance_before"]
    after = [complete(client, prompt, 0.0) for prompt in PROMPTS]
    # Trained versions only: the positions the traffic left may have started another pass, whose
    # version can be swapped in while these run (the trainer doing its job).
    assert min(r.model_extra["speculation"]["draft_version"] for r in after) >= status["draft_version"]
    reference = greedy_reference(config.target.path)
    assert [r.choices[0].text for r in after] == [r.choices[0].text for r in before]
    assert after[0].choices[0].text == reference(PROMPTS[0], 32)
    now = trainer_status()
    assert f"draft version {now['draft_version']}: trained" in render_table(summarize([], None, {}, now))
    captured = list(load_blocks(config.draft_training.capture_dir))
    assert captured and all(b.top_ids.shape == (b.num_positions, config.draft_training.top_k) for b in captured)
    print(f"live acceptance {status['live_acceptance_before']} -> {trainer_status()['live_acceptance_after']}; "
          f"expected {status['expected_acceptance_before']:.3f} -> {status['expected_acceptance_after']:.3f}")
    # A trainer that dies leaves serving untouched: the engines keep the version they serve, and
    # the trainer the next captured rounds start adopts it instead of taking the engines back.
    ray.kill(ray.get_actor(f"draft-trainer:{MODEL}", namespace="specserve"), no_restart=True)
    again = [complete(client, prompt, 0.0) for prompt in PROMPTS[:4] * 2]
    served = {r.model_extra["speculation"]["draft_version"] for r in again}
    assert len(served) == 1 and min(served) >= 1, served
    assert [r.choices[0].text for r in again[:4]] == [r.choices[0].text for r in before[:4]]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not ((status := trainer_status()) and {status["draft_version"]} == served):
        complete(client, PROMPTS[0], 0.0)  # captured rounds: their pushes find the trainer gone and start one
        time.sleep(0.5)
    assert status and {status["draft_version"]} == served, status
