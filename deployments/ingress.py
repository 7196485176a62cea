"""OpenAI-compatible HTTP ingress: validate, tokenize, hand the request to the router, stream back.

No `from __future__ import annotations` here: FastAPI must see real classes on the class-based routes
to treat request models as JSON bodies.

Routes: POST /v1/completions, POST /v1/chat/completions (``stream: true`` = SSE chunks in
OpenAI's format, ending with ``data: [DONE]``), GET /v1/models, GET /health. Responses carry the
usual ``usage`` plus a ``speculation`` field with the request's acceptance statistics.

Every client error is a 4xx with OpenAI's {"error": {...}} body, never a 5xx: which fields are
served, ignored or refused is decided in deployments/openai_protocol.py. With ``auth.api_keys``
set, every /v1/* path needs ``Authorization: Bearer <key>`` (checked before the body is read);
/health stays open for load balancers and Serve's health checks.
"""

import json
import math
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import AutoConfig, AutoTokenizer

from cluster.config import SpecServeConfig
from decoding.sampling import SamplingParams
from deployments.admission import ServerOverloadedError
from deployments.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    authorization_error,
    error_body,
    new_id,
    now,
    validation_error_body,
)

# Used when the tokenizer ships no chat template (the default pair is a code model and has none).
DEFAULT_CHAT_TEMPLATE = "{role}: {content}\n"
DEFAULT_CHAT_SUFFIX = "assistant:"

app = FastAPI(title="specserve", description="OpenAI-compatible speculative decoding on Ray Serve")


@app.middleware("http")
async def _require_api_key(request: Request, call_next):
    # A middleware, not a route dependency: it runs before the body is parsed (a stranger learns
    # nothing about the schema) and covers every /v1/* path, unknown ones included.
    if request.url.path.startswith("/v1/"):
        ingress = serve.get_replica_context().servable_object
        refusal = authorization_error(request.headers.get("authorization"), ingress.api_key_digests)
        if refusal is not None:
            return JSONResponse(status_code=401, content=refusal, headers={"WWW-Authenticate": "Bearer"})
    return await call_next(request)


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
        cause = getattr(exc, "cause", None) or exc  # Ray wraps the router's exception
        raise OpenAIError(str(cause), status_code=503, error_type="server_error", code="server_overloaded",
                          headers={"Retry-After": str(max(1, math.ceil(cause.retry_after_s)))}) from None
    except BaseException:
        chunks.cancel()
        raise


async def _prepend(first: dict, chunks) -> AsyncIterator[dict]:
    yield first
    if "usage" not in first:
        async for chunk in chunks:
            yield chunk


def _sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


