"""OpenAI-compatible request bodies and response shapes (the subset specserve serves).

Bodies are validated by pydantic at the edge; anything malformed becomes an HTTP 400 with an
OpenAI-style error JSON (``error_body``) whose ``param`` names the offending field. The rule for
fields, so a client never believes it got what it did not:

- *served*: model, prompt (a string, a list of strings, token ids or a list of token-id lists:
  one choice per prompt) / messages, n (independent choices per prompt), max_tokens,
  max_completion_tokens (wins over max_tokens, as in vLLM), temperature, top_p, top_k, min_p, seed,
  stop, presence_penalty, frequency_penalty, logit_bias, vLLM's repetition_penalty,
  allowed_token_ids and bad_words (docs/sampling.md), stream,
  stream_options (include_usage, and vLLM's continuous_usage_stats), echo (completions; with
  max_tokens 0 it returns the prompt alone, as vLLM), and vLLM's ignore_eos, min_tokens,
  prompt_logprobs, return_tokens_as_token_ids, stop_token_ids, include_stop_str_in_output, cache_salt and
  (chat) chat_template / chat_template_kwargs. Sampling fields a request leaves out take the
  target's generation_config.json defaults (deployments/ingress.py, as vLLM's --generation-config
  auto). Structured outputs: OpenAI's response_format (text, json_object, json_schema) and vLLM's
  structured_outputs (json, regex, choice, grammar, json_object); `structured_spec` turns them into
  the request's GrammarSpec (docs/structured-outputs.md). Limits come from decoding.sampling, the one source of truth the router's SamplingParams
  also uses. Log-probabilities are served: `logprobs`
  (completions: how many alternatives, 0-20) and `logprobs` + `top_logprobs` (chat), the
  target's raw distribution; with echo (or prompt_logprobs) the prompt's too, from its prefill.
- *accepted and ignored* (they change neither the tokens nor the response shape): ``IGNORED_FIELDS``.
- *served only at their neutral value* (anything else changes semantics we do not serve, so 400
  naming the field): ``NEUTRAL_VALUES``, e.g. best_of=1, suffix="", tools=[],
  guided_json (vLLM's older names of structured_outputs: none).
- *unknown*: 400 "Unrecognized request argument supplied: X", as OpenAI's own API answers. An
  unknown field cannot be known to be harmless, and silently dropping one is how a benchmark ends
  up measuring something else.

docs/api.md has the field-by-field table. ``null`` for any field means its default (clients send
nulls for unset options). Every string must
be valid Unicode: a lone surrogate (JSON "\\ud800") would otherwise reach the tokenizer.
"""

from __future__ import annotations

import hmac
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt,
                      field_validator, model_validator)

from specserve.common.config import hash_key
from specserve.decoding.grammar import GrammarSpec, StructuredOutputError
from specserve.decoding.sampling import (MAX_BAD_WORDS, MAX_LOGPROBS, MAX_STOP_STRINGS, AllowedTokenIds,
                                         FrequencyPenalty, LogitBias, MinP, PresencePenalty, RepetitionPenalty, Seed,
                                         Temperature, TopP, check_stop_strings, stop_as_list, structured_conflict)


class OpenAIError(Exception):
    """An error answered as {"error": {...}} with an HTTP status."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None,
                 error_type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status_code, self.param, self.error_type, self.code = (
            message, status_code, param, error_type, code)
        self.headers = headers


def _printable(text: str | None) -> str | None:
    """text with anything UTF-8 cannot encode (lone surrogates from the request) escaped."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, error_type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape. Message and param may quote the request, so they are made encodable."""
    return {"error": {"message": _printable(message), "type": error_type, "param": _printable(param), "code": code}}


