"""OpenAI-compatible HTTP ingress: validate, tokenize, hand the request to the router, stream back.

No `from __future__ import annotations` here: FastAPI must see real classes on the class-based routes
to treat request models as JSON bodies.

Routes: POST /v1/completions, POST /v1/chat/completions (``stream: true`` = SSE chunks in
OpenAI's format, ending with ``data: [DONE]``), GET /v1/models, GET /health. Responses carry the
usual ``usage`` plus a ``speculation`` field with the request's acceptance statistics. Each choice
(one per prompt, times n) is its own sequence on the router, all started at once so the engines
batch them; docs/api.md has the field table and how choices are numbered and seeded.

Every client error is a 4xx with OpenAI's {"error": {...}} body, never a 5xx: which fields are
served, ignored or refused is decided in deployments/openai_protocol.py. With ``auth.api_keys``
set, every /v1/* path needs ``Authorization: Bearer <key>`` (checked before the body is read);
/health stays open for load balancers and Serve's health checks.

One readiness truth: until every engine pool has answered once, nothing here answers 200: /health
says "starting" (503) and every other path, /v1/models included, answers 503 with Retry-After.
Serve routes to this replica as soon as it runs, long before the engines have loaded (or failed
to); a client that waits for /v1/models, as it would for vLLM, must not see a server that cannot
serve yet, or one whose start is about to fail.
"""

import asyncio
import functools
import json
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
import ray
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import AutoTokenizer

from specserve.common.config import SpecServeConfig
from specserve.decoding.checkpoint import GENERATION_DEFAULT_FIELDS, eos_token_ids, generation_defaults, max_model_len
from specserve.decoding.grammar import GrammarCompiler, GrammarDeadEndError, GrammarSpec, StructuredOutputError
from specserve.decoding.model_runner import output_width, served_vocab_size
from specserve.decoding.sampling import MAX_SEED, SamplingParams, check_min_tokens
from specserve.decoding.row_processors import bad_words_token_ids
from specserve.deployments.admission import ServerOverloadedError
from specserve.deployments.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    authorization_error,
    error_body,
    new_id,
    now,
    validation_error_body,
)
from specserve.deployments.streaming import StreamInbox

# Used when neither the config nor the tokenizer has a chat template.
DEFAULT_CHAT_TEMPLATE = "{role}: {content}\n"
DEFAULT_CHAT_SUFFIX = "assistant:"
# As vLLM's CompletionRequest: a completion without max_tokens makes OpenAI's default 16 tokens
# (a chat runs to the rest of the context).
COMPLETION_DEFAULT_MAX_TOKENS = 16
STARTING_RETRY_AFTER_S = 5  # what a request refused while the engines load is told to wait
READINESS_CHECK_S = 3.0  # how long a request before readiness waits for the router's verdict
UNHEALTHY = ("starting", "unavailable")  # /health statuses answered 503
# Template variables a request's chat_template_kwargs may not replace.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "conversation", "tokenize", "add_generation_prompt",
                                         "chat_template", "tools", "documents", "return_dict"})

app = FastAPI(title="specserve", description="OpenAI-compatible speculative decoding on Ray Serve")


