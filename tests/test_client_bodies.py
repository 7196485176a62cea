"""Real clients' request bodies, replayed byte for byte, and the API features they lean on.

Each body in tests/client_bodies/ (README.md there names the client, version and the code that
builds it) must get a 200 with what that client reads back. Batched and token-id prompts, n > 1
and prompt log-probabilities are checked here too, on one module-scoped served tiny pair; the
prompt log-probabilities against Hugging Face's own forward of the target.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.local_server import SHARED_MODEL

pytestmark = pytest.mark.ray
MODEL = SHARED_MODEL
BODIES = Path(__file__).parent / "client_bodies"


@pytest.fixture(scope="module")
def server(tiny_pair_server):
    return tiny_pair_server


@pytest.fixture(scope="module")
def target(server):
    _, config = server
    return AutoModelForCausalLM.from_pretrained(config.target.path, dtype=torch.float32).eval()


def replay(url: str, name: str) -> httpx.Response:
    """POST the recorded body's bytes, unchanged, to the route it was recorded for."""
    content = (BODIES / name).read_bytes()
    route = "chat/completions" if b'"messages"' in content else "completions"
    response = httpx.post(f"{url}/v1/{route}", content=content, headers={"content-type": "application/json"},
                          timeout=60)
    assert response.status_code == 200, response.text
    return response


