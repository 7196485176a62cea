"""Conformance on the checkpoint look-alikes, served: one Ray cluster, one Serve app per family
(Llama-3 pair, Qwen2.5 padded pair, Mistral target-only, and the any-decoder pairs: Qwen3, Qwen3-MoE
+ Qwen3, Gemma 3 and Phi-3 with sliding windows shorter than the prompts), each configured from the
launch flags, over real HTTP with the official `openai` client. For each: greedy equals Hugging Face
`generate` with the folder's generation config (greedy forced; near-ties told apart), chat prompts
are the tokenizer's apply_chat_template ids, and requests stop on the EOS list and on
stop_token_ids; the any-decoder pairs batch concurrent requests into one forward, each answered as
it would be alone.

The equalities asserted here hold on CPU in float32, where the tests run; on a GPU in bf16 greedy
output may differ at near-ties and with what shares a batch (docs/gpu.md)."""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from ray import serve
from ray.serve.api import RunTarget
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from specserve.cluster.builder import build_app
from specserve.cluster.cli import add_model_args, config_from_args
from specserve.cluster.local import RAY_SYSTEM_CONFIG, init_local_ray, wait_healthy
from specserve.cluster.status import read_engine_stats
from tests.checkpoint_fixtures import DECODER_BUILDERS, EOS_AFTER, EOS_PROMPT, FIXTURE_WINDOW
from tests.local_server import free_port, stop_test_cluster

pytestmark = pytest.mark.ray
PROMPTS = ["import numpy as np\n", "class Stack:\n    def push(self, x):"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a loop."}]
MAX_TOKENS = 12
# Longer than every fixture's sliding window (FIXTURE_WINDOW tokens): windowed layers must drop keys.
LONG_PROMPT = ("def merge_sorted(left, right):\n    result = []\n    i = j = 0\n    while i < len(left) and "
               "j < len(right):\n        if left[i] <= right[j]:\n")
DECODERS = list(DECODER_BUILDERS)
# make test serves these; the decoder families' apps run in make reliability (marker slow),
# to keep make test under its 10 minutes: their engine path is tested in process on every run
# (tests/test_batched_runner.py, tests/test_decoder_statistics.py).
CI_FAMILIES = ("llama3",)


def families(*names: str) -> list:
    return [pytest.param(name, marks=() if name in CI_FAMILIES else pytest.mark.slow) for name in names]
NEAR_TIE_LOGIT_GAP = 1e-3


def family_config(family, port: int):
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    add_model_args(parser)
    argv = ["--target", str(family.target)] + (["--draft", str(family.draft)] if family.draft else [])
    config = config_from_args(parser.parse_args(argv))
    light = {"num_cpus": 0.5}
    return config.model_validate({**config.model_dump(mode="json"), "model_name": family.name,
                                  "http": {"port": port}, "target_workers": light, "draft_workers": light,
                                  "observability": {"metrics_export_port": 0}})


def selected_families(request, checkpoint_families) -> dict:
    """The families this run's selected tests of this module use (a marker expression may leave
    some out), so no app starts that no test asks for."""
    wanted = {"llama3"}   # test_stop_token_ids_end_a_request_and_can_stay_in_the_output
    wanted |= {item.callspec.params["name"] for item in request.session.items
               if item.module is request.module and "name" in getattr(getattr(item, "callspec", None), "params", {})}
    return {name: family for name, family in checkpoint_families.items() if name in wanted}


@pytest.fixture(scope="module")
def served(request, checkpoint_families):
    """{family name: (openai client, family)}: one app per family the selected tests use, on one cluster."""
    checkpoint_families = selected_families(request, checkpoint_families)
    port = free_port()
    # Seven apps of four replicas each: logical CPUs, not cores (the replicas idle between requests).
    init_local_ray(num_cpus=32, include_dashboard=False, _system_config=RAY_SYSTEM_CONFIG)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run_many([RunTarget(build_app(family_config(family, port)), name=name, route_prefix=f"/{name}")
                        for name, family in checkpoint_families.items()])   # deployed together
        clients = {}
        for name, family in checkpoint_families.items():
            base = f"http://127.0.0.1:{port}/{name}"
            wait_healthy(base, 120)
            clients[name] = (openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120),
                             family)
        yield clients
    finally:
        stop_test_cluster()


