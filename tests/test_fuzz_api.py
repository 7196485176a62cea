"""The HTTP API under hostile and unusual input, on a real local Ray cluster with API keys on.

One server (tiny random pair, `auth.api_keys` set) serves every test here: API keys with the
official `openai` client, stop strings that cross streamed chunk boundaries, `include_usage`
streaming, text content parts, and a seeded hypothesis fuzzer that sends arbitrary Unicode
(lone surrogates and control characters included) and arbitrary JSON in every field. Whatever
arrives, the answer is a 200 or a 4xx with OpenAI's error body, never a 5xx, never a hang.

The fuzzer runs SPECSERVE_FUZZ_EXAMPLES examples (150 by default, well under a minute);
`make fuzz` runs 5,000 and adds schemathesis against the ingress's OpenAPI schema.
"""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from specserve.cluster.local import start_local
from tests.local_server import free_port, stop_test_cluster
from tests.tiny_pair import tiny_pair_config

pytestmark = pytest.mark.ray
MODEL = "tiny-pair"
API_KEYS = ["test-key-1", "test-key-2"]
AUTH = {"Authorization": f"Bearer {API_KEYS[1]}"}
FUZZ_EXAMPLES = int(os.environ.get("SPECSERVE_FUZZ_EXAMPLES", "150"))
LONG_RUN = FUZZ_EXAMPLES > 150
CLIENT_TIMEOUT_S = 60.0   # a request that takes longer than this counts as a hang
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = tiny_pair_config(tmp_path_factory.mktemp("pair"), MODEL, free_port(),
                              limits={"max_tokens": 200, "default_max_tokens": 4}, auth={"api_keys": API_KEYS})
    url = start_local(config)
    yield url
    stop_test_cluster()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEYS[0], max_retries=0, timeout=CLIENT_TIMEOUT_S)


def _post(url: str, path: str, body: dict | bytes, headers: dict | None = None) -> httpx.Response:
    # json.dumps escapes lone surrogates as \ud800 and writes NaN/Infinity: a client can send both.
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}{path}", content=content, timeout=CLIENT_TIMEOUT_S,
                      headers={"content-type": "application/json", **AUTH, **(headers or {})})


def _assert_openai_error(response: httpx.Response) -> dict:
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and isinstance(error["message"], str) and error["message"]
    return error


def _stream_events(url: str, path: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", f"{url}{path}", content=json.dumps(body).encode(), timeout=CLIENT_TIMEOUT_S,
                      headers={"content-type": "application/json", **AUTH}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events and events[-1] == "[DONE]", events[-3:]
    parsed = [json.loads(event) for event in events[:-1]]
    assert not [event for event in parsed if "error" in event], parsed
    return parsed


# --- API keys -------------------------------------------------------------------------------------

def test_a_valid_key_is_served_and_a_bad_key_raises_authentication_error(server, client):
    reply = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens >= 1
    intruder = openai.OpenAI(base_url=f"{server}/v1", api_key="not-a-key", max_retries=0, timeout=CLIENT_TIMEOUT_S)
    with pytest.raises(openai.AuthenticationError) as info:
        intruder.completions.create(model=MODEL, prompt="def f(x):", max_tokens=3)
    assert info.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        intruder.models.list()


@pytest.mark.parametrize("path, method", [("/v1/completions", "POST"), ("/v1/chat/completions", "POST"),
                                          ("/v1/models", "GET"), ("/v1/no-such-route", "GET")])
def test_every_v1_path_needs_a_key_and_health_does_not(server, path, method):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEYS[0]}):
        # An invalid body too: the key is checked before the body is read.
        response = httpx.request(method, f"{server}{path}", content=b"{not json", headers=headers, timeout=30)
        assert response.status_code == 401
        error = _assert_openai_error(response)
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert "wrong" not in response.text
    assert httpx.get(f"{server}/health", timeout=30).status_code == 200


def test_unknown_routes_get_an_openai_style_404(server):
    response = httpx.get(f"{server}/v1/no-such-route", headers=AUTH, timeout=30)
    assert response.status_code == 404 and "Invalid URL" in _assert_openai_error(response)["message"]


# --- streaming --------------------------------------------------------------------------------------

def _text_of(events: list[dict]) -> str:
    return "".join(choice.get("text", "") for event in events for choice in event["choices"])