def events(response: httpx.Response) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def hf_prompt_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """log p(token i | tokens before it) from HF's forward over the whole prompt, i = 1..L-1."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    rows = torch.log_softmax(logits, dim=-1)
    return rows[torch.arange(len(token_ids) - 1), torch.tensor(token_ids[1:])]


@pytest.mark.parametrize("name, text_of", [
    ("guidellm_completions_stream.json", lambda choice: choice["text"]),
    ("guidellm_chat_stream.json", lambda choice: choice["delta"].get("content", "")),
])
def test_guidellm_streams_get_usage_on_every_chunk_and_at_the_end(server, name, text_of):
    url, _ = server
    chunks = events(replay(url, name))
    with_choices = [chunk for chunk in chunks if chunk["choices"]]
    # continuous_usage_stats: every chunk with a choice carries the usage so far, never decreasing
    generated = [chunk["usage"]["completion_tokens"] for chunk in with_choices]
    assert all(chunk["usage"]["prompt_tokens"] > 0 for chunk in with_choices)
    assert generated == sorted(generated) and generated[-1] == 16
    # include_usage: the last chunk has no choices and the totals, which guidellm reads
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 16  # ignore_eos
    assert "".join(text_of(chunk["choices"][0]) for chunk in with_choices)


def test_lm_eval_loglikelihood_body_gets_the_target_prompt_logprobs(server, target):
    url, _ = server
    body = json.loads((BODIES / "lmeval_completions_loglikelihood.json").read_text())
    answer = replay(url, "lmeval_completions_loglikelihood.json").json()
    choices = sorted(answer["choices"], key=lambda choice: choice["index"])
    assert [choice["index"] for choice in choices] == [0, 1]
    for prompt, choice in zip(body["prompt"], choices):
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(prompt) + 1  # echo: the prompt, then the generated token
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        expected = hf_prompt_logprobs(target, prompt)
        assert torch.tensor(logprobs["token_logprobs"][1:len(prompt)]) == pytest.approx(expected, abs=1e-4)
        # what lm-eval's parse_logprobs computes: a sum, and greedy = each token is its row's best
        ctxlen = 8
        continuation = logprobs["token_logprobs"][ctxlen:-1]
        assert sum(continuation) == pytest.approx(float(expected[ctxlen - 1:].sum()), abs=1e-3)
        for token_logprob, top in zip(continuation, logprobs["top_logprobs"][ctxlen:-1]):
            assert len(top) == 1 and max(top.values()) >= token_logprob - 1e-6
    assert answer["usage"]["prompt_tokens"] == sum(len(prompt) for prompt in body["prompt"])
    assert answer["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("name", ["lmeval_completions_generate.json", "lmeval_chat_generate.json",
                                  "langchain_chatopenai.json"])
def test_generation_bodies_get_their_text(server, name):
    url, _ = server
    answer = replay(url, name).json()
    choice = answer["choices"][0]
    assert choice["index"] == 0 and choice["finish_reason"] in ("stop", "length")
    assert isinstance(choice["text"] if "text" in choice else choice["message"]["content"], str)
    assert answer["usage"]["total_tokens"] == answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]


@pytest.mark.parametrize("name", ["langchain_chatopenai_stream.json", "openai_completions_stream_usage.json",
                                  "openai_chat_stream_usage.json"])
def test_streams_with_include_usage_end_with_the_usage(server, name):
    url, _ = server
    chunks = events(replay(url, name))
    assert all(chunk["usage"] is None for chunk in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


def test_the_openai_client_still_sends_the_recorded_bodies():
    sent = []
    transport = httpx.MockTransport(lambda request: sent.append(request.content) or httpx.Response(500))
    client = openai.OpenAI(base_url="http://recorder/v1", api_key="k", max_retries=0,
                           http_client=httpx.Client(transport=transport))
    with pytest.raises(openai.APIStatusError):
        client.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=8, stream=True,
                                  stream_options={"include_usage": True})
    with pytest.raises(openai.APIStatusError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Write a haiku."}],
                                       max_tokens=8, stream=True, stream_options={"include_usage": True})
    assert sent[0] + b"\n" == (BODIES / "openai_completions_stream_usage.json").read_bytes()
    assert sent[1] + b"\n" == (BODIES / "openai_chat_stream_usage.json").read_bytes()


def test_a_batch_of_prompts_and_n_choices_are_indexed_as_vllm(server):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    prompts = ["def add(a, b):", "import os\n"]
    batch = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=8, temperature=0)
    assert [choice.index for choice in batch.choices] == [0, 1, 2, 3]
    singles = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0) for prompt in prompts]
    for i, single in enumerate(singles):  # greedy: prompt i's n choices all equal its single answer
        assert [batch.choices[i * 2 + j].text for j in range(2)] == [single.choices[0].text] * 2
    assert batch.usage.prompt_tokens == sum(single.usage.prompt_tokens for single in singles)
    assert batch.usage.completion_tokens == 2 * sum(single.usage.completion_tokens for single in singles)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=6, temperature=0)
    assert [choice.index for choice in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content


def test_token_id_prompts_answer_as_their_text(server):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    text = client.completions.create(model=MODEL, prompt="def add(a, b):\n", max_tokens=8, temperature=0,
                                     logprobs=0)
    prompt_ids = json.loads((BODIES / "lmeval_completions_loglikelihood.json").read_text())["prompt"][0][:8]
    ids = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=8, temperature=0)
    nested = client.completions.create(model=MODEL, prompt=[prompt_ids], max_tokens=8, temperature=0)
    assert ids.usage.prompt_tokens == text.usage.prompt_tokens == len(prompt_ids)
    assert ids.choices[0].text == nested.choices[0].text == text.choices[0].text


def test_seeded_choices_use_seed_plus_their_index(server):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    several = client.completions.create(model=MODEL, prompt="def f(x):", n=3, max_tokens=12, temperature=1.0,
                                        seed=7)
    alone = [client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=12, temperature=1.0,
                                       seed=7 + j).choices[0].text for j in range(3)]
    assert [choice.text for choice in several.choices] == alone
    assert len(set(alone)) > 1  # the choices are not copies of one another


def test_a_stream_of_several_choices_carries_each_choice_index(server):
    url, _ = server
    body = {"model": MODEL, "prompt": ["def add(a, b):", "import os\n"], "n": 2, "max_tokens": 8, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = events(httpx.post(f"{url}/v1/completions", json=body, timeout=60))
    texts: dict[int, str] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    whole = httpx.post(f"{url}/v1/completions", json={**body, "stream": False, "stream_options": None},
                       timeout=60).json()
    assert texts == {choice["index"]: choice["text"] for choice in whole["choices"]}
    assert chunks[-1]["usage"] == whole["usage"]


def test_echo_with_zero_max_tokens_returns_the_prompt_and_its_logprobs(server, target):
    url, _ = server
    prompt_ids = json.loads((BODIES / "lmeval_completions_loglikelihood.json").read_text())["prompt"][1]
    body = {"model": MODEL, "prompt": prompt_ids, "echo": True, "logprobs": 2, "max_tokens": 0, "temperature": 0,
            "return_tokens_as_token_ids": True}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 0
    assert choice["logprobs"]["tokens"] == [f"token_id:{token}" for token in prompt_ids]
    assert len(choice["logprobs"]["token_logprobs"]) == len(prompt_ids)
    assert torch.tensor(choice["logprobs"]["token_logprobs"][1:]) == pytest.approx(
        hf_prompt_logprobs(target, prompt_ids), abs=1e-4)
    assert all(len(top) == 2 for top in choice["logprobs"]["top_logprobs"][1:])


def test_vllm_prompt_logprobs_field(server, target):
    url, _ = server
    prompt_ids = json.loads((BODIES / "lmeval_completions_loglikelihood.json").read_text())["prompt"][1]
    body = {"model": MODEL, "prompt": prompt_ids, "prompt_logprobs": 1, "max_tokens": 2, "temperature": 0}
    (choice,) = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"]
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt_ids)
    expected = hf_prompt_logprobs(target, prompt_ids)
    for position, entry in enumerate(entries[1:]):
        own = entry[str(prompt_ids[position + 1])]
        assert own["logprob"] == pytest.approx(float(expected[position]), abs=1e-4) and own["rank"] >= 1
        assert any(item["rank"] == 1 for item in entry.values())
    assert choice["logprobs"] is None


# --- structured outputs (response_format, vLLM's structured_outputs) ------------------------------

# x-guidance (llguidance's schema options, docs/api.md): no free whitespace, which an untrained tiny
# model would otherwise fill max_tokens with.
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "admin": {"type": "boolean"}},
          "required": ["name", "admin"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}


def test_json_schema_response_format_output_parses_and_validates(server):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    for temperature in (0.0, 1.0):
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Who is the admin?"}], max_tokens=80,
            temperature=temperature, seed=3,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
        assert chat.choices[0].finish_reason == "stop", chat.choices[0].message.content
        jsonschema.validate(json.loads(chat.choices[0].message.content), PERSON)


def test_choice_and_regex_structured_outputs_on_completions(server):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    choices = ["red", "green", "blue"]
    batch = client.completions.create(model=MODEL, prompt="Pick a colour:", max_tokens=10, n=4, temperature=1.0,
                                      seed=1, extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.text in choices and c.finish_reason == "stop" for c in batch.choices)
    regex = r"[0-9]{3}-[a-z]{2}"
    stream = client.completions.create(model=MODEL, prompt="Code:", max_tokens=20, stream=True,
                                       extra_body={"structured_outputs": {"regex": regex}})
    chunks = list(stream)
    assert re.fullmatch(regex, "".join(c.choices[0].text for c in chunks if c.choices))
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra, param", [
    ({"structured_outputs": {"regex": "(a|b"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a"]}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({"structured_outputs": {"choice": ["a"]}, "allowed_token_ids": [1, 2]}, "allowed_token_ids"),
])
def test_bad_structured_outputs_are_400s_naming_the_field(server, extra, param):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_body=extra)
    assert info.value.param == param, info.value.body
