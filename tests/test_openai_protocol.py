"""The OpenAI request models (deployments/openai_protocol.py) and the 400 bodies the ingress
builds from their errors: which fields are served, ignored or refused, and that every refusal
names its field in an OpenAI-style body that can be sent (even when the request was not Unicode)."""

import json

import pytest
from pydantic import ValidationError

from specserve.decoding.sampling import MAX_SEED, MAX_STOP_STRINGS, MAX_TEMPERATURE, SamplingParams
from specserve.deployments.openai_protocol import (
    IGNORED_FIELDS,
    NEUTRAL_VALUES,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    validation_error_body,
)

COMPLETION = {"model": "m", "prompt": "def f():"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def refusal(model, body) -> dict:
    """The 400 body the ingress answers for body (asserting that it is refused)."""
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    error = validation_error_body(info.value.errors())
    json.dumps(error, ensure_ascii=False).encode("utf-8")  # what the JSON response does: must not raise
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["type"] == "invalid_request_error"
    return error["error"]


@pytest.mark.parametrize("field, value", [
    ("best_of", 2),
    ("suffix", "return x"),
    ("n", 17), ("tools", [{"type": "function", "function": {"name": "f"}}]), ("functions", [{"name": "f"}]),
    ("tool_choice", "auto"),
    ("use_beam_search", True), ("include_stop_str_in_output", "yes"), ("audio", {"voice": "x"}),
    ("skip_special_tokens", False), ("stop_token_ids", "5"),
    ("guided_regex", "a+"), ("priority", 1), ("truncate_prompt_tokens", 4),
    ("return_token_ids", True), ("length_penalty", 0.5),
])
@pytest.mark.parametrize("model, base", [(CompletionRequest, COMPLETION), (ChatCompletionRequest, CHAT)])
def test_fields_that_change_semantics_are_refused_naming_the_field(model, base, field, value):
    error = refusal(model, {**base, field: value})
    assert error["param"] == field and field in error["message"]


@pytest.mark.parametrize("field", sorted(NEUTRAL_VALUES))
def test_unserved_fields_are_accepted_at_their_neutral_value_or_null(field):
    for value in NEUTRAL_VALUES[field] + (None,):
        CompletionRequest.model_validate({**COMPLETION, field: value})
        ChatCompletionRequest.model_validate({**CHAT, field: value})


@pytest.mark.parametrize("fields, kind, param", [
    ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"},
                                                                 "strict": True}}},
     "json_schema", "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": '{"type": "object"}', "disable_any_whitespace": True}}, "json_schema",
     "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a+"}}, "regex", "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": "root ::= \"a\""}}, "grammar", "structured_outputs.grammar"),
    ({"structured_outputs": {"json_object": True}}, "json_object", "structured_outputs.json_object"),
    ({"response_format": {"type": "text"}}, None, None),
])
@pytest.mark.parametrize("model, base", [(CompletionRequest, COMPLETION), (ChatCompletionRequest, CHAT)])
def test_structured_output_fields_become_grammar_specs_naming_their_field(model, base, fields, kind, param):
    spec = model.model_validate({**base, **fields}).structured_spec()
    assert (spec.kind, spec.param) == (kind, param) if kind else spec is None


@pytest.mark.parametrize("fields, flexible", [
    ({"response_format": {"type": "json_object"}}, False),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}}}, False),
    ({"structured_outputs": {"json": {"type": "object"}}}, False),
    ({"structured_outputs": {"json_object": True}}, False),
    ({"structured_outputs": {"json": {"type": "object"}, "disable_any_whitespace": True}}, False),
    ({"structured_outputs": {"json": {"type": "object"}, "disable_any_whitespace": False}}, True),
    ({"structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": "[ ]?"}}, True),
])
def test_json_is_compact_by_default_and_free_whitespace_is_opt_in(fields, flexible):
    assert CompletionRequest.model_validate({**COMPLETION, **fields}).structured_spec().whitespace_flexible is flexible


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a", "frobnicate": 1}}, "structured_outputs.frobnicate"),
])
def test_malformed_structured_output_fields_are_refused_naming_the_field(fields, param):
    try:
        ChatCompletionRequest.model_validate({**CHAT, **fields}).structured_spec()
    except ValidationError as exc:
        assert validation_error_body(exc.errors())["error"]["param"] == param
    except OpenAIError as exc:
        assert exc.param == param
    else:
        pytest.fail(f"{fields} was accepted")


