"""End to end on a real local Ray cluster, over real HTTP, with the official `openai` client.

One Serve application (ingress -> router -> draft/target workers) on a tiny random pair is shared
by the tests in this module (and the other modules using `tiny_pair_server`); each test checks that
no per-request state is left behind.

The equalities asserted here hold on CPU in float32, where the tests run; on a GPU in bf16 greedy
output may differ at near-ties and with what shares a batch (docs/gpu.md).
"""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import openai
import psutil
import pytest
import ray
import torch
from ray import serve
from transformers import AutoTokenizer

from specserve.cluster.builder import APP_NAME
from specserve.decoding.generate import generate
from specserve.decoding.batched_runner import BatchedModelRunner
from specserve.decoding.scheduler import Scheduler
from specserve.decoding.sampling import SamplingParams
from specserve.decoding.sequence import RequestState
from tests.local_server import SHARED_MODEL, greedy_reference, wait_until_a_lone_greedy_request_drafts

pytestmark = pytest.mark.ray
MODEL = SHARED_MODEL
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\nclass Config:\n", "x = [i * i for i in"]


@pytest.fixture(scope="module")
def server(tiny_pair_server):
    """The shared served tiny pair (tests/conftest.py); the engine-killing tests at the end of this
    module leave it with replaced, healthy engines, as they assert."""
    return tiny_pair_server


@pytest.fixture(scope="module")
def client(server):
    url, _ = server
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(server):
    """In-process target-only greedy output: the oracle the HTTP path must equal."""
    return greedy_reference(server[1].target.path)


def _leftover_state() -> dict[str, list]:
    """Sequences still held anywhere: router requests and each worker engine's caches. An engine
    that was killed and not yet replaced reads "dead" (its state died with it); callers poll."""
    leftovers = {"router": serve.get_deployment_handle("Router", APP_NAME).num_active_requests.remote().result()}
    for name in ("TargetWorker", "DraftWorker"):
        engine = serve.get_deployment_handle(name, APP_NAME).get_engine.remote().result()
        try:
            leftovers[name] = ray.get(engine.actor.active_sequences.remote())
        except ray.exceptions.RayActorError:
            leftovers[name] = "dead"
    return leftovers


def _assert_no_leftovers(timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        leftovers = _leftover_state()
        if leftovers == {"router": 0, "TargetWorker": [], "DraftWorker": []}:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"per-request state leaked: {leftovers}")
        time.sleep(0.1)


def _scrape() -> dict[tuple[str, tuple], float]:
    """The node's Prometheus endpoint, parsed by prometheus_client's own parser: {(name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    from specserve.cluster.local import metrics_url

    samples = {}
    for family in text_string_to_metric_families(httpx.get(metrics_url(), timeout=10).text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def _total(samples: dict, name: str, **labels: str) -> float:
    return sum(value for (sample_name, sample_labels), value in samples.items()
               if sample_name == name and all((k, v) in sample_labels for k, v in labels.items()))


def _settled_scrape(names: list[str], report_interval_s: float, timeout_s: float = 30.0) -> dict:
    """A scrape once earlier requests' counts have all been exported: the totals of `names` read the
    same over three report intervals (the server is shared, and the module before this one may
    have sent requests whose counts are still on their way)."""
    deadline = time.monotonic() + timeout_s
    samples = _scrape()
    while True:
        time.sleep(3 * report_interval_s)
        again = _scrape()
        if all(_total(again, name) == _total(samples, name) for name in names):
            return again
        if time.monotonic() > deadline:
            raise AssertionError("the counters kept moving with no request running")
        samples = again


def test_metrics_counters_agree_with_the_responses_and_engines_export_both_pools(server, client):
    """Counter deltas over a few requests equal the sums of those responses' speculation fields
    exactly; every engine metric is there for the draft and the target pool."""
    fields = {"ray_specserve_draft_tokens_total": "num_drafted", "ray_specserve_accepted_tokens_total": "num_accepted",
              "ray_specserve_output_tokens_total": "num_emitted", "ray_specserve_target_passes_total": "target_passes"}
    _assert_no_leftovers()
    before = _settled_scrape([*fields, "ray_specserve_wasted_draft_tokens_total"],
                             server[1].observability.metrics_report_interval_ms / 1000)
    responses = [client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=t, seed=3)
                 for p in PROMPTS for t in (0, 0.8)]
    expected = {name: sum(r.model_extra["speculation"][field] for r in responses) for name, field in fields.items()}
    expected_rejected = expected["ray_specserve_draft_tokens_total"] - expected["ray_specserve_accepted_tokens_total"]
    deadline = time.monotonic() + 30
    while True:
        after = _scrape()
        deltas = {name: _total(after, name) - _total(before, name) for name in fields}
        rejected = (_total(after, "ray_specserve_wasted_draft_tokens_total", reason="rejected")
                    - _total(before, "ray_specserve_wasted_draft_tokens_total", reason="rejected"))
        if (deltas == expected and rejected == expected_rejected) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert deltas == expected
    assert rejected == expected_rejected
    assert expected["ray_specserve_draft_tokens_total"] > 0
    for metric in ("ray_specserve_engine_batch_size_count", "ray_specserve_engine_queue_depth",
                   "ray_specserve_engine_busy_seconds_total", "ray_specserve_engine_idle_seconds_total",
                   "ray_specserve_kv_sequences", "ray_specserve_prefix_cache_queries_total"):
        pools = {dict(labels).get("pool") for name, labels in after if name == metric}
        assert {"draft", "target"} <= pools, (metric, pools)


def test_health_and_models(server, client):
    url, _ = server
    assert httpx.get(f"{url}/health").json() == {"status": "ok", "pools": {"target": "ok", "draft": "ok"}}
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_http_comes_through_haproxy_not_serves_python_proxy(server):
    """The data plane a local start switches on (cluster/serve_data_plane.py): HAProxy holds the
    HTTP port; Serve's Python proxy runs only as HAProxy's fallback, on another port."""
    from specserve.cluster.serve_data_plane import haproxy_found

    if not haproxy_found():
        pytest.skip("no HAProxy binary: Serve's proxy stays")
    holders = {connection.pid for connection in psutil.net_connections("tcp")
               if connection.status == psutil.CONN_LISTEN and connection.laddr.port == server[1].http.port}
    assert {psutil.Process(pid).name() for pid in holders} == {"haproxy"}


def test_a_routers_channels_on_one_host_take_the_local_socket(server, client):
    """Every process here shares one host, so the router reaches its engines and the ingress over
    their local sockets, none over TCP (common/channel.py; tests/test_channel.py covers the TCP way
    a peer on another host takes)."""
    from specserve.common.channel import LOCAL_SOCKETS

    if not LOCAL_SOCKETS:
        pytest.skip("abstract Unix sockets are Linux's: every channel is TCP")
    client.completions.create(model=MODEL, prompt="Channels", max_tokens=8, temperature=0.0)
    channels = serve.get_deployment_handle("Router", APP_NAME).status.remote().result()["channels"]
    assert channels.get("local", 0) >= 2 and "tcp" not in channels, channels


def test_engine_processes_start_with_the_engines_malloc_settings(server):
    """glibc reads them once, at a process's start (decoding/host_memory.py): a local cluster starts
    every process with them, the engines' actors included, not given them later."""
    from specserve.decoding.host_memory import ENGINE_ENV

    for pool in ("TargetWorker", "DraftWorker"):
        engine = serve.get_deployment_handle(pool, APP_NAME).get_engine.remote().result()
        pid = ray.get(engine.actor.__ray_call__.remote(lambda actor: os.getpid()))
        started_with = psutil.Process(pid).environ()
        assert {name: started_with.get(name) for name in ENGINE_ENV} == ENGINE_ENV, pool


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completion_equals_target_only_greedy(client, reference, prompt):
    wait_until_a_lone_greedy_request_drafts()
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0)
    assert response.choices[0].text == reference(prompt, 48)
    assert response.usage.completion_tokens == 48
    speculation = response.model_extra["speculation"]
    assert speculation["num_drafted"] > 0
    assert 0.0 <= speculation["acceptance_rate"] <= 1.0
    # This pair agrees with its target on these prompts, so blocks pre-drafted during verification
    # (the speculation cache, on by default) get used; the first round never has one.
    assert 0 < speculation["pipelined_rounds"] < speculation["rounds"], speculation
    assert speculation["pipelined_rounds"] + speculation["speculation_cache_misses"] <= speculation["rounds"] - 1, \
        speculation
    _assert_no_leftovers()