def validation_error_body(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The first pydantic error as OpenAI's 400 body, `param` the dotted path of the field."""
    first = errors[0] if errors else {}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    if first.get("type") == "json_invalid":
        message, param = f"The request body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}", None
    elif first.get("type") == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    else:
        message = f"{param or 'body'}: {str(first.get('msg', 'invalid request')).removeprefix('Value error, ')}"
    return error_body(message, param=param)


def authorization_error(header: str | None, key_digests: list[str]) -> dict[str, Any] | None:
    """None if the request may pass (no keys configured, or `Authorization: Bearer <key>` with a
    configured key), else OpenAI's 401 body. The presented key is hashed and compared with every
    digest in constant time (hmac.compare_digest), so neither timing nor a short-circuit tells
    how close a guess was, and the key itself is never echoed or logged."""
    if not key_digests:
        return None
    scheme, _, presented = (header or "").strip().partition(" ")
    if scheme.lower() == "bearer" and presented.strip():
        digest = hash_key(presented.strip())
        matches = [hmac.compare_digest(digest.encode(), known.encode()) for known in key_digests]
        if any(matches):
            return None
        message = "Incorrect API key provided."
    else:
        message = ("You didn't provide an API key. Provide it in an Authorization header using Bearer auth "
                   "(i.e. Authorization: Bearer YOUR_KEY).")
    return error_body(message, param=None, code="invalid_api_key")


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"string is not valid Unicode (lone surrogate at index {exc.start})") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]

# Accepted and ignored: metadata, routing and hints that change neither tokens nor response shape.
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "prediction",
                  "spaces_between_special_tokens", "prompt_cache_key", "safety_identifier",
                  # vLLM's: its own request id (ours is generated), offsets only its /render endpoints
                  # return, reasoning output (no reasoning parser: nothing to include or leave out).
                  "request_id", "return_token_offsets", "include_reasoning")

# Served only at these values (compared with ==, so 0 == 0.0 and [] == []).
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "suffix": ("",),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none",),
    "function_call": ("none",),
    "modalities": (["text"],),
    "audio": (),
    "reasoning_effort": (),
    "web_search_options": (),
    "use_beam_search": (False,),
    "skip_special_tokens": (True,),
    # vLLM's extensions that would change the output (or its scheduling) and are not served here.
    "length_penalty": (1,),             # beam search only
    "priority": (0,),                   # vLLM too refuses a priority without priority scheduling
    "truncate_prompt_tokens": (),
    "logits_processors": (),
    # vLLM's older, deprecated names for structured_outputs: not served, send structured_outputs.
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "prompt_embeds": (),
    "logprob_token_ids": (),
    "vllm_xargs": ({},),
    "kv_transfer_params": (),
    "thinking_token_budget": (),
    "repetition_detection": (),
    "return_token_ids": (False,),
}
_CHAT_ONLY_NEUTRAL = {"echo": (False,), "add_generation_prompt": (True,), "continue_final_message": (False,),
                      "prompt_logprobs": ()}
MAX_N = 16          # choices per prompt
MAX_PROMPTS = 64    # prompts per completions request


def _same(value: Any, allowed: Any) -> bool:
    # Booleans are not numbers here: logprobs=0 asks for logprobs, only false does not.
    if isinstance(value, bool) or isinstance(allowed, bool):
        return value is allowed
    return value == allowed