def test_stop_token_ids_and_chat_template_fields_are_served():
    request = CompletionRequest.model_validate({**COMPLETION, "stop_token_ids": [5, 7], "include_stop_str_in_output": True})
    assert (request.stop_token_ids, request.include_stop_str_in_output) == ([5, 7], True)
    chat = ChatCompletionRequest.model_validate({**CHAT, "chat_template": "{{ messages[0]['content'] }}",
                                                 "chat_template_kwargs": {"date_string": "01 Jan 2025"}})
    assert chat.chat_template_kwargs == {"date_string": "01 Jan 2025"}
    assert refusal(CompletionRequest, {**COMPLETION, "chat_template": "x"})["param"] == "chat_template"


def test_echo_is_served_on_completions_and_refused_on_chat():
    assert CompletionRequest.model_validate({**COMPLETION, "echo": True}).echo
    assert refusal(ChatCompletionRequest, {**CHAT, "echo": True})["param"] == "echo"


@pytest.mark.parametrize("field, value", [("user", "u-1"), ("metadata", {"k": "v"}), ("store", False),
                                          ("service_tier", "auto"), ("parallel_tool_calls", True)])
def test_harmless_fields_are_accepted_and_ignored(field, value):
    assert field in IGNORED_FIELDS
    CompletionRequest.model_validate({**COMPLETION, field: value})
    ChatCompletionRequest.model_validate({**CHAT, field: value})


@pytest.mark.parametrize("field, value", [("request_id", "r-1"), ("include_reasoning", True),
                                          ("return_token_offsets", False)])
def test_vllm_fields_that_change_nothing_here_are_accepted(field, value):
    assert field in IGNORED_FIELDS
    CompletionRequest.model_validate({**COMPLETION, field: value})
    ChatCompletionRequest.model_validate({**CHAT, field: value})


@pytest.mark.parametrize("model, base", [(CompletionRequest, COMPLETION), (ChatCompletionRequest, CHAT)])
def test_bad_words_are_served_and_empty_or_too_many_refused(model, base):
    assert model.model_validate({**base, "bad_words": ["foo", " bar baz"]}).bad_words == ["foo", " bar baz"]
    assert refusal(model, {**base, "bad_words": [""]})["param"] == "bad_words.0"
    assert refusal(model, {**base, "bad_words": ["w"] * 129})["param"] == "bad_words"
    assert refusal(model, {**base, "bad_words": "foo"})["param"] == "bad_words"


@pytest.mark.parametrize("model, base", [(CompletionRequest, COMPLETION), (ChatCompletionRequest, CHAT)])
def test_cache_salt_is_served_and_an_empty_one_refused(model, base):
    assert model.model_validate({**base, "cache_salt": "tenant-a"}).cache_salt == "tenant-a"
    assert refusal(model, {**base, "cache_salt": ""})["param"] == "cache_salt"


def test_continuous_usage_stats_is_served_with_include_usage():
    options = {"include_usage": True, "continuous_usage_stats": True}
    request = CompletionRequest.model_validate({**COMPLETION, "stream": True, "stream_options": options})
    assert request.include_usage and request.continuous_usage
    alone = CompletionRequest.model_validate({**COMPLETION, "stream": True,
                                              "stream_options": {"continuous_usage_stats": True}})
    assert not alone.continuous_usage  # as vLLM: continuous usage rides on include_usage