class _Admission:
    """The API key on /v1/*, then readiness everywhere but /health (which says "starting" itself).

    Middleware, not a route dependency: it runs before the body is parsed (a stranger learns
    nothing about the schema) and covers every path, unknown ones included. Plain ASGI, not
    Starlette's BaseHTTPMiddleware, which would relay every chunk of a streamed answer through a
    memory stream and a task of its own."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            refusal = await self._refusal(scope["path"], Headers(scope=scope))
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    @staticmethod
    async def _refusal(path: str, headers: Headers) -> JSONResponse | None:
        ingress = serve.get_replica_context().servable_object
        if path.startswith("/v1/"):
            refusal = authorization_error(headers.get("authorization"), ingress.api_key_digests)
            if refusal is not None:
                return JSONResponse(status_code=401, content=refusal, headers={"WWW-Authenticate": "Bearer"})
        starting = not ingress.serving and path != "/health"
        if starting and (await ingress.health_report())["status"] == "starting":
            return JSONResponse(status_code=503, headers={"Retry-After": str(STARTING_RETRY_AFTER_S)},
                                content=error_body("specserve is starting: the engines are still loading",
                                                   error_type="service_unavailable"))
        return None


app.add_middleware(_Admission)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse(status_code=400, content=validation_error_body(list(exc.errors())))


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = (f"Invalid URL ({request.method} {request.url.path})" if exc.status_code in (404, 405)
               else str(exc.detail))
    return JSONResponse(status_code=exc.status_code, content=error_body(message), headers=exc.headers)


@app.exception_handler(OpenAIError)
async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    return JSONResponse(status_code=exc.status_code, headers=exc.headers,
                        content=error_body(exc.message, exc.error_type, exc.param, exc.code))


@app.exception_handler(Exception)
async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    # Generation failed for a reason the client cannot fix (e.g. no target replica came back).
    return JSONResponse(status_code=500, content=error_body(f"generation failed: {exc}", error_type="server_error"))


async def _first_chunk(chunks) -> dict:
    """The router's first chunk; a refusal for lack of capacity becomes HTTP 503 with Retry-After."""
    try:
        return await chunks.__anext__()
    except ServerOverloadedError as exc:
        chunks.cancel()
        cause = _cause(exc, ServerOverloadedError) or exc
        raise OpenAIError(str(cause), status_code=503, error_type="server_error", code="server_overloaded",
                          headers={"Retry-After": str(max(1, math.ceil(cause.retry_after_s)))}) from None
    except BaseException as exc:
        chunks.cancel()
        _raise_client_error(exc)
        raise


def _raise_client_error(exc: BaseException) -> None:
    """An error generation hit that the client can fix, as a 400: a grammar that allows nothing."""
    dead_end = _cause(exc, GrammarDeadEndError)
    if dead_end is not None:
        raise OpenAIError(str(dead_end), param=dead_end.param) from None


def _cause(exc: BaseException, kind: type) -> BaseException | None:
    """exc or the error it wraps (Ray wraps an engine's error at each hop: engine, router) if it is a kind."""
    while exc is not None:
        if isinstance(exc, kind) and not hasattr(exc, "cause"):
            return exc
        exc = getattr(exc, "cause", None)
    return None


async def _first_chunks(streams: list) -> list[dict]:
    """Every choice's first chunk; if one fails (e.g. 503), every stream is cancelled and it raises."""
    results = await asyncio.gather(*(_first_chunk(stream) for stream in streams), return_exceptions=True)
    failure = next((result for result in results if isinstance(result, BaseException)), None)
    if failure is not None:
        for stream in streams:
            stream.cancel()
        raise failure
    return results


async def _prepend(first: dict, chunks) -> AsyncIterator[dict]:
    yield first
    if "usage" not in first:
        async for chunk in chunks:
            yield chunk


def _sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


@dataclass(frozen=True)
class Choice:
    """One sequence the router generates: choice `index` of the response (prompt i's n choices
    are i*n .. i*n+n-1, as vLLM numbers them)."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    echo: str = ""                       # the prompt's text, when echoed
    prompt_logprobs: int | None = None   # alternatives per prompt position, if the prompt's logprobs are wanted
    prompt_only: bool = False            # max_tokens 0 with echo: the generated token is dropped


@dataclass
class ChoiceOutput:
    """One choice's collected answer: generated text, its logprob entries, the prompt's (if
    asked) and the router's final chunk (finish reason, usage, speculation)."""

    text: str
    entries: list[dict]
    prompt_entries: list[dict]
    final: dict


def choice_seed(seed: int | None, choice: int) -> int | None:
    """Choice j of a seeded request samples with seed + j (vLLM's rule for n > 1), so choice j
    reproduces a single request with that seed; wrapped into the seed range."""
    return None if seed is None else (seed + choice) % (MAX_SEED + 1)