def _check_neutral(name: str, value: Any, neutral: tuple[Any, ...]) -> Any:
    if value is not None and not any(_same(value, allowed) for allowed in neutral):
        served = " or ".join(repr(allowed) for allowed in neutral) or "null"
        raise ValueError(f"'{name}' is not supported by specserve; only {served} is served")
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = None
    include_obfuscation: Any = None                 # accepted, ignored: specserve sends no obfuscation
    continuous_usage_stats: bool | None = None      # vLLM: usage so far on every chunk


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema. `strict` is accepted: the schema is always enforced."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: Text = Field(max_length=64)
    description: Text | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (unconstrained), json_object (any JSON object) or json_schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only then")
        return self


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one of json (a schema), regex, choice, grammar (Lark or
    GBNF/EBNF) or json_object, plus whitespace options for the JSON kinds. JSON is compact unless
    the request opts into free whitespace with disable_any_whitespace: false (vLLM's field, whose
    default here is the other way round) or gives a whitespace_pattern. vLLM's disable_fallback is
    accepted (there is one backend, no fallback); structural_tag and disable_additional_properties
    are not served."""

    model_config = ConfigDict(extra="forbid")

    json_schema: dict[str, Any] | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool | None = None  # None: compact, unless whitespace_pattern is given
    whitespace_pattern: Text | None = None
    disable_fallback: StrictBool = False
    disable_additional_properties: Any = None
    structural_tag: Any = None

    @field_validator("disable_additional_properties", "structural_tag")
    @classmethod
    def _not_served(cls, value: Any, info) -> Any:
        neutral = (False,) if info.field_name == "disable_additional_properties" else ()
        return _check_neutral(info.field_name, value, neutral)

    @model_validator(mode="after")
    def _exactly_one_kind(self) -> "StructuredOutputs":
        given = [kind for kind, value in zip(STRUCTURED_KINDS, (self.json_schema, self.regex, self.choice,
                                                                self.grammar, self.json_object or None))
                 if value is not None]
        if len(given) != 1:
            raise ValueError(f"exactly one of {', '.join(STRUCTURED_KINDS)} must be set, got "
                             f"{', '.join(given) or 'none'}")
        return self

    def spec(self) -> GrammarSpec:
        """The GrammarSpec, param naming the field (StructuredOutputError for a malformed choice/schema)."""
        if self.disable_any_whitespace is None:
            flexible = self.whitespace_pattern is not None
        else:
            flexible = not self.disable_any_whitespace
        options = {"whitespace_flexible": flexible, "whitespace_pattern": self.whitespace_pattern}
        if self.json_schema is not None:
            return GrammarSpec.json_schema(self.json_schema, "structured_outputs.json", **options)
        if self.json_object:
            return GrammarSpec("json_object", "", "structured_outputs.json_object", **options)
        if self.choice is not None:
            return GrammarSpec.choice(self.choice, "structured_outputs.choice")
        if self.regex is not None:
            return GrammarSpec("regex", self.regex, "structured_outputs.regex")
        return GrammarSpec("grammar", self.grammar, "structured_outputs.grammar")


class _RequestFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: Text
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: int = Field(0, ge=-1, description="extension (as in vLLM); 0 or -1 disables")
    seed: Seed | None = None
    stop: Annotated[list[Text], BeforeValidator(stop_as_list), AfterValidator(check_stop_strings)] = Field(
        default_factory=list, description=f"a string or up to {MAX_STOP_STRINGS} strings")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="vLLM extension: EOS does not end the request")
    min_tokens: int = Field(0, ge=0, description="vLLM extension: EOS is masked before this many tokens")
    presence_penalty: PresencePenalty = 0.0
    frequency_penalty: FrequencyPenalty = 0.0
    repetition_penalty: RepetitionPenalty = Field(1.0, description="extension (as in vLLM/HF); 1 = off")
    min_p: MinP = Field(0.0, description="extension (as in vLLM/HF); 0 = off")
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] = Field(
        default_factory=list, description="vLLM extension: token ids that end the request as EOS does")
    include_stop_str_in_output: StrictBool = Field(False, description="vLLM extension: keep the stop string")
    cache_salt: Text | None = Field(None, min_length=1, description="vLLM extension: the request's prefix-cache "
                                    "blocks are keyed under it, found only by requests with the same salt")
    logit_bias: LogitBias = Field(default_factory=dict, description="token id (a string, as JSON keys are) -> "
                                  "a bias added to its logit before sampling, -100 to 100")
    allowed_token_ids: AllowedTokenIds | None = Field(None, description="vLLM extension: only these token ids "
                                                      "may be generated")
    bad_words: list[Annotated[Text, Field(min_length=1)]] = Field(
        default_factory=list, max_length=MAX_BAD_WORDS, description="vLLM extension: words the output never ends with")

    # Accepted and ignored (IGNORED_FIELDS).
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    parallel_tool_calls: Any = None
    prediction: Any = None
    spaces_between_special_tokens: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    request_id: Any = None
    return_token_offsets: Any = None
    include_reasoning: Any = None

    n: int = Field(1, ge=1, le=MAX_N, description="independent choices per prompt")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    return_tokens_as_token_ids: bool = Field(False, description="vLLM: logprob tokens as 'token_id:N'")

    # Served only at their neutral value (NEUTRAL_VALUES).
    best_of: Any = None
    suffix: Any = None
    tools: Any = None
    functions: Any = None
    tool_choice: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    use_beam_search: Any = None
    skip_special_tokens: Any = None
    length_penalty: Any = None
    priority: Any = None
    truncate_prompt_tokens: Any = None
    logits_processors: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    prompt_embeds: Any = None
    logprob_token_ids: Any = None
    vllm_xargs: Any = None
    kv_transfer_params: Any = None
    thinking_token_budget: Any = None
    repetition_detection: Any = None
    return_token_ids: Any = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    @field_validator(*NEUTRAL_VALUES)
    @classmethod
    def _neutral_only(cls, value: Any, info) -> Any:
        return _check_neutral(info.field_name, value, NEUTRAL_VALUES[info.field_name])

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens (OpenAI's current name) wins over max_tokens, as in vLLM."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def structured_spec(self) -> GrammarSpec | None:
        """The grammar the output must follow (response_format or structured_outputs), or None.
        OpenAIError (400, naming the field) when both constrain it, or with ignore_eos. The spec is
        only checked for shape here: compiling it is the ingress's (GrammarCompiler.validate)."""
        spec = None
        if self.response_format is not None and self.response_format.type != "text":
            if self.response_format.type == "json_object":
                spec = GrammarSpec("json_object", "", "response_format")
            else:
                spec = GrammarSpec.json_schema(self.response_format.json_schema.json_schema,
                                               "response_format.json_schema.schema")
        if self.structured_outputs is not None:
            if spec is not None:
                raise OpenAIError("response_format and structured_outputs cannot both constrain the output",
                                  param="structured_outputs")
            try:
                spec = self.structured_outputs.spec()
            except StructuredOutputError as exc:
                raise OpenAIError(str(exc), param=exc.param) from None
        conflict = structured_conflict(spec, self.ignore_eos, self.allowed_token_ids)
        if conflict is not None:
            raise OpenAIError(conflict[1], param=conflict[0])
        return spec

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats: every streamed chunk carries the usage so far."""
        return bool(self.include_usage and self.stream_options.continuous_usage_stats)


class CompletionRequest(_RequestFields):
    """prompt: a string, a list of strings, token ids, or a list of token-id lists (one choice
    per prompt, n per prompt with n > 1). `prompts` gives them as a list either way."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0, description="0 with echo: the prompt alone, as vLLM")
    echo: bool = False
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                       description="log-probability of each token and this many alternatives")
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                              description="vLLM: the prompt tokens' log-probabilities")

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt, a string or token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt position, or None for no prompt log-probabilities: vLLM's
        prompt_logprobs, else echo's `logprobs` (as vLLM derives it)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        # Checked by hand: a union's errors would name its members, not what is wrong.
        def token_ids(item: Any) -> bool:
            return isinstance(item, list) and all(type(t) is int and t >= 0 for t in item)

        if isinstance(value, str):
            return _valid_unicode(value)
        if not isinstance(value, list) or not value:
            raise ValueError("prompt must be a string, a list of strings, token ids or a list of token-id lists")
        if token_ids(value):
            return value
        if len(value) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        if all(isinstance(item, str) for item in value):
            return [_valid_unicode(item) for item in value]
        if all(token_ids(item) for item in value):
            return value
        raise ValueError("prompt must be a string, a list of strings, token ids (non-negative integers) "
                         "or a list of token-id lists")

    @model_validator(mode="after")
    def _zero_tokens_only_with_echo(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens may be 0 only with echo: true (the prompt alone is returned)")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available when stream is true (as in vLLM)")
        return self