@pytest.mark.parametrize("prompt, expected", [
    ("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], [[1, 2, 3]]), ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_prompt_may_be_strings_or_token_ids(prompt, expected):
    assert CompletionRequest.model_validate({**COMPLETION, "prompt": prompt}).prompts == expected


@pytest.mark.parametrize("prompt", [[], [-1], [[1], "a"], [["a"]], 42, [1.5]])
def test_malformed_prompts_are_refused(prompt):
    assert refusal(CompletionRequest, {**COMPLETION, "prompt": prompt})["param"].startswith("prompt")


def test_max_tokens_zero_needs_echo_and_prompt_logprobs_follow_echo():
    assert "echo" in refusal(CompletionRequest, {**COMPLETION, "max_tokens": 0})["message"]
    request = CompletionRequest.model_validate({**COMPLETION, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert request.requested_max_tokens == 0 and request.num_prompt_logprobs == 1
    assert CompletionRequest.model_validate({**COMPLETION, "logprobs": 1}).num_prompt_logprobs is None
    assert CompletionRequest.model_validate({**COMPLETION, "prompt_logprobs": 0}).num_prompt_logprobs == 0
    assert refusal(CompletionRequest, {**COMPLETION, "prompt_logprobs": 1, "stream": True})
    assert refusal(ChatCompletionRequest, {**CHAT, "max_tokens": 0})["param"] == "max_tokens"
    assert refusal(ChatCompletionRequest, {**CHAT, "prompt_logprobs": 1})["param"] == "prompt_logprobs"


def test_unknown_fields_are_refused_as_openai_does():
    error = refusal(CompletionRequest, {**COMPLETION, "temprature": 0.5})
    assert error["message"] == "Unrecognized request argument supplied: temprature"
    assert error["param"] == "temprature"


def test_null_means_the_default():
    request = CompletionRequest.model_validate({**COMPLETION, "temperature": None, "stop": None, "max_tokens": None,
                                                "seed": None, "n": None, "stream_options": None})
    assert request.temperature == 1.0 and request.stop == [] and request.requested_max_tokens is None


def test_max_completion_tokens_is_honoured_on_completions_and_wins_over_max_tokens():
    assert CompletionRequest.model_validate({**COMPLETION, "max_completion_tokens": 7}).requested_max_tokens == 7
    both = {**CHAT, "max_tokens": 3, "max_completion_tokens": 9}
    assert ChatCompletionRequest.model_validate(both).requested_max_tokens == 9
    assert CompletionRequest.model_validate({**COMPLETION, "max_tokens": 3}).requested_max_tokens == 3


def _accepts(make) -> bool:
    try:
        make()
        return True
    except ValidationError:
        return False


@pytest.mark.parametrize("field, values", [
    ("temperature", [-0.01, 0.0, 1.0, MAX_TEMPERATURE, MAX_TEMPERATURE + 0.01, 100.0, float("nan"), float("inf")]),
    ("top_p", [0.0, 1e-9, 0.5, 1.0, 1.01]),
    ("seed", [-1, 0, MAX_SEED, MAX_SEED + 1]),
    ("stop", [["x"] * MAX_STOP_STRINGS, ["x"] * (MAX_STOP_STRINGS + 1), [""], "x"]),
    ("presence_penalty", [-2.01, -2.0, 0.0, 0.5, 2.0, 2.01, float("nan")]),
    ("frequency_penalty", [-2.01, -2.0, -1, 2.0, 2.01, float("inf")]),
    ("repetition_penalty", [-1.0, 0.0, 1e-3, 1.0, 1.2, 50.0, float("inf")]),
    ("min_p", [-0.01, 0.0, 0.1, 1.0, 1.01, float("nan")]),
    ("logit_bias", [{}, {"5": 100}, {"5": -100.01}, {"x": 1}, {"-1": 0}, {"5": float("nan")}]),
    ("allowed_token_ids", [[], [0], [3, -1], [4, 4]]),
])
def test_the_ingress_admits_exactly_what_sampling_params_accept(field, values):
    """One source of truth: a request the ingress admits never fails later in the router, and the
    ingress refuses nothing the router could serve."""
    for value in values:
        ingress = _accepts(lambda: CompletionRequest.model_validate({**COMPLETION, field: value}))
        router = _accepts(lambda: SamplingParams.model_validate({field: value}))
        assert ingress == router, (field, value)
    assert MAX_TEMPERATURE == 2.0 and MAX_STOP_STRINGS == 4   # OpenAI's documented limits


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", -3),
                                          ("repetition_penalty", 0), ("min_p", 1.5)])
@pytest.mark.parametrize("model, base", [(CompletionRequest, COMPLETION), (ChatCompletionRequest, CHAT)])
def test_penalties_and_min_p_are_served_and_out_of_range_values_refused_naming_the_field(model, base, field, value):
    served = {"presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2, "min_p": 0.1}[field]
    assert getattr(model.model_validate({**base, field: served}), field) == served
    error = refusal(model, {**base, field: value})
    assert error["param"] == field and field in error["message"]


@pytest.mark.parametrize("field, value, param", [
    ("logit_bias", {"50": 100.5}, "logit_bias.50"), ("logit_bias", {"x": 1}, "logit_bias.x.[key]"),
    ("logit_bias", {"-1": 1}, "logit_bias.-1.[key]"), ("logit_bias", [[50, 1]], "logit_bias"),
    ("logit_bias", {"50": "inf"}, "logit_bias.50"),
    ("allowed_token_ids", [], "allowed_token_ids"), ("allowed_token_ids", [3, -2], "allowed_token_ids.1"),
    ("allowed_token_ids", "3", "allowed_token_ids")])
@pytest.mark.parametrize("model, base", [(CompletionRequest, COMPLETION), (ChatCompletionRequest, CHAT)])
def test_logit_bias_and_allowed_token_ids_are_served_and_malformed_ones_refused_naming_the_field(
        model, base, field, value, param):
    served = model.model_validate({**base, "logit_bias": {"50": 10, "7": -100}, "allowed_token_ids": [7, 50]})
    assert served.logit_bias == {50: 10.0, 7: -100.0} and served.allowed_token_ids == [7, 50]
    params = SamplingParams(logit_bias=served.logit_bias, allowed_token_ids=served.allowed_token_ids)
    assert SamplingParams.model_validate(params.model_dump()) == params   # as the router rebuilds them
    error = refusal(model, {**base, field: value})
    assert error["param"] == param and field in error["message"]


def test_content_as_a_list_of_text_parts_is_joined():
    body = {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                {"type": "text", "text": "b"}]}]}
    assert ChatCompletionRequest.model_validate(body).messages[0].content == "a\nb"


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "http://x"}}, {"type": "text"},
                                  "text", {"type": "text", "text": "a", "cache_control": {}}])