def test_a_repeated_prompt_reports_its_cached_tokens_and_the_same_greedy_text(client, reference):
    """Prefix caching (on by default): the second time a prompt comes, the target finds its full
    blocks (16 tokens each, all but the one holding the last prompt token) and usage says so, as
    OpenAI's prompt_tokens_details.cached_tokens; the text is the target-only greedy text."""
    prompt = "# a shared system prompt\n" + "".join(PROMPTS) * 3
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    prompt_tokens = first.usage.prompt_tokens
    assert prompt_tokens > 32 and first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // 16 * 16
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // 16 * 16
    assert first.choices[0].text == again.choices[0].text == reference(prompt, 24)
    assert "".join(chunk.choices[0].text for chunk in streamed[:-1]) == first.choices[0].text
    _assert_no_leftovers()


def test_a_cache_salt_finds_only_its_own_tenants_cached_blocks(client, reference):
    """vLLM's cache_salt: a prompt another tenant (or an unsalted request) has cached is computed
    afresh under a new salt, found by the same salt, and the text is the same greedy text."""
    prompt = "# tenant isolation\n" + "".join(PROMPTS) * 3
    salted = {"cache_salt": "tenant-a"}
    wait_until_a_lone_greedy_request_drafts()
    unsalted = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, extra_body=salted)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, extra_body=salted)
    other = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                      extra_body={"cache_salt": "tenant-b"})
    full_blocks = (unsalted.usage.prompt_tokens - 1) // 16 * 16
    assert full_blocks >= 32
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == full_blocks
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert unsalted.choices[0].text == first.choices[0].text == again.choices[0].text == other.choices[0].text \
        == reference(prompt, 16)
    assert first.model_extra["speculation"]["num_drafted"] > 0
    _assert_no_leftovers()