def test_stop_strings_that_cross_chunk_boundaries_cut_the_stream_where_the_whole_text_is_cut(server):
    body = {"model": MODEL, "prompt": "def fibonacci(n):\n", "max_tokens": 60, "temperature": 0, "stream": True}
    chunks = [_text_of([event]) for event in _stream_events(server, "/v1/completions", body)]
    full = "".join(chunks)
    boundaries = [i for i in range(len(chunks) - 1) if len(chunks[i]) >= 2 and len(chunks[i + 1]) >= 2]
    assert len(boundaries) >= 2, chunks
    for i in boundaries[len(boundaries) // 2:][:2]:
        stop = chunks[i][-2:] + chunks[i + 1][:2]          # half in one chunk, half in the next
        expected = full[:full.find(stop)]
        events = _stream_events(server, "/v1/completions", {**body, "stop": [stop, "\u0000never"]})
        assert _text_of(events) == expected
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
        plain = _post(server, "/v1/completions", {**body, "stream": False, "stop": stop}).json()
        assert plain["choices"][0]["text"] == expected


def test_include_usage_sends_usage_null_then_a_last_chunk_with_empty_choices(server, client):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(chunk.usage is None and chunk.choices for chunk in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + chunks[-1].usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    # Without it, the finishing chunk carries the usage, as before.
    events = _stream_events(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4,
                                                        "stream": True})
    assert "usage" not in events[0] and events[-1]["usage"]["completion_tokens"] >= 1


# --- fields ---------------------------------------------------------------------------------------

def test_text_content_parts_developer_role_and_vllm_extensions_are_served(client):
    reply = client.chat.completions.create(
        model=MODEL, max_completion_tokens=5, temperature=0,
        messages=[{"role": "developer", "content": "be brief"},
                  {"role": "user", "content": [{"type": "text", "text": "def f"}, {"type": "text", "text": "(x):"}]}],
        extra_body={"ignore_eos": True, "min_tokens": 5})
    assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"
    completion = client.completions.create(model=MODEL, prompt="x", max_tokens=50, extra_body={"max_completion_tokens": 3})
    assert completion.usage.completion_tokens <= 3


def test_refused_fields_raise_bad_request_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=3, presence_penalty=2.5)
    assert info.value.param == "presence_penalty"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       logit_bias={"5": 3, "10000000": 1})
    assert info.value.param == "logit_bias" and "10000000" in info.value.message


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", b'{"model": "tiny-pair", "prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", b'{"model": "\\udfff", "prompt": "x"}', "model"),
    ("/v1/completions", b'{"model": "tiny-pair", "prompt": "x", "stop": ["\\ud83d"]}', "stop.0"),
    ("/v1/chat/completions", b'{"model": "tiny-pair", "messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages.0.content"),
    ("/v1/completions", b'{"model": "tiny-pair", "prompt": "x\x01"}', None),      # raw control char: bad JSON
    ("/v1/completions", b'{"model": "tiny-pair", "prompt": "\xff\xfe"}', None),   # not UTF-8 at all
    ("/v1/completions", b'{"model": "tiny-pair", "prompt": "x", "seed": 1e400}', "seed"),
    ("/v1/completions", b'{"model": "tiny-pair", "prompt": "x", "temperature": NaN}', "temperature"),
])
def test_malformed_strings_and_numbers_get_400_not_500(server, path, body, param):
    response = _post(server, path, body)
    assert response.status_code == 400
    assert _assert_openai_error(response)["param"] == param


# --- fuzzing --------------------------------------------------------------------------------------

ALL_CATEGORIES = ["Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl", "No", "Pc", "Pd", "Ps", "Pe",
                  "Pi", "Pf", "Po", "Sm", "Sc", "Sk", "So", "Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co", "Cn"]
any_text = st.text(st.characters(categories=ALL_CATEGORIES), max_size=30)   # surrogates, controls, ...
plain_text = st.text(st.sampled_from("abc def():\n\t{}#é€日🎉\\\"'"), max_size=30)
texts = st.one_of(any_text, plain_text)
numbers = st.one_of(st.integers(-3, 300), st.integers(), st.just(10**400), st.floats(allow_nan=True),
                    st.sampled_from([0, 1, 2, -1, 0.5, 2.0, 2**63, 2**64, -(2**63)]))
json_values = st.recursive(st.one_of(st.none(), st.booleans(), numbers, texts),
                           lambda children: st.one_of(st.lists(children, max_size=4),
                                                      st.dictionaries(texts, children, max_size=4)),
                           max_leaves=8)
plausible_text = st.one_of(plain_text, plain_text, any_text)

text_part = st.fixed_dictionaries({"type": st.just("text"), "text": plausible_text})
other_part = st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio"]), "image_url": json_values})
content_parts = st.lists(st.one_of(text_part, text_part, text_part, other_part), min_size=1, max_size=3)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "user", "assistant", "assistant", "tool"]),
     "content": st.one_of(plausible_text, content_parts)}, optional={"name": plain_text}), min_size=1, max_size=3)