def test_non_text_content_parts_are_refused(part):
    body = {**CHAT, "messages": [{"role": "user", "content": [part]}]}
    assert refusal(ChatCompletionRequest, body)["param"] == "messages.0.content"


def test_developer_is_rendered_as_system_and_tool_messages_are_refused():
    body = {**CHAT, "messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest.model_validate(body).messages[0].template_role == "system"
    tool = {**CHAT, "messages": [{"role": "tool", "content": "42", "tool_call_id": "c1"}]}
    assert refusal(ChatCompletionRequest, tool)["param"] == "messages.0.role"
    calls = {**CHAT, "messages": [{"role": "assistant", "content": "", "tool_calls": []}]}
    assert refusal(ChatCompletionRequest, calls)["param"] == "messages.0.tool_calls"


@pytest.mark.parametrize("model, body, param", [
    (CompletionRequest, {**COMPLETION, "prompt": "a\ud800b"}, "prompt"),
    (CompletionRequest, {**COMPLETION, "prompt": ["\udfff"]}, "prompt"),
    (CompletionRequest, {**COMPLETION, "model": "\ud800"}, "model"),
    (CompletionRequest, {**COMPLETION, "stop": ["ok", "\ud83d"]}, "stop.1"),
    (CompletionRequest, {**COMPLETION, "stop": "\ud83d"}, "stop.0"),
    (ChatCompletionRequest, {**CHAT, "messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
    (ChatCompletionRequest, {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages.0.content"),
    (ChatCompletionRequest, {**CHAT, "messages": [{"role": "user", "content": "x", "name": "\ud800"}]},
     "messages.0.name"),
    (CompletionRequest, {**COMPLETION, "\ud800": 1}, None),  # pydantic cannot even name the key
])
def test_strings_that_are_not_unicode_are_refused_with_a_sendable_body(model, body, param):
    assert refusal(model, body)["param"] == param


def test_stream_options_need_stream_and_include_usage_is_read_from_them():
    assert refusal(CompletionRequest, {**COMPLETION, "stream_options": {"include_usage": True}})["param"] == \
        "stream_options"
    request = CompletionRequest.model_validate({**COMPLETION, "stream": True, "stream_options": {"include_usage": True}})
    assert request.include_usage
    assert not CompletionRequest.model_validate({**COMPLETION, "stream": True}).include_usage


def test_vllm_extensions_are_read():
    request = CompletionRequest.model_validate({**COMPLETION, "ignore_eos": True, "min_tokens": 5})
    assert request.ignore_eos and request.min_tokens == 5
    assert refusal(CompletionRequest, {**COMPLETION, "min_tokens": -1})["param"] == "min_tokens"


@pytest.mark.parametrize("body", [[], "x", 5, {"model": 5, "prompt": "x"}, {"model": "m", "prompt": 5},
                                  {"model": "m", "prompt": ["a", 2]}, {"model": "m", "prompt": [1, "2"]},
                                  {"model": "m", "prompt": "x", "max_tokens": 0},
                                  {"model": "m", "prompt": "x", "temperature": "hot"}])
def test_wrong_types_are_refused(body):
    refusal(CompletionRequest, body)


def test_invalid_json_gets_a_message_without_a_param():
    errors = [{"type": "json_invalid", "loc": ("body", 7), "msg": "JSON decode error",
               "ctx": {"error": "Expecting value"}}]
    error = validation_error_body(errors)["error"]
    assert error["param"] is None and "not valid JSON" in error["message"]


def test_completion_logprobs_take_a_count_of_alternatives():
    assert CompletionRequest.model_validate({**COMPLETION, "logprobs": 0}).num_logprobs == 0
    assert CompletionRequest.model_validate({**COMPLETION, "logprobs": 5}).num_logprobs == 5
    assert CompletionRequest.model_validate(COMPLETION).num_logprobs is None
    assert refusal(CompletionRequest, {**COMPLETION, "logprobs": 21})["param"] == "logprobs"
    assert refusal(CompletionRequest, {**COMPLETION, "logprobs": True})["param"] == "logprobs"
    assert refusal(CompletionRequest, {**COMPLETION, "top_logprobs": 2})["param"] == "top_logprobs"


def test_chat_logprobs_are_a_switch_with_top_logprobs_beside_it():
    assert ChatCompletionRequest.model_validate({**CHAT, "logprobs": True, "top_logprobs": 3}).num_logprobs == 3
    assert ChatCompletionRequest.model_validate({**CHAT, "logprobs": True}).num_logprobs == 0
    assert ChatCompletionRequest.model_validate({**CHAT, "logprobs": False}).num_logprobs is None
    assert refusal(ChatCompletionRequest, {**CHAT, "top_logprobs": 3})["param"] == "top_logprobs"
    assert refusal(ChatCompletionRequest, {**CHAT, "logprobs": True, "top_logprobs": 21})["param"] == "top_logprobs"
    assert refusal(ChatCompletionRequest, {**CHAT, "logprobs": 1})["param"] == "logprobs"
