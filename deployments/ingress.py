"""OpenAI-compatible HTTP ingress: validate, tokenize, hand the request to the router, stream back.

No `from __future__ import annotations` here: FastAPI must see real classes on the class-based routes
to treat request models as JSON bodies.

Routes: POST /v1/completions, POST /v1/chat/completions (``stream: true`` = SSE chunks in
OpenAI's format, ending with ``data: [DONE]``), GET /v1/models, GET /health. Responses carry the
usual ``usage`` plus a ``speculation`` field with the request's acceptance statistics.
"""

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from transformers import AutoConfig, AutoTokenizer

from cluster.config import SpecServeConfig
from decoding.sampling import SamplingParams
from deployments.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    error_body,
    new_id,
    now,
)

# Used when the tokenizer ships no chat template (the default pair is a code model and has none).
DEFAULT_CHAT_TEMPLATE = "{role}: {content}\n"
DEFAULT_CHAT_SUFFIX = "assistant:"

app = FastAPI(title="specserve", description="OpenAI-compatible speculative decoding on Ray Serve")


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    message = f"{'.'.join(location) or 'body'}: {first.get('msg', 'invalid request')}"
    return JSONResponse(status_code=400, content=error_body(message, param=".".join(location) or None))


@app.exception_handler(OpenAIError)
async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    return JSONResponse(status_code=exc.status_code, content=error_body(exc.message, exc.error_type, exc.param))


@app.exception_handler(Exception)
async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    # Generation failed for a reason the client cannot fix (e.g. no target replica came back).
    return JSONResponse(status_code=500, content=error_body(f"generation failed: {exc}", error_type="server_error"))


def _sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


@serve.deployment
@serve.ingress(app)
class Ingress:
    def __init__(self, config: dict, router: DeploymentHandle) -> None:
        self.config = SpecServeConfig.model_validate(config)
        self.router = router
        self.tokenizer = AutoTokenizer.from_pretrained(self.config.resolved_tokenizer_path, local_files_only=True)
        self.max_context = AutoConfig.from_pretrained(self.config.target.path,
                                                      local_files_only=True).max_position_embeddings

    @app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

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
        if body.max_completion_tokens is not None and body.max_tokens is None:
            body.max_tokens = body.max_completion_tokens
        prompt = self._chat_prompt([m.model_dump() for m in body.messages])
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
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
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
        if body.max_tokens is not None and body.max_tokens > limit:
            raise OpenAIError(f"max_tokens must be at most {limit}", param="max_tokens")
        max_tokens = body.max_tokens or min(self.config.limits.default_max_tokens, room)
        if num_prompt_tokens + max_tokens > self.max_context:
            raise OpenAIError(f"This model's maximum context length is {self.max_context} tokens; you requested "
                              f"{num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the prompt, "
                              f"{max_tokens} in the completion)", param="max_tokens")
        return SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                              seed=body.seed, max_tokens=max_tokens, stop=body.stop)

    async def _respond(self, body, prompt_ids: list[int], kind: str, echo_prefix: str = ""):
        params = self._sampling_params(body, len(prompt_ids))
        request_id = new_id("cmpl" if kind == "text_completion" else "chatcmpl")
        chunks = self.router.options(stream=True).generate.remote(request_id, prompt_ids, params.model_dump())
        if body.stream:
            return StreamingResponse(self._stream(chunks, request_id, kind, body.model, echo_prefix),
                                     media_type="text/event-stream")
        text, final = echo_prefix, {}
        async for chunk in chunks:
            text += chunk["text"]
            final = chunk
        choice: dict[str, Any] = {"index": 0, "finish_reason": final.get("finish_reason"), "logprobs": None}
        if kind == "text_completion":
            choice["text"] = text
        else:
            choice["message"] = {"role": "assistant", "content": text}
        return {"id": request_id, "object": kind, "created": now(), "model": body.model, "choices": [choice],
                "usage": final.get("usage"), "speculation": final.get("speculation")}

    async def _stream(self, chunks, request_id: str, kind: str, model: str, echo_prefix: str) -> AsyncIterator[str]:
        object_name = "text_completion" if kind == "text_completion" else "chat.completion.chunk"
        created = now()

        def event(text: str | None, finish_reason: str | None, **extra: Any) -> str:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
            if kind == "text_completion":
                choice["text"] = text or ""
            else:
                choice["delta"] = {} if text is None else {"content": text}
            return _sse({"id": request_id, "object": object_name, "created": created, "model": model,
                         "choices": [choice], **extra})

        try:
            if kind != "text_completion":
                yield _sse({"id": request_id, "object": object_name, "created": created, "model": model,
                            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None, "logprobs": None}]})
            if echo_prefix:
                yield event(echo_prefix, None)
            async for chunk in chunks:
                if "usage" in chunk:
                    yield event(chunk["text"] or None, chunk["finish_reason"], usage=chunk["usage"],
                                speculation=chunk["speculation"])
                elif chunk["text"]:
                    yield event(chunk["text"], None)
            yield _sse("[DONE]")
        except Exception as exc:  # the stream has started: report in-band, as OpenAI does
            yield _sse(error_body(f"generation failed: {exc}", error_type="server_error"))
        finally:
            chunks.cancel()  # client disconnect or error: the router releases worker state