# Plausible values: most bodies get past validation, so generation, streaming and stop strings run.
SAMPLING_FIELDS = {
    "max_tokens": st.integers(1, 6), "max_completion_tokens": st.integers(1, 6),
    "temperature": st.one_of(st.just(0), st.floats(0, 2)), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50),
    "seed": st.integers(0, 2**63), "stop": st.one_of(plausible_text, st.lists(plausible_text, max_size=4)),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(), "min_tokens": st.integers(0, 2), "n": st.just(1), "user": plain_text,
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "min_p": st.floats(0, 1), "logprobs": st.just(False), "response_format": st.just({"type": "text"}),
    "logit_bias": st.dictionaries(st.integers(0, 255).map(str), st.floats(-100, 100), max_size=3),
    "allowed_token_ids": st.lists(st.integers(0, 255), min_size=1, max_size=4),
    "bad_words": st.lists(plain_text, max_size=3),
}
completion_bodies = st.fixed_dictionaries(
    {"model": st.one_of(st.just(MODEL), st.just(MODEL), plausible_text),
     "prompt": st.one_of(plausible_text, st.lists(plausible_text, min_size=1, max_size=2))},
    optional={**SAMPLING_FIELDS, "echo": st.booleans()})
chat_bodies = st.fixed_dictionaries({"model": st.just(MODEL), "messages": messages}, optional=SAMPLING_FIELDS)
FIELD_NAMES = sorted({"model", "prompt", "messages", "echo", "suffix", "best_of", "logit_bias", "tools",
                      "frequency_penalty", "tool_choice", "top_logprobs", "metadata"} | set(SAMPLING_FIELDS))


@st.composite
def requests(draw):
    """A plausible body, then maybe one field replaced by (or one key added with) any JSON value."""
    path, bodies = draw(st.sampled_from([("/v1/completions", completion_bodies),
                                         ("/v1/chat/completions", chat_bodies)]))
    body = draw(bodies)
    mutation = draw(st.sampled_from(["none", "none", "replace", "add"]))
    if mutation == "replace":
        body[draw(st.sampled_from(sorted(body)))] = draw(json_values)
    elif mutation == "add":
        body[draw(st.one_of(st.sampled_from(FIELD_NAMES), texts))] = draw(json_values)
    return path, body


FUZZ_SETTINGS = settings(max_examples=FUZZ_EXAMPLES, derandomize=True, deadline=None, database=None,
                         suppress_health_check=list(HealthCheck), print_blob=True)


def _check_answer(response: httpx.Response) -> None:
    """200 (a completion, or an SSE stream ending in [DONE] without an error event) or a 4xx
    with OpenAI's error body; never a 5xx."""
    event(f"HTTP {response.status_code}")   # --hypothesis-show-statistics: how many got through
    if response.status_code != 200:
        _assert_openai_error(response)
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and not any('"error"' in event[:12] for event in events), events[-2:]
    else:
        assert response.json()["choices"], response.text


@FUZZ_SETTINGS
@given(request=requests())
def test_fuzzed_bodies_get_200_or_an_openai_style_4xx(server, request):
    path, body = request
    _check_answer(_post(server, path, body))


@settings(FUZZ_SETTINGS, max_examples=max(20, FUZZ_EXAMPLES // 5))
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       body=st.one_of(st.binary(max_size=200), json_values.map(lambda v: json.dumps(v).encode())),
       content_type=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", ""]))
def test_fuzzed_raw_bytes_and_json_of_any_shape_get_4xx(server, path, body, content_type):
    response = httpx.post(f"{server}{path}", content=body, timeout=CLIENT_TIMEOUT_S,
                          headers={"content-type": content_type, **AUTH})
    _assert_openai_error(response)


# --- schemathesis (long run only) ------------------------------------------------------------------

@pytest.mark.skipif(not LONG_RUN, reason="long run only: make fuzz")
def test_schemathesis_cases_from_the_openapi_schema_get_no_server_error(server):
    """Bodies schemathesis derives from FastAPI's /openapi.json, every operation. Driven through
    hypothesis directly: schemathesis' pytest plugin (4.32) reads `node._nodeid`, which pytest 9 removed."""
    import schemathesis

    schema = schemathesis.openapi.from_url(f"{server}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {operation.path for operation in operations} >= {"/v1/completions", "/v1/chat/completions"}
    for operation in operations:
        @settings(max_examples=max(50, FUZZ_EXAMPLES // 10), derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def check(case):
            response = case.call(base_url=server, headers=AUTH, timeout=CLIENT_TIMEOUT_S)
            assert response.status_code < 500, (operation.path, response.status_code, response.text)
            if response.status_code >= 400:
                assert set(response.json()["error"]) == ERROR_KEYS, response.text

        check()
