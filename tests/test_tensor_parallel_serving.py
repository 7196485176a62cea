"""Tensor-parallel engines served end to end: the tiny pair with tensor_parallel_size 2 for both
pools, two target groups and one draft group (six rank actors, each group joined by gloo), over real HTTP
with the official `openai` client. Greedy output equals HF generate on the whole target;
concurrent requests share forwards; `specserve status` shows each group and its ranks (each
holding about half the weights); sampled text follows the whole target's exact distribution; a
killed follower rank takes its group down and the request
completes on the other group, its text unchanged.

The equalities asserted here hold on CPU in float32, where the tests run; on a GPU in bf16 greedy
output may differ at near-ties and with what shares a batch (docs/gpu.md)."""

from __future__ import annotations

import threading
import time

import openai
import pytest
import ray
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specserve.cluster.status import read_engine_stats, summarize
from specserve.common.naming import ENGINE_NAMESPACE, RANK_NAME_PREFIX
from tests.local_server import serve_tiny_pair
from tests.test_serving import stream_killing_midway
from tests.test_serving_statistics import NUM_REQUESTS, TOP_K_CASE, assert_follows_the_target

pytestmark = [pytest.mark.ray, pytest.mark.slow]   # in `make reliability`: docs/testing.md
MODEL = "tiny-pair-tp"
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\nclass Config:\n", "x = [i * i for i in"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    for url, config in serve_tiny_pair(tmp_path_factory.mktemp("tp-pair"), MODEL,
                                       target_workers={"tensor_parallel_size": 2, "num_replicas": 2},
                                       draft_workers={"tensor_parallel_size": 2}):
        yield url, config


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf_greedy(server):
    """greedy(prompt, n): HF generate on the whole (unsharded) target: the oracle."""
    path = server[1].target.path
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)

    def greedy(prompt: str, max_tokens: int) -> str:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
        return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)

    return greedy


def test_greedy_equals_hf_generate(client, hf_greedy):
    for prompt in PROMPTS[:2]:
        done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
        assert done.choices[0].text == hf_greedy(prompt, 40)


def test_concurrent_requests_share_forwards_and_status_shows_each_group(server, client, hf_greedy):
    results: dict[int, str] = {}

    def one(i: int) -> None:
        done = client.completions.create(model=MODEL, prompt=PROMPTS[i % 3], max_tokens=48, temperature=0)
        results[i] = done.choices[0].text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(results[i] == hf_greedy(PROMPTS[i % 3], 48) for i in range(6))
    summary = summarize(read_engine_stats(), None, {"target": 2, "draft": 1})
    target = summary["pools"]["target"]
    assert target["mean_batch_size"] > 1.0   # six requests on two groups: rows shared a forward
    assert len(target["engines"]) == 2
    whole = sum(p.numel() * p.element_size() for p in AutoModelForCausalLM.from_pretrained(
        server[1].target.path, local_files_only=True, dtype=torch.float32).parameters())
    for engine in target["engines"]:
        ranks = engine["ranks"]
        assert [rank["rank"] for rank in ranks] == [0, 1]
        assert len({rank["node_id"] for rank in ranks}) == 1   # STRICT_PACK: one node
        for rank in ranks:
            assert rank["error"] is None and rank["kv_tokens"] > 0 and rank["private_rss_bytes"] > 0
            assert 0.4 * whole < rank["weight_bytes"] < 0.6 * whole
    assert len(summary["pools"]["draft"]["engines"][0]["ranks"]) == 2   # the draft is split too


def test_sampled_text_follows_the_targets_distribution(server):
    """tests/test_serving_statistics.py's test at its top-k case: 200 seeded 3-token completions
    against the whole target's exact text distribution, drafted by the split draft and verified by
    the split target, and the target at half the temperature rejected by the same test; a verifier
    accepting every draft token would fail it."""
    config = server[1]
    target = (AutoModelForCausalLM.from_pretrained(config.target.path, local_files_only=True, dtype=torch.float32).eval(),
              AutoTokenizer.from_pretrained(config.target.path))
    draft = AutoModelForCausalLM.from_pretrained(config.draft.path, local_files_only=True, dtype=torch.float32).eval()
    prompt, sampling = TOP_K_CASE
    assert_follows_the_target(server[0], MODEL, target, sampling, range(NUM_REQUESTS), prompt, draft)


def _engine_holding_a_sequence() -> str:
    """The replica id of the target engine that holds a sequence now."""
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == ENGINE_NAMESPACE and entry["name"].startswith("engine:target:"):
            engine = ray.get_actor(entry["name"], namespace=ENGINE_NAMESPACE)
            if ray.get(engine.active_sequences.remote()):
                return entry["name"].split(":")[2]
    raise LookupError("no target engine holds a sequence")


def test_a_killed_rank_fails_its_group_over_and_the_request_completes(server, hf_greedy):
    def kill_a_follower_of_the_serving_group() -> None:
        replica = _engine_holding_a_sequence()
        ray.kill(ray.get_actor(f"{RANK_NAME_PREFIX}:target:{replica}:1", namespace=ENGINE_NAMESPACE))

    result = stream_killing_midway(server[0], PROMPTS[1], 120, kill_a_follower_of_the_serving_group,
                                   after_chunks=2, model=MODEL)
    text, final = result["text"], result["final"]
    assert text == hf_greedy(PROMPTS[1], 120)
    assert final["speculation"]["target_failovers"] >= 1
    # Serve replaces the broken group: two healthy groups again, each of two ranks.
    deadline = time.monotonic() + 120
    while True:
        engines = [e for e in read_engine_stats() if e.pool == "target"]
        ranks_ok = [len(getattr(e, "ranks", ())) == 2 and all(r.error is None for r in e.ranks) for e in engines]
        if len(engines) == 2 and all(ranks_ok):
            break
        assert time.monotonic() < deadline, engines
        time.sleep(1)
