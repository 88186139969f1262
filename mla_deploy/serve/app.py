"""The HTTP application: OpenAI's ``/v1/completions``, ``/v1/chat/completions`` (streamed as server-sent events or
not) and ``/v1/models``, with ``/health`` and ``/metrics``, over a :class:`~mla_deploy.serve.service.Service`.

:func:`create_app` returns a FastAPI (ASGI) app: ``mla-deploy serve`` runs it under uvicorn, and Ray Serve can
mount the same app on a deployment. Every refusal is OpenAI's error JSON with its status, never a traceback.
This module imports FastAPI: only the server (and its tests) load it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .metrics import Metrics
from .protocol import ApiError, ChatRequest, CompletionRequest, validation_error
from .service import Service, TextRequest


def create_app(service: Service):
    """The FastAPI app serving ``service`` (started and stopped with the app's lifespan)."""
    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.start()
        try:
            yield
        finally:
            await asyncio.to_thread(service.stop)

    app = FastAPI(title="mla-deploy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    service.metrics = metrics = Metrics(service.batcher, service.model_name)

    def error_reply(error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(ApiError)
    async def _api_error(request, error: ApiError):
        return error_reply(error)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, error: RequestValidationError):
        return error_reply(validation_error(list(error.errors())))

    @app.exception_handler(HTTPException)
    async def _http(request, error: HTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return error_reply(ApiError(error.status_code, str(error.detail), type=kind))

    @app.exception_handler(Exception)
    async def _unexpected(request, error: Exception):  # a bug of ours: the client still gets OpenAI's JSON
        return error_reply(ApiError(500, f"internal error: {type(error).__name__}: {error}", type="server_error"))

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        """The API key on ``/v1/*``, and the request counter."""
        path = request.url.path
        label = path if path in _ROUTES else "other"  # a bounded set of label values, whatever paths are asked
        if service.options.api_key and path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            expected = f"Bearer {service.options.api_key}"
            if not hmac.compare_digest(given.encode(), expected.encode()):
                reply = error_reply(ApiError(401, "Incorrect API key provided" if given else
                                             "You didn't provide an API key (Authorization: Bearer KEY)",
                                             code="invalid_api_key"))
                metrics.requests.labels(label, "401").inc()
                return reply
        reply = await call_next(request)
        metrics.requests.labels(label, str(reply.status_code)).inc()
        return reply

    @app.get("/health")
    async def health():
        problem = service.problem()
        if problem is not None:
            return JSONResponse({"status": "unavailable", "reason": problem, "instance": service.instance},
                                status_code=503)
        return {"status": "ok", "instance": service.instance}

    @app.get("/metrics")
    async def _metrics():
        body, kind = metrics.render()
        return Response(body, media_type=kind)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(service)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        _check_model(service, model)
        return _model_card(service)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check(service, body)
        prompts = _prompts(body.prompt)
        if body.stream and len(prompts) > 1:
            raise ApiError(400, "a streamed completion takes one prompt", param="prompt")
        sampling = service.sampling(body.temperature, body.top_p, body.top_k, body.seed)
        requests: list[TextRequest] = []
        try:
            for prompt in prompts:  # tokenized off the event loop: a long prompt does not stall the other streams
                ids = await asyncio.to_thread(service.prompt_ids, prompt)
                requests.append(service.generate(ids, service.max_new_tokens(len(ids), body.max_tokens), sampling,
                                                 body.stop))
        except ApiError:
            for started in requests:
                started.cancel()
            raise
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": service.model_name}
        if body.stream:
            return _sse(_completion_chunks(head, requests[0], _usage_wanted(body)))
        results = await _collect(requests, request)
        choices = [{"index": i, "text": text, "logprobs": None, "finish_reason": reason}
                   for i, (text, reason) in enumerate(results)]
        return {**head, "choices": choices, "usage": _usage(requests)}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        _check(service, body)
        ids = await asyncio.to_thread(service.chat_ids, body.template_messages())
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        sampling = service.sampling(body.temperature, body.top_p, body.top_k, body.seed)
        text_request = service.generate(ids, service.max_new_tokens(len(ids), asked), sampling, body.stop)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": service.model_name}
        if body.stream:
            return _sse(_chat_chunks({**head, "object": "chat.completion.chunk"}, text_request, _usage_wanted(body)))
        (text, reason), = await _collect([text_request], request)
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": reason}
        return {**head, "choices": [choice], "usage": _usage([text_request])}

    def _sse(chunks: AsyncIterator[dict]):
        async def events():
            try:
                async for chunk in chunks:
                    yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
            except ApiError as error:  # the reply has begun: the error is the stream's last event
                yield f"data: {json.dumps(error.body())}\n\n"
            except Exception as error:  # a bug of ours: still an error event, not a cut connection
                failure = ApiError(500, f"internal error: {type(error).__name__}: {error}", type="server_error")
                yield f"data: {json.dumps(failure.body())}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return _BodyLimit(app, service.options.max_body_bytes)


_ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")


def _model_card(service: Service) -> dict:
    return {"id": service.model_name, "object": "model", "created": service.created, "owned_by": "mla-deploy",
            "max_model_len": service.capacity}


def _check_model(service: Service, name: str) -> None:
    if name != service.model_name:
        raise ApiError(404, f"The model `{name}` does not exist; this server serves `{service.model_name}`",
                       param="model", code="model_not_found")


def _check(service: Service, body) -> None:
    """The model is ours, and the body asks for nothing this server does not do."""
    _check_model(service, body.model)
    unsupported = body.unsupported()
    if unsupported:
        field, why = unsupported[0]
        raise ApiError(400, why, param=field, code="unsupported_parameter")


def _prompts(prompt) -> list:
    """The completion's prompts: a string or a list of ids is one; a list of strings or of id lists is several."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        return [prompt]
    if isinstance(prompt, list) and not prompt:
        raise ApiError(400, "the prompt is empty", param="prompt")
    return list(prompt)


def _usage_wanted(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _usage(requests: list[TextRequest]) -> dict:
    prompt = sum(r.prompt_tokens for r in requests)
    completion = sum(r.tokens for r in requests)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _collect(requests: list[TextRequest], request) -> list[tuple[str, str]]:
    """Each request's whole text and finish reason; a client that disconnects first cancels them all."""

    async def one(text_request: TextRequest) -> tuple[str, str]:
        text, reason = [], None
        async for piece in text_request:
            text.append(piece.text)
            reason = piece.finish_reason
        return "".join(text), reason

    work = asyncio.ensure_future(asyncio.gather(*(one(r) for r in requests)))
    try:
        while not work.done():
            await asyncio.wait([work], timeout=0.25)
            if not work.done() and await request.is_disconnected():
                work.cancel()
                for text_request in requests:
                    text_request.cancel()
                raise asyncio.CancelledError()
        return work.result()
    finally:
        if not work.done():
            work.cancel()


async def _completion_chunks(head: dict, text_request: TextRequest, usage: bool) -> AsyncIterator[dict]:
    async for piece in text_request:
        yield {**head, "choices": [{"index": 0, "text": piece.text, "logprobs": None,
                                    "finish_reason": piece.finish_reason}]}
    if usage:
        yield {**head, "choices": [], "usage": _usage([text_request])}


async def _chat_chunks(head: dict, text_request: TextRequest, usage: bool) -> AsyncIterator[dict]:
    yield {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}]}
    async for piece in text_request:
        delta: dict[str, Any] = {"content": piece.text} if piece.text else {}
        yield {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                    "finish_reason": piece.finish_reason}]}
    if usage:
        yield {**head, "choices": [], "usage": _usage([text_request])}


class _BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets 413."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, int(limit)
        self.state = getattr(app, "state", None)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        # read the whole body first (it is small: a limit of a few MiB), then hand it to the app as one message; a
        # body over the limit is read to its end (up to 16 times the limit) before the 413, so that a client still
        # writing it reads the reply instead of a reset connection
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            size += len(message.get("body", b""))
            if size <= self.limit:
                chunks.append(message.get("body", b""))
            if not message.get("more_body", False) or size > 16 * self.limit:
                break
        if size > self.limit:
            return await self._too_large(send)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send):
        body = json.dumps(ApiError(413, f"the request body exceeds {self.limit} bytes", code="body_too_large")
                          .body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