def test_streamed_completion_equals_non_streamed(client):
    prompt = PROMPTS[0]
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 40
    assert chunks[-1].model_extra["speculation"]["num_emitted"] == 40
    _assert_no_leftovers()


def test_chat_completion_and_chat_stream(client):
    messages = [{"role": "user", "content": "write a loop"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                            stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
    assert text == whole.choices[0].message.content
    _assert_no_leftovers()


def test_seeded_sampling_is_reproducible(client):
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=32, temperature=0.8,
                                         seed=seed).choices[0].text

    first, again, other = sample(7), sample(7), sample(8)
    assert first == again
    assert first != other
    _assert_no_leftovers()


def test_stop_string_ends_the_completion(client, reference):
    full = reference(PROMPTS[0], 48)
    stop = full[10:13]
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=48, temperature=0,
                                         stop=[stop])
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].text == full[: full.index(stop)]
    _assert_no_leftovers()


def test_concurrent_streams_do_not_mix(client, reference):
    results: dict[str, str] = {}

    def stream(prompt: str) -> None:
        chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True)
        results[prompt] = "".join(c.choices[0].text for c in chunks)

    threads = [threading.Thread(target=stream, args=(p,)) for p in PROMPTS[:2]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert results == {p: reference(p, 40) for p in PROMPTS[:2]}
    _assert_no_leftovers()


NEAR_TIE_LOGIT_GAP = 0.05  # batched and unbatched matmuls may order top-2 logits closer than this differently


@pytest.fixture(scope="module")
def hf_greedy(server):
    """Hugging Face `generate` (greedy) on the target: the oracle for concurrent batched streams.
    Returns (text, token ids, the model) for a prompt."""
    from transformers import AutoModelForCausalLM

    _, config = server
    model = AutoModelForCausalLM.from_pretrained(config.target.path).eval()
    tokenizer = AutoTokenizer.from_pretrained(config.target.path)

    def run(prompt: str, max_tokens: int) -> tuple[str, list[int]]:
        input_ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
        with torch.no_grad():
            output = model.generate(input_ids, max_new_tokens=max_tokens, do_sample=False,
                                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        ids = output[0, input_ids.shape[1]:].tolist()
        if tokenizer.eos_token_id in ids:
            ids = ids[:ids.index(tokenizer.eos_token_id)]
        return tokenizer.decode(ids, skip_special_tokens=True), ids

    return run, model, tokenizer


def _first_divergence_is_a_near_tie(prompt: str, served: str, oracle_ids: list[int], model, tokenizer) -> bool:
    """The served text left the oracle's at some token; True iff the oracle's top-2 logits there
    are within NEAR_TIE_LOGIT_GAP (a legitimate flip under batched arithmetic), False otherwise."""
    for position in range(len(oracle_ids)):
        text = tokenizer.decode(oracle_ids[:position + 1], skip_special_tokens=True)
        if not served.startswith(text):
            break
    else:
        return False
    prefix = tokenizer.encode(prompt, add_special_tokens=False) + oracle_ids[:position]
    with torch.no_grad():
        logits = model(torch.tensor([prefix])).logits[0, -1]
    top2 = torch.topk(logits, 2).values
    return float(top2[0] - top2[1]) < NEAR_TIE_LOGIT_GAP


def test_eight_concurrent_greedy_streams_equal_hf_generate(client, hf_greedy):
    """Eight streams share the engines' batched forwards; each text equals Hugging Face greedy
    `generate`, except where the first differing token was a near-tie for the oracle itself."""
    run, model, tokenizer = hf_greedy
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(8)]
    results: dict[int, str] = {}

    def stream(i: int) -> None:
        chunks = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=48, temperature=0, stream=True)
        results[i] = "".join(c.choices[0].text for c in chunks)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    mismatches = []
    for i, prompt in enumerate(prompts):
        expected, ids = run(prompt, 48)
        if results[i] != expected and not _first_divergence_is_a_near_tie(prompt, results[i], ids, model, tokenizer):
            mismatches.append((prompt, results[i], expected))
    assert not mismatches
    _assert_no_leftovers()