def _usage(choices: list[Choice], usages: list[dict | None]) -> dict[str, Any]:
    """Usage summed as vLLM sums it: each prompt's tokens once, every choice's completion tokens;
    cached_tokens (prompt tokens the target's prefix cache held) once per prompt too, its first
    choice's."""
    prompt_tokens = sum(len(ids) for ids in {c.prompt_index: c.prompt_ids for c in choices}.values())
    completion_tokens = sum(0 if choice.prompt_only or usage is None else usage["completion_tokens"]
                            for choice, usage in zip(choices, usages))
    cached = {}
    for choice, usage in zip(choices, usages):
        if usage is not None:
            cached.setdefault(choice.prompt_index, usage.get("prompt_tokens_details", {}).get("cached_tokens", 0))
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}


async def _collect(first: dict, chunks) -> ChoiceOutput:
    """One choice's whole answer from its router stream."""
    output = ChoiceOutput("", [], first.get("prompt_logprobs", []), {})
    async for chunk in _prepend(first, chunks):
        output.text += chunk["text"]
        output.entries += chunk.get("logprobs", [])
        output.final = chunk
    return output


async def _pump(position: int, first: dict, chunks, queue: asyncio.Queue) -> None:
    """Put one choice's chunks on the queue as (position, chunk), then (position, None) or an error."""
    try:
        async for chunk in _prepend(first, chunks):
            queue.put_nowait((position, chunk))
        queue.put_nowait((position, None))
    except Exception as exc:
        queue.put_nowait((position, exc))