class Oracle:
    """Hugging Face `generate` on the target folder with its own generation config, greedy forced;
    ids past the tokenizer (padding rows) are suppressed, as the server never samples them."""

    def __init__(self, family) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(family.target)
        self.model = AutoModelForCausalLM.from_pretrained(family.target, dtype=torch.float32).eval()
        self.config = GenerationConfig.from_pretrained(family.target)
        width = self.model.get_output_embeddings().weight.shape[0]
        self.padding = list(range(len(self.tokenizer), width))

    def greedy(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        eos = self.config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        with torch.no_grad():
            out = self.model.generate(torch.tensor([prompt_ids]), generation_config=self.config, do_sample=False,
                                      temperature=None, top_p=None, top_k=None, max_new_tokens=max_tokens,
                                      suppress_tokens=self.padding or None, pad_token_id=min(eos))
        ids = out[0, len(prompt_ids):].tolist()
        return ids[:-1] if ids and ids[-1] in eos else ids

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def near_tie_at_divergence(self, prompt_ids: list[int], ids: list[int], served: str) -> bool:
        """The served text left the oracle's: True iff the oracle's top-2 logits at the first
        token whose text the served one lacks are within NEAR_TIE_LOGIT_GAP."""
        position = next((i for i in range(len(ids)) if not served.startswith(self.text(ids[:i + 1]))), None)
        if position is None:
            return False
        with torch.no_grad():
            logits = self.model(torch.tensor([prompt_ids + ids[:position]])).logits[0, -1, :len(self.tokenizer)]
        top2 = torch.topk(logits, 2).values
        return float(top2[0] - top2[1]) < NEAR_TIE_LOGIT_GAP


@pytest.fixture(scope="module")
def oracles(request, checkpoint_families):
    return {name: Oracle(family) for name, family in selected_families(request, checkpoint_families).items()}


def assert_equal_or_near_tie(oracle: Oracle, prompt_ids: list[int], ids: list[int], served: str) -> None:
    assert served == oracle.text(ids) or oracle.near_tie_at_divergence(prompt_ids, ids, served), (served, ids)


@pytest.mark.parametrize("name", families("llama3", "qwen25", "mistral", *DECODERS))
def test_greedy_completions_equal_hf_generate(served, oracles, name):
    client, family = served[name]
    oracle = oracles[name]
    assert len(oracle.tokenizer.encode(LONG_PROMPT)) > FIXTURE_WINDOW
    for prompt in PROMPTS + [LONG_PROMPT]:
        prompt_ids = oracle.tokenizer.encode(prompt)      # the tokenizer decides BOS, as the server
        response = client.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert response.usage.prompt_tokens == len(prompt_ids)
        assert_equal_or_near_tie(oracle, prompt_ids, oracle.greedy(prompt_ids, MAX_TOKENS), response.choices[0].text)


@pytest.mark.parametrize("name", families("llama3", "qwen25", "mistral", *DECODERS))
def test_chat_prompt_is_apply_chat_template_and_greedy_equals_hf(served, oracles, name):
    client, family = served[name]
    oracle = oracles[name]
    messages = MESSAGES if name != "mistral" else MESSAGES[1:]
    prompt_ids = list(oracle.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                           return_dict=False))
    response = client.chat.completions.create(model=name, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert_equal_or_near_tie(oracle, prompt_ids, oracle.greedy(prompt_ids, MAX_TOKENS),
                             response.choices[0].message.content)


@pytest.mark.parametrize("name", families(*DECODERS))
def test_concurrent_requests_share_forwards_and_equal_each_alone(served, oracles, name):
    """Four greedy requests at once on an any-decoder pair: the target engine's forwards carried
    more than one row on average (batched), and each answer is HF `generate`'s for its prompt."""
    client, family = served[name]
    oracle = oracles[name]
    prompts = [LONG_PROMPT, PROMPTS[1], LONG_PROMPT + "            result.append(left[i])\n", PROMPTS[0] * 3]

    def target_counters() -> dict[str, tuple[int, int]]:
        return {stats.replica: (stats.forwards, stats.batch_rows_total) for stats in read_engine_stats()
                if getattr(stats, "pool", None) == "target" and hasattr(stats, "forwards")}

    before = target_counters()
    with ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(lambda prompt: client.completions.create(
            model=name, prompt=prompt, max_tokens=24, temperature=0), prompts))
    after = target_counters()
    forwards, rows = max(((after[r][0] - before.get(r, (0, 0))[0], after[r][1] - before.get(r, (0, 0))[1])
                          for r in after), key=lambda delta: delta[0])
    assert forwards > 0 and rows > forwards, (forwards, rows)
    for prompt, response in zip(prompts, responses):
        prompt_ids = oracle.tokenizer.encode(prompt)
        assert_equal_or_near_tie(oracle, prompt_ids, oracle.greedy(prompt_ids, 24), response.choices[0].text)


@pytest.mark.parametrize("name", families("llama3", "qwen25"))
def test_requests_stop_on_the_generation_config_eos_list(served, oracles, name):
    """The fixture's target answers EOS_PROMPT with an EOS id only generation_config.json lists,
    after EOS_AFTER tokens: the request stops there (a server reading the tokenizer's EOS alone
    would run to max_tokens), streamed or not, with a draft speculating past it."""
    client, family = served[name]
    response = client.completions.create(model=name, prompt=EOS_PROMPT, max_tokens=40, temperature=0)
    assert (response.choices[0].finish_reason, response.usage.completion_tokens) == ("stop", EOS_AFTER)
    chunks = list(client.completions.create(model=name, prompt=EOS_PROMPT, max_tokens=40, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == response.choices[0].text
    ignored = client.completions.create(model=name, prompt=EOS_PROMPT, max_tokens=EOS_AFTER + 3, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert ignored.usage.completion_tokens == EOS_AFTER + 3
    masked = client.completions.create(model=name, prompt=EOS_PROMPT, max_tokens=EOS_AFTER + 3, temperature=0,
                                       extra_body={"min_tokens": EOS_AFTER + 2})
    assert masked.usage.completion_tokens > EOS_AFTER     # min_tokens masks the list-only EOS too


def test_stop_token_ids_end_a_request_and_can_stay_in_the_output(served, oracles):
    client, family = served["llama3"]
    oracle = oracles["llama3"]
    prompt_ids = oracle.tokenizer.encode(PROMPTS[1])
    ids = oracle.greedy(prompt_ids, MAX_TOKENS)
    stop_id = ids[3]
    first = ids.index(stop_id)
    response = client.completions.create(model="llama3", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"stop_token_ids": [stop_id]})
    assert (response.choices[0].finish_reason, response.usage.completion_tokens) == ("stop", first)
    kept = client.completions.create(model="llama3", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"stop_token_ids": [stop_id], "include_stop_str_in_output": True})
    assert kept.usage.completion_tokens == first + 1
    assert kept.choices[0].text == oracle.text(ids[:first + 1])