def test_near_tie_check_flags_a_real_mismatch(hf_greedy):
    """The escape hatch above cannot hide a real error: a corrupted continuation is not a near-tie."""
    run, model, tokenizer = hf_greedy
    expected, ids = run(PROMPTS[0], 24)
    corrupted = tokenizer.decode(ids[:3] + [(ids[3] + 1) % len(tokenizer)] + ids[4:], skip_special_tokens=True)
    assert corrupted != expected
    assert not _first_divergence_is_a_near_tie(PROMPTS[0], corrupted, ids, model, tokenizer)


def test_a_seeded_sampled_request_gives_the_same_text_whatever_shares_its_batch(client):
    def seeded() -> str:
        return client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=32, temperature=0.9,
                                         top_p=0.95, seed=1234).choices[0].text

    alone = seeded()
    results: dict[str, str] = {}

    def other(i: int) -> None:
        client.completions.create(model=MODEL, prompt=PROMPTS[i % 3], max_tokens=40, temperature=0.7 * (i % 2))

    def target() -> None:
        results["seeded"] = seeded()

    threads = [threading.Thread(target=other, args=(i,)) for i in range(6)] + [threading.Thread(target=target)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert results["seeded"] == alone
    _assert_no_leftovers()


def test_logprobs_are_the_targets_raw_log_probabilities(server, client):
    """Completions `logprobs=3`: each token's log-probability under the target's raw distribution
    (what verification already computed), and its 3 most likely alternatives; chat and streaming
    carry the same numbers in their own shapes."""
    _, config = server
    engine = Scheduler(BatchedModelRunner(config.target.path))
    tokenizer = AutoTokenizer.from_pretrained(config.target.path)
    prompt_ids = tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    state = RequestState(request_id="lp", prompt_ids=prompt_ids, params=SamplingParams(temperature=0, max_tokens=16),
                         eos_token_id=tokenizer.eos_token_id, max_context=engine.max_context)
    for _ in generate(engine, state):
        pass
    output_ids = state.output_ids
    # Row i of a forward over prompt + output[:-1] is the distribution output[i] was drawn from.
    reference = torch.log_softmax(engine.forward("lp-ref", prompt_ids + output_ids[:-1], len(output_ids)), dim=-1)

    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, logprobs=3)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.token_logprobs) == len(output_ids) == 16
    for i, token in enumerate(output_ids):
        # Same model, other kernels (the slot path batches): float32 agreement, not bit equality.
        assert logprobs.token_logprobs[i] == pytest.approx(float(reference[i, token]), abs=1e-3)
        alternatives = logprobs.top_logprobs[i]
        assert len(alternatives) == 3
        assert max(alternatives.values()) == pytest.approx(logprobs.token_logprobs[i], abs=1e-6)  # greedy: the top
    assert "".join(logprobs.tokens) == response.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(16)]

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 8 and all(len(item.top_logprobs) == 2 for item in content)
    assert all(item.logprob <= 0 for item in content)

    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, logprobs=3,
                                         stream=True)
    values = [lp for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
              for lp in chunk.choices[0].logprobs.token_logprobs]
    assert values == pytest.approx(logprobs.token_logprobs, abs=1e-6)
    # Sampled: every token committed (accepted draft, recovered or bonus draw) has its entry, the
    # target's raw log-probability at its position.
    sampled = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=1.0, seed=3,
                                        logprobs=2, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    sampled_ids = [int(token.removeprefix("token_id:")) for token in sampled.logprobs.tokens]
    raw = torch.log_softmax(engine.forward("lp-sampled", prompt_ids + sampled_ids[:-1], len(sampled_ids)), dim=-1)
    assert len(sampled_ids) == 16
    assert sampled.logprobs.token_logprobs == pytest.approx(
        [float(raw[i, token]) for i, token in enumerate(sampled_ids)], abs=1e-3)
    _assert_no_leftovers()