@serve.deployment
@serve.ingress(app)
class Ingress:
    def __init__(self, config: dict, router: DeploymentHandle) -> None:
        self.config = SpecServeConfig.model_validate(config)
        self.api_key_digests = self.config.auth.key_digests()
        self.router = router
        # Routers push each request's chunks here over their channels (deployments.streaming).
        self.streams = StreamInbox(ray.util.get_node_ip_address, self.config.http.stream_interval_ms / 1000)
        self.tokenizer = AutoTokenizer.from_pretrained(self.config.resolved_tokenizer_path, local_files_only=True)
        self.max_context = max_model_len(self.config.target.path, self.config.target.max_model_len)
        self.generation_defaults = generation_defaults(self.config.target.path)
        self.chat_template = self.config.resolved_chat_template
        # Ids a token-id prompt may hold: the tokenizer's (padding rows of the embedding are not tokens).
        self.vocab_size = served_vocab_size(self.tokenizer, output_width(self.config.target.path))
        self._grammar_compiler: GrammarCompiler | None = None  # built on the first structured request
        self.serving = False  # every engine pool has answered once: /v1/* is open

    async def health_report(self) -> dict[str, Any]:
        """The router's pool report (deployments.pool_health); "starting" while no router answers
        within READINESS_CHECK_S before this replica has served (the router's own first wait)."""
        try:
            ask = self.router.pool_health.remote()
            health = await (ask if self.serving else asyncio.wait_for(ask, READINESS_CHECK_S))
        except asyncio.TimeoutError:
            health = {"status": "starting", "pools": {}}
        except Exception as exc:  # the router itself is down
            health = {"status": "starting" if not self.serving else "unavailable", "pools": {}, "error": str(exc)}
        self.serving = self.serving or health["status"] != "starting"
        return health

    @app.get("/health")
    async def health(self) -> JSONResponse:
        """200 "ok", 200 "degraded" (no draft engine answers: requests run target-only), 503
        "unavailable" (no target engine answers) or 503 "starting" (not every pool has answered
        yet), with each pool's state."""
        health = await self.health_report()
        return JSONResponse(status_code=503 if health["status"] in UNHEALTHY else 200, content=health)

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.config.model_name, "object": "model", "created": 0,
                                            "owned_by": "specserve", "max_model_len": self.max_context}]}

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        structured = await self._structured(body)
        choices = []
        for prompt in body.prompts:  # as vLLM, the tokenizer decides BOS (Llama's and Mistral's add theirs)
            prompt_ids = self._encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else self._checked_ids(prompt)
            echo = "" if not body.echo else prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)
            choices += self._choices(body, prompt_ids, len(choices), echo, structured)
        return await self._respond(body, choices, kind="text_completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest):
        structured = await self._structured(body)
        prompt = self._chat_prompt([{"role": m.template_role, "content": m.content} for m in body.messages],
                                   body.chat_template, body.chat_template_kwargs or {})
        # The rendered template holds its special tokens (Llama's writes bos_token): encoding it
        # with special tokens again would double the BOS. These ids go to draft and target alike.
        prompt_ids = self._encode(prompt, add_special_tokens=False)
        return await self._respond(body, self._choices(body, prompt_ids, 0, structured=structured),
                                   kind="chat.completion")

    # -- helpers ---------------------------------------------------------------------------
    async def _structured(self, body: CompletionRequest | ChatCompletionRequest) -> GrammarSpec | None:
        """The request's grammar, compiled once to check it (400 naming the field if it does not
        compile). Compiling runs in a worker thread: a large schema must not stall every other
        request on this replica's event loop; the compiler caches what it has checked."""
        spec = body.structured_spec()
        if spec is not None:
            try:
                await asyncio.get_running_loop().run_in_executor(None, self._validate_grammar, spec)
            except StructuredOutputError as exc:
                raise OpenAIError(str(exc), param=exc.param) from None
        return spec

    def _validate_grammar(self, spec: GrammarSpec) -> None:
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size,
                                                     sorted(eos_token_ids(self.config.target.path, self.tokenizer)))
        self._grammar_compiler.validate(spec)

    def _encode(self, prompt: str, add_special_tokens: bool) -> list[int]:
        if not prompt:
            raise OpenAIError("prompt must not be empty", param="prompt")
        if len(prompt) > self.config.limits.max_prompt_chars:
            raise OpenAIError(f"prompt is longer than {self.config.limits.max_prompt_chars} characters",
                              param="prompt")
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def _chat_prompt(self, messages: list[dict[str, str]], template: str | None = None,
                     template_kwargs: dict[str, Any] | None = None) -> str:
        """The conversation rendered once with the target's tokenizer: the request's template, else
        the config's (chat_template), else the tokenizer's own."""
        template = template or self.chat_template
        reserved = sorted(RESERVED_TEMPLATE_VARIABLES & set(template_kwargs or {}))
        if reserved:
            raise OpenAIError(f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs")
        if template or getattr(self.tokenizer, "chat_template", None):
            try:
                return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                          chat_template=template, **(template_kwargs or {}))
            except Exception as exc:  # templates raise on what they cannot render (e.g. role order)
                raise OpenAIError(f"messages cannot be rendered with this model's chat template: {exc}",
                                  param="messages") from None
        return "".join(DEFAULT_CHAT_TEMPLATE.format(**m) for m in messages) + DEFAULT_CHAT_SUFFIX

    def _checked_ids(self, prompt_ids: list[int]) -> list[int]:
        """A token-id prompt, checked like a text one: not empty, every id in the vocabulary."""
        if not prompt_ids:
            raise OpenAIError("prompt must not be empty", param="prompt")
        if max(prompt_ids) >= self.vocab_size:
            raise OpenAIError(f"token id {max(prompt_ids)} is out of the vocabulary (size {self.vocab_size})",
                              param="prompt")
        return list(prompt_ids)

    def _choices(self, body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int], first_index: int,
                 echo: str = "", structured: GrammarSpec | None = None) -> list[Choice]:
        """The body.n choices of one prompt, indexed from first_index (prompt i's are i*n .. i*n+n-1)."""
        params = self._sampling_params(body, len(prompt_ids), structured)
        prompt_logprobs = getattr(body, "num_prompt_logprobs", None)
        return [Choice(first_index + j, first_index // body.n, prompt_ids,
                       params.model_copy(update={"seed": choice_seed(params.seed, j)}), echo, prompt_logprobs,
                       prompt_only=body.requested_max_tokens == 0)
                for j in range(body.n)]

    def _sampling_fields(self, body: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
        """The request's sampling fields over the target's generation_config.json defaults: a field
        the request leaves out (or sends as null) takes the default, as vLLM's --generation-config auto."""
        fields = {name: getattr(body, name) for name in GENERATION_DEFAULT_FIELDS}
        return {**fields, **{name: value for name, value in self.generation_defaults.items()
                             if name not in body.model_fields_set}}

    def _max_tokens(self, body: CompletionRequest | ChatCompletionRequest, num_prompt_tokens: int) -> int:
        """max_tokens as vLLM: at most max_model_len - prompt (else 400 with vLLM's message); left
        out: the rest of the context for chat, 16 for completions (limits.default_max_tokens when set)."""
        room = self.max_context - num_prompt_tokens
        if room < 1:
            raise OpenAIError(f"This model's maximum context length is {self.max_context} tokens. However, your "
                              f"request has {num_prompt_tokens} input tokens. Please reduce the length of the "
                              "input messages.", param="messages" if hasattr(body, "messages") else "prompt")
        requested = body.requested_max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        limit = self.config.limits.max_tokens
        if requested is not None and limit is not None and requested > limit:
            raise OpenAIError(f"{param} must be at most {limit}", param=param)
        if requested == 0:  # echo of the prompt alone still prefills, as vLLM: one token made and dropped
            return 1
        if requested is None:
            default = self.config.limits.default_max_tokens
            if default is None:
                default = COMPLETION_DEFAULT_MAX_TOKENS if isinstance(body, CompletionRequest) else room
            return min(default, room)
        if num_prompt_tokens + requested > self.max_context:
            raise OpenAIError(f"This model's maximum context length is {self.max_context} tokens. However, you "
                              f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the "
                              f"messages, {requested} in the completion). Please reduce the length of the "
                              "messages or completion.", param=param)
        return requested

    def _encode_plain(self, text: str) -> list[int]:
        """text's token ids without special tokens (a bad word's, as vLLM tokenizes it)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _sampling_params(self, body: CompletionRequest | ChatCompletionRequest, num_prompt_tokens: int,
                         structured: GrammarSpec | None = None) -> SamplingParams:
        if body.model != self.config.model_name:
            raise OpenAIError(f"The model '{body.model}' does not exist; this server serves "
                              f"'{self.config.model_name}'", param="model")
        max_tokens = self._max_tokens(body, num_prompt_tokens)
        for param, token_ids in (("stop_token_ids", body.stop_token_ids), ("logit_bias", body.logit_bias),
                                 ("allowed_token_ids", body.allowed_token_ids or ())):
            unknown = sorted(token for token in token_ids if token >= len(self.tokenizer))
            if unknown:
                raise OpenAIError(f"{param} names {unknown}, not ids of this model's tokenizer "
                                  f"({len(self.tokenizer)} ids)", param=param)
        try:
            check_min_tokens(body.min_tokens, max_tokens)
        except ValueError as exc:
            raise OpenAIError(str(exc), param="min_tokens") from None
        try:
            return SamplingParams(**self._sampling_fields(body), seed=body.seed, max_tokens=max_tokens,
                                  stop=body.stop, ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
                                  presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                                  stop_token_ids=body.stop_token_ids,
                                  include_stop_str_in_output=body.include_stop_str_in_output,
                                  logit_bias=body.logit_bias, allowed_token_ids=body.allowed_token_ids,
                                  bad_words_token_ids=bad_words_token_ids(body.bad_words, self._encode_plain),
                                  logprobs=body.num_logprobs, structured=structured)
        except ValidationError as exc:  # the request models share these limits: a bug if it happens
            raise OpenAIError(validation_error_body(exc.errors())["error"]["message"]) from None

    async def _respond(self, body, choices: list[Choice], kind: str):
        """Start every choice on the router at once (the engines batch them), then answer."""
        request_id = new_id("cmpl" if kind == "text_completion" else "chatcmpl")
        streams = [await self.streams.open(functools.partial(
            self.router.generate.remote, request_id=request_id if len(choices) == 1 else f"{request_id}-{choice.index}",
            prompt_ids=choice.prompt_ids, params=choice.params.model_dump(), prompt_logprobs=choice.prompt_logprobs,
            cache_salt=body.cache_salt))
            for choice in choices]
        firsts = await _first_chunks(streams)  # before any byte goes out, so overload can still be a 503
        if body.stream:
            return StreamingResponse(self._stream(body, choices, firsts, streams, request_id, kind),
                                     media_type="text/event-stream")
        try:
            outputs = await asyncio.gather(*(_collect(first, stream) for first, stream in zip(firsts, streams)))
        except Exception as exc:
            _raise_client_error(exc)
            raise
        bodies = [self._choice_body(body, kind, choice, output) for choice, output in zip(choices, outputs)]
        if len(bodies) > 1:
            for choice_body, output in zip(bodies, outputs):
                choice_body["speculation"] = output.final.get("speculation")
        return {"id": request_id, "object": kind, "created": now(), "model": body.model, "choices": bodies,
                "usage": _usage(choices, [output.final.get("usage") for output in outputs]),
                "speculation": outputs[0].final.get("speculation")}

    def _choice_body(self, body, kind: str, choice: Choice, output: ChoiceOutput) -> dict[str, Any]:
        text = choice.echo + ("" if choice.prompt_only else output.text)
        entries = [] if choice.prompt_only else output.entries
        logprobs = None
        if choice.params.logprobs is not None:
            logprobs = self._logprobs(kind, output.prompt_entries + entries, body.return_tokens_as_token_ids) \
                if choice.echo else self._logprobs(kind, entries, body.return_tokens_as_token_ids, len(choice.echo))
        finish_reason = "length" if choice.prompt_only else output.final.get("finish_reason")
        answer: dict[str, Any] = {"index": choice.index, "finish_reason": finish_reason, "logprobs": logprobs}
        if kind == "text_completion":
            answer["text"] = text
            if getattr(body, "prompt_logprobs", None) is not None:
                answer["prompt_logprobs"] = self._vllm_prompt_logprobs(output.prompt_entries)
        else:
            answer["message"] = {"role": "assistant", "content": text}
        return answer

    def _vllm_prompt_logprobs(self, entries: list[dict]) -> list[dict | None]:
        """vLLM's prompt_logprobs: per prompt position None (the first) or {token id: {logprob, rank,
        decoded_token}} for the prompt's token and the top alternatives."""
        def item(logprob: float, rank: int, token_id: int) -> dict[str, Any]:
            return {"logprob": logprob, "rank": rank, "decoded_token": self.tokenizer.decode([token_id])}

        return [None if entry["logprob"] is None else {
            str(entry["token_id"]): item(entry["logprob"], entry["rank"], entry["token_id"]),
            **{str(i): item(lp, rank, i) for rank, (i, lp) in enumerate(entry["top"], start=1)
               if i != entry["token_id"]}} for entry in entries]

    def _logprobs(self, kind: str, entries: list[dict], as_token_ids: bool = False,
                  text_offset: int = 0) -> dict[str, Any]:
        """Router entries ({token_id, logprob, top: [(id, logprob)]}) in OpenAI's shape: completions'
        tokens / token_logprobs / top_logprobs / text_offset, or chat's content list. The prompt's
        first token has no log-probability (logprob None): its top_logprobs is None too, as vLLM.
        as_token_ids: vLLM's return_tokens_as_token_ids, tokens as "token_id:N"."""
        def text_of(token_id: int) -> str:
            return f"token_id:{token_id}" if as_token_ids else self.tokenizer.decode([token_id])

        def top_of(entry: dict) -> dict[str, float] | None:
            return None if entry["logprob"] is None else {text_of(i): lp for i, lp in entry["top"]}

        if kind == "text_completion":
            tokens = [text_of(e["token_id"]) for e in entries]
            offsets = []
            for token in tokens:
                offsets.append(text_offset)
                text_offset += len(token)
            return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
                    "top_logprobs": [top_of(e) for e in entries], "text_offset": offsets}

        def item(token_id: int, logprob: float) -> dict[str, Any]:
            token = text_of(token_id)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", "replace"))}

        return {"content": [{**item(e["token_id"], e["logprob"]), "top_logprobs": [item(i, lp) for i, lp in e["top"]]}
                            for e in entries], "refusal": None}

    async def _stream(self, body, choices: list[Choice], firsts: list[dict], streams: list, request_id: str,
                      kind: str) -> AsyncIterator[str]:
        """SSE chunks, each choice's as they come, with its `index`. With stream_options.include_usage,
        as OpenAI: every chunk carries "usage": null and an extra last chunk with empty choices carries
        the usage summed over choices; with vLLM's continuous_usage_stats as well, every chunk with a
        choice carries that choice's usage so far instead of null. Without include_usage, each
        choice's finishing chunk carries its usage (as before)."""
        object_name = "text_completion" if kind == "text_completion" else "chat.completion.chunk"
        created = now()
        include_usage, continuous = body.include_usage, body.continuous_usage
        as_token_ids = body.return_tokens_as_token_ids
        completion_tokens = [0] * len(choices)

        def usage_of(position: int) -> dict[str, Any]:
            if not continuous:
                return {"usage": None} if include_usage else {}
            prompt_tokens, generated = len(choices[position].prompt_ids), completion_tokens[position]
            return {"usage": {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                              "total_tokens": prompt_tokens + generated}}

        def event(position: int | None, choice_bodies: list[dict[str, Any]], **extra: Any) -> str:
            usage = {"usage": None} if position is None else usage_of(position)
            return _sse({"id": request_id, "object": object_name, "created": created, "model": body.model,
                         "choices": choice_bodies, **usage, **extra})

        def delta(position: int, text: str | None, finish_reason: str | None,
                  entries: list[dict] | None = None, text_offset: int = 0) -> dict[str, Any]:
            with_logprobs = choices[position].params.logprobs is not None and entries is not None
            logprobs = self._logprobs(kind, entries, as_token_ids, text_offset) if with_logprobs else None
            answer: dict[str, Any] = {"index": choices[position].index, "finish_reason": finish_reason,
                                      "logprobs": logprobs}
            if kind == "text_completion":
                answer["text"] = text or ""
            else:
                answer["delta"] = {} if text is None else {"content": text}
            return answer

        chunks: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.create_task(_pump(position, first, stream, chunks))
                 for position, (first, stream) in enumerate(zip(firsts, streams))]
        try:
            for position, choice in enumerate(choices):
                if kind != "text_completion":
                    yield event(position, [{"index": choice.index, "delta": {"role": "assistant", "content": ""},
                                            "finish_reason": None, "logprobs": None}])
                if choice.echo:
                    yield event(position, [delta(position, choice.echo, None,
                                                 firsts[position].get("prompt_logprobs", []))])
            usages, running = [None] * len(choices), len(choices)
            while running:
                position, chunk = await chunks.get()
                if isinstance(chunk, BaseException):
                    raise chunk
                choice = choices[position]
                if chunk is None:
                    running -= 1
                    continue
                if choice.prompt_only:  # the one token generated to prefill is not returned
                    chunk = {**chunk, "text": "", "token_ids": [], "logprobs": []}
                completion_tokens[position] += len(chunk["token_ids"])
                if "usage" in chunk:
                    usage = {**chunk["usage"], "completion_tokens": completion_tokens[position],
                             "total_tokens": chunk["usage"]["prompt_tokens"] + completion_tokens[position]}
                    usages[position] = usage
                    finish = delta(position, chunk["text"] or None,
                                   "length" if choice.prompt_only else chunk["finish_reason"], chunk.get("logprobs"))
                    if include_usage:
                        yield event(position, [finish], speculation=chunk["speculation"])
                    else:
                        yield event(position, [finish], usage=usage, speculation=chunk["speculation"])
                elif chunk["text"] or chunk.get("logprobs"):
                    yield event(position, [delta(position, chunk["text"], None, chunk.get("logprobs"))])
            if include_usage:
                yield _sse({"id": request_id, "object": object_name, "created": created, "model": body.model,
                            "choices": [], "usage": _usage(choices, usages)})
            yield _sse("[DONE]")
        except Exception as exc:  # the stream has started: report in-band, as OpenAI does
            yield _sse(error_body(f"generation failed: {exc}", error_type="server_error"))
        finally:
            for pump in pumps:
                pump.cancel()
            for stream in streams:
                stream.cancel()  # client disconnect or error: the router releases worker state