@serve.deployment
@serve.ingress(app)
class Ingress:
    def __init__(self, config: dict, router: DeploymentHandle) -> None:
        self.config = SpecServeConfig.model_validate(config)
        self.api_key_digests = self.config.auth.key_digests()
        self.router = router
        self.tokenizer = AutoTokenizer.from_pretrained(self.config.resolved_tokenizer_path, local_files_only=True)
        self.max_context = AutoConfig.from_pretrained(self.config.target.path,
                                                      local_files_only=True).max_position_embeddings

    @app.get("/health")
    async def health(self) -> JSONResponse:
        """200 "ok", 200 "degraded" (no draft engine answers: requests run target-only) or 503
        "unavailable" (no target engine answers), with each pool's state."""
        try:
            health = await self.router.pool_health.remote()
        except Exception as exc:  # the router itself is down
            health = {"status": "unavailable", "pools": {}, "error": str(exc)}
        return JSONResponse(status_code=503 if health["status"] == "unavailable" else 200, content=health)

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.config.model_name, "object": "model", "created": 0,
                                            "owned_by": "specserve", "max_model_len": self.max_context}]}

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        prompt_ids = self._encode(body.prompt)
        return await self._respond(body, prompt_ids, kind="text_completion",
                                   echo_prefix=body.prompt if body.echo else "")

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest):
        prompt = self._chat_prompt([{"role": m.template_role, "content": m.content} for m in body.messages])
        return await self._respond(body, self._encode(prompt), kind="chat.completion")

    # -- helpers ---------------------------------------------------------------------------
    def _encode(self, prompt: str) -> list[int]:
        if not prompt:
            raise OpenAIError("prompt must not be empty", param="prompt")
        if len(prompt) > self.config.limits.max_prompt_chars:
            raise OpenAIError(f"prompt is longer than {self.config.limits.max_prompt_chars} characters",
                              param="prompt")
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def _chat_prompt(self, messages: list[dict[str, str]]) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            try:
                return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception as exc:  # templates raise on what they cannot render (e.g. role order)
                raise OpenAIError(f"messages cannot be rendered with this model's chat template: {exc}",
                                  param="messages") from None
        return "".join(DEFAULT_CHAT_TEMPLATE.format(**m) for m in messages) + DEFAULT_CHAT_SUFFIX

    def _sampling_params(self, body: CompletionRequest | ChatCompletionRequest, num_prompt_tokens: int) -> SamplingParams:
        if body.model != self.config.model_name:
            raise OpenAIError(f"The model '{body.model}' does not exist; this server serves "
                              f"'{self.config.model_name}'", param="model")
        room = self.max_context - num_prompt_tokens
        if room < 1:
            raise OpenAIError(f"This model's maximum context length is {self.max_context} tokens; the prompt "
                              f"has {num_prompt_tokens}", param="prompt")
        limit = self.config.limits.max_tokens
        requested = body.requested_max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        if requested is not None and requested > limit:
            raise OpenAIError(f"{param} must be at most {limit}", param=param)
        max_tokens = requested or min(self.config.limits.default_max_tokens, room)
        if num_prompt_tokens + max_tokens > self.max_context:
            raise OpenAIError(f"This model's maximum context length is {self.max_context} tokens; you requested "
                              f"{num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the prompt, "
                              f"{max_tokens} in the completion)", param=param)
        if body.min_tokens > max_tokens:
            raise OpenAIError(f"min_tokens ({body.min_tokens}) must not exceed max_tokens ({max_tokens})",
                              param="min_tokens")
        try:
            return SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                                  seed=body.seed, max_tokens=max_tokens, stop=body.stop,
                                  ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
                                  repetition_penalty=body.repetition_penalty,
                                  presence_penalty=body.presence_penalty,
                                  frequency_penalty=body.frequency_penalty, min_p=body.min_p,
                                  logprobs=body.num_logprobs)
        except ValidationError as exc:  # the request models share these limits: a bug if it happens
            raise OpenAIError(validation_error_body(exc.errors())["error"]["message"]) from None

    async def _respond(self, body, prompt_ids: list[int], kind: str, echo_prefix: str = ""):
        params = self._sampling_params(body, len(prompt_ids))
        request_id = new_id("cmpl" if kind == "text_completion" else "chatcmpl")
        chunks = self.router.options(stream=True).generate.remote(request_id, prompt_ids, params.model_dump())
        first = await _first_chunk(chunks)  # before any byte goes out, so overload can still be a 503
        if body.stream:
            return StreamingResponse(self._stream(first, chunks, request_id, kind, body.model, echo_prefix,
                                                  body.include_usage, params.logprobs is not None),
                                     media_type="text/event-stream")
        text, final, entries = echo_prefix, {}, []
        async for chunk in _prepend(first, chunks):
            text += chunk["text"]
            entries += chunk.get("logprobs", [])
            final = chunk
        logprobs = None if params.logprobs is None else self._logprobs(kind, entries, len(echo_prefix))
        choice: dict[str, Any] = {"index": 0, "finish_reason": final.get("finish_reason"), "logprobs": logprobs}
        if kind == "text_completion":
            choice["text"] = text
        else:
            choice["message"] = {"role": "assistant", "content": text}
        return {"id": request_id, "object": kind, "created": now(), "model": body.model, "choices": [choice],
                "usage": final.get("usage"), "speculation": final.get("speculation")}

    def _logprobs(self, kind: str, entries: list[dict], text_offset: int = 0) -> dict[str, Any]:
        """Router entries ({token_id, logprob, top: [(id, logprob)]}) in OpenAI's shape: completions'
        tokens / token_logprobs / top_logprobs / text_offset, or chat's content list."""
        def text_of(token_id: int) -> str:
            return self.tokenizer.decode([token_id])

        if kind == "text_completion":
            tokens = [text_of(e["token_id"]) for e in entries]
            offsets = []
            for token in tokens:
                offsets.append(text_offset)
                text_offset += len(token)
            return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
                    "top_logprobs": [{text_of(i): lp for i, lp in e["top"]} for e in entries], "text_offset": offsets}

        def item(token_id: int, logprob: float) -> dict[str, Any]:
            token = text_of(token_id)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", "replace"))}

        return {"content": [{**item(e["token_id"], e["logprob"]), "top_logprobs": [item(i, lp) for i, lp in e["top"]]}
                            for e in entries], "refusal": None}

    async def _stream(self, first: dict, chunks, request_id: str, kind: str, model: str, echo_prefix: str,
                      include_usage: bool = False, with_logprobs: bool = False) -> AsyncIterator[str]:
        """SSE chunks. With stream_options.include_usage, as OpenAI: every chunk carries
        "usage": null and an extra last chunk with empty choices carries the usage; without it,
        the finishing chunk carries the usage (as before)."""
        object_name = "text_completion" if kind == "text_completion" else "chat.completion.chunk"
        created = now()
        usage_null = {"usage": None} if include_usage else {}

        def event(choices: list[dict[str, Any]], **extra: Any) -> str:
            return _sse({"id": request_id, "object": object_name, "created": created, "model": model,
                         "choices": choices, **usage_null, **extra})

        def choice(text: str | None, finish_reason: str | None, entries: list[dict] | None = None) -> dict[str, Any]:
            logprobs = self._logprobs(kind, entries or []) if with_logprobs and entries is not None else None
            body: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": logprobs}
            if kind == "text_completion":
                body["text"] = text or ""
            else:
                body["delta"] = {} if text is None else {"content": text}
            return body

        try:
            if kind != "text_completion":
                yield event([{"index": 0, "delta": {"role": "assistant", "content": ""},
                              "finish_reason": None, "logprobs": None}])
            if echo_prefix:
                yield event([choice(echo_prefix, None)])
            async for chunk in _prepend(first, chunks):
                if "usage" in chunk:
                    finish = choice(chunk["text"] or None, chunk["finish_reason"], chunk.get("logprobs"))
                    if include_usage:
                        yield event([finish], speculation=chunk["speculation"])
                        yield event([], usage=chunk["usage"])
                    else:
                        yield event([finish], usage=chunk["usage"], speculation=chunk["speculation"])
                elif chunk["text"] or chunk.get("logprobs"):
                    yield event([choice(chunk["text"], None, chunk.get("logprobs"))])
            yield _sse("[DONE]")
        except Exception as exc:  # the stream has started: report in-band, as OpenAI does
            yield _sse(error_body(f"generation failed: {exc}", error_type="server_error"))
        finally:
            chunks.cancel()  # client disconnect or error: the router releases worker state