def _text_of_parts(value: Any) -> Any:
    """Content as a list of parts -> the text parts joined by newlines (as vLLM); others refused."""
    if not isinstance(value, list):
        return value
    texts = []
    for part in value:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"only text content parts ({{'type': 'text', 'text': ...}}) are served, got {kind!r}"
                             if isinstance(kind, str) else "content parts must be {'type': 'text', 'text': ...}")
        if set(part) - {"type", "text"}:
            raise ValueError(f"unsupported keys in a text content part: {sorted(set(part) - {'type', 'text'})}")
        texts.append(part["text"])
    return "\n".join(texts)


class ChatMessage(BaseModel):
    """One message. `developer` is OpenAI's newer name for `system` and is rendered as such;
    `tool` / `function` messages answer tool calls, which are not served, so they are refused."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: Text
    name: Text | None = None                        # accepted, not rendered

    @field_validator("content", mode="before")
    @classmethod
    def _parts_to_text(cls, value: Any) -> Any:
        return _text_of_parts(value)

    @property
    def template_role(self) -> str:
        return "system" if self.role == "developer" else self.role


class ChatCompletionRequest(_RequestFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Any = None
    chat_template: Text | None = Field(None, description="vLLM extension: a Jinja template used instead of "
                                       "the model's")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="vLLM extension: extra variables "
                                                        "for the template (e.g. Llama-3's date_string)")
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    prompt_logprobs: Any = None

    @field_validator(*_CHAT_ONLY_NEUTRAL)
    @classmethod
    def _chat_neutral_only(cls, value: Any, info) -> Any:
        return _check_neutral(info.field_name, value, _CHAT_ONLY_NEUTRAL[info.field_name])

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