BAD_BODIES = [
    ({"model": "no-such-model", "prompt": "x"}, "model"),
    ({"model": MODEL, "prompt": 42}, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10_000_000}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": -0.5}, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": MODEL, "prompt": "x", "top_p": 1.5}, "top_p"),
    ({"model": MODEL, "prompt": "x", "n": 17}, "n"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": "word " * 400}, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 200, "stop": ""}, "stop"),
    ({"prompt": "x"}, "model"),
]


@pytest.mark.parametrize("body,param", BAD_BODIES, ids=[p for _, p in BAD_BODIES])
def test_bad_completion_requests_get_openai_style_400(server, body, param):
    url, _ = server
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert param in (error["param"] or "") or param in error["message"]
    _assert_no_leftovers()


def test_bad_chat_request_gets_400(server):
    url, _ = server
    response = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": []}, timeout=30)
    assert response.status_code == 400
    assert "messages" in response.json()["error"]["message"]


def test_invalid_json_gets_400(server):
    url, _ = server
    response = httpx.post(f"{url}/v1/completions", content=b"{not json", timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "error" in response.json()


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", temperature=-1)


def test_client_disconnect_releases_worker_state(server):
    url, _ = server
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # walk away after the first chunk
    _assert_no_leftovers(timeout_s=20)


def stream_killing_midway(url: str, prompt: str, max_tokens: int, kill, after_chunks: int = 1,
                          model: str = MODEL) -> dict:
    """Stream a greedy completion and call kill() once after_chunks chunks are out; return the
    text and the final chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text, final, chunks = "", {}, 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=180) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            chunks += 1
            if chunks == after_chunks:
                kill()
            text += chunk["choices"][0]["text"]
            final = chunk
    return {"text": text, "final": final}


def _stream_killing_engine_midway(url: str, prompt: str, max_tokens: int, pool: str) -> dict:
    """stream_killing_midway, killing pool's engine after the first chunk."""
    engine = serve.get_deployment_handle(pool, APP_NAME).get_engine.remote().result()
    return stream_killing_midway(url, prompt, max_tokens, lambda: ray.kill(engine.actor))


def test_draft_engine_lost_mid_stream_the_request_continues_target_only(server, reference):
    """Runs late in this module: it kills the draft engine mid-request; Serve then replaces it."""
    url, _ = server
    result = _stream_killing_engine_midway(url, PROMPTS[2], 120, "DraftWorker")
    assert result["text"] == reference(PROMPTS[2], 120)
    speculation = result["final"]["speculation"]
    assert speculation["draft_failures"] == 1
    assert speculation["num_emitted"] == 120
    _assert_no_leftovers(timeout_s=60)  # the replacement draft replica holds nothing either


def test_target_engine_lost_mid_stream_is_replaced_and_the_request_completes(server, reference):
    """A killed target engine fails its replica's health check; Serve replaces the replica and
    the router re-prefills the new engine from the committed history: same greedy text, and no
    state left on any engine."""
    url, _ = server
    result = _stream_killing_engine_midway(url, PROMPTS[1], 120, "TargetWorker")
    assert result["text"] == reference(PROMPTS[1], 120)
    assert result["final"]["speculation"]["target_failovers"] >= 1
    _assert_no_leftovers(timeout_s=60)
