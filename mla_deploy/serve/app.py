"""The HTTP application: OpenAI's ``/v1/completions``, ``/v1/chat/completions`` (streamed as server-sent events or
not) and ``/v1/models``, with ``/health`` and ``/metrics``, over a :class:`~mla_deploy.serve.service.Service`.

:func:`create_app` returns a FastAPI (ASGI) app: ``mla-deploy serve`` runs it under uvicorn, and Ray Serve can
mount the same app on a deployment. Every refusal is OpenAI's error JSON with its status, never a traceback.
This module imports FastAPI: only the server (and its tests) load it.

In front of the app, :class:`_Gate` (plain ASGI, the outermost layer) checks the API key, reads the body under its
size limit and time limit, counts every reply in the request metrics, and watches the connection while the request
runs: a client that goes away, streaming or not, has its requests cancelled and their rows freed at the next step.
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

from ..generate.tool_calls import forced_schema
from .metrics import Metrics
from .protocol import ApiError, ChatRequest, CompletionRequest, validation_error
from .service import Piece, Service, TextRequest
from .tool_replies import Calls


def create_app(service: Service):
    """The FastAPI app serving ``service`` (started and stopped with the app's lifespan)."""
    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.start()
        try:
            yield
        finally:
            await asyncio.to_thread(service.stop)

    # the OpenAPI schema is served (/openapi.json, no docs pages): it describes the bodies taken, for clients and
    # for the schema-driven fuzzing of the tests
    app = FastAPI(title="mla-deploy", lifespan=lifespan, docs_url=None, redoc_url=None)
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
        if len(prompts) > service.options.max_queue:  # never accepted, however long the client waits: not a 429
            raise ApiError(400, f"{len(prompts)} prompts in one request are more than the {service.options.max_queue} "
                                f"requests this server queues (--max-queue): send fewer per request", param="prompt",
                           code="too_many_prompts")
        sampling = service.sampling(body.temperature, body.top_p, body.top_k, body.seed)
        constrained, schema = body.output_schema()
        # choice i * n + j is prompt i's choice j (OpenAI's order); echoes[k]: its prompt's text and ids, if echoed
        requests: list[TextRequest] = []
        echoes: list = []
        try:
            for prompt in prompts:
                ids = await service.prompt_ids(prompt)
                constraints = await service.constraints(schema, "response_format", body.n) if constrained else None
                requests += service.generate(ids, service.max_new_tokens(len(ids), body.max_tokens), sampling,
                                             body.stop, body.n, body.logprobs,
                                             prompt_logprobs=body.echo and body.logprobs is not None,
                                             constraints=constraints)
                echo = (prompt if isinstance(prompt, str) else service.tokenizer.decode(ids), ids) if body.echo \
                    else None
                echoes += [echo] * body.n
        except BaseException:  # refused, or the client left: what was submitted is withdrawn
            for started in requests:
                started.cancel()
            raise
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": service.model_name}
        if body.stream:
            return _sse(_completion_chunks(service, head, requests, echoes, body.logprobs is not None,
                                           _usage_wanted(body)), requests, request)
        results = await _collect(requests, request)
        choices = []
        for i, ((text, reason, entries), echo, text_request) in enumerate(zip(results, echoes, requests)):
            lead, before = _echoed(service, echo, text_request, body.logprobs is not None)
            logprobs = _completion_logprobs(before + list(entries), len(echo[0]) if echo else 0, len(before)) \
                if body.logprobs is not None else None
            choices.append({"index": i, "text": lead + text, "logprobs": logprobs, "finish_reason": reason})
        return {**head, "choices": choices, "usage": _usage(requests)}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        _check(service, body)
        tools = body.tool_dicts()
        ids = await service.chat_ids(body.template_messages(), tools)
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        sampling = service.sampling(body.temperature, body.top_p, body.top_k, body.seed)
        constrained, schema = body.output_schema()
        forced, name = body.forced_call()
        calls = Calls([t["function"]["name"] for t in tools or ()],
                      service.tool_syntax if body.calls_parsed() else None, forced, name)
        if forced:  # the call's JSON is the whole reply
            constrained, schema = True, forced_schema(tools, name, body.parallel_tool_calls is not False)
        constraints = await service.constraints(schema, "tools" if forced else "response_format", body.n) \
            if constrained else None
        top = (body.top_logprobs or 0) if body.logprobs else None
        requests = service.generate(ids, service.max_new_tokens(len(ids), asked), sampling, body.stop, body.n,
                                    top, constraints=constraints,
                                    keep_special=calls.syntax is not None and service.calls_need_special)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": service.model_name}
        if body.stream:
            return _sse(_chat_chunks({**head, "object": "chat.completion.chunk"}, requests, calls, body.logprobs,
                                     _usage_wanted(body)), requests, request)
        choices = []
        for i, (text, reason, entries) in enumerate(await _collect(requests, request)):
            message, reason = calls.message(text, reason)
            choices.append({"index": i, "message": message,
                            "logprobs": _chat_logprobs(entries) if body.logprobs else None, "finish_reason": reason})
        return {**head, "choices": choices, "usage": _usage(requests)}

    def _sse(chunks: AsyncIterator[dict], requests: list[TextRequest], request: Request):
        # the client leaving cancels the request at once, even while it waits for a row or a long prefill and no
        # event is being written (a write is where a closed connection would show otherwise), and also when the
        # reply never began
        watch = _cancel_when_gone(request, requests)

        async def events():
            try:
                async for chunk in chunks:
                    yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
            except ApiError as error:  # the reply has begun: the error is the stream's last event
                yield f"data: {json.dumps(error.body())}\n\n"
            except Exception as error:  # a bug of ours: still an error event, not a cut connection
                failure = ApiError(500, f"internal error: {type(error).__name__}: {error}", type="server_error")
                yield f"data: {json.dumps(failure.body())}\n\n"
            finally:
                watch.cancel()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return _Gate(app, service.options, metrics)


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
    if body.n > service.options.max_batch:
        raise ApiError(400, f"n = {body.n} choices need as many rows; this server decodes {service.options.max_batch} "
                            f"sequences together (--max-batch)", param="n")


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


#: the ``scope`` key of the :class:`asyncio.Event` that :class:`_Gate` sets when the request's client has gone
GONE = "mla_deploy.client_gone"


def _cancel_when_gone(request: Request, requests: list[TextRequest]) -> asyncio.Task:
    """A task that cancels ``requests`` (their rows freed before the next step) once the client has gone; cancel
    the task when the reply has ended."""
    gone: asyncio.Event = request.scope[GONE]

    async def watch():
        await gone.wait()
        for text_request in requests:
            text_request.cancel()

    return asyncio.ensure_future(watch())


async def _collect(requests: list[TextRequest], request: Request) -> list[tuple[str, str, tuple]]:
    """Each request's whole text, finish reason and log probability entries; a client that disconnects first
    cancels them all (499, which nobody reads: it is for the request metrics)."""

    async def one(text_request: TextRequest) -> tuple[str, str, tuple]:
        text, reason, entries = [], None, []
        async for piece in text_request:
            text.append(piece.text)
            entries += piece.logprobs
            reason = piece.finish_reason
        return "".join(text), reason, tuple(entries)

    work = asyncio.ensure_future(asyncio.gather(*(one(r) for r in requests)))
    gone = asyncio.ensure_future(request.scope[GONE].wait())
    try:
        await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            raise ApiError(499, "the client closed the connection", type="client_closed_request")
        return work.result()
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            for text_request in requests:
                text_request.cancel()


async def _merged(requests: list) -> AsyncIterator[tuple[int, Any]]:
    """``(choice, item)`` of several streams (a request's ``n`` choices: :class:`TextRequest` s' pieces, or their
    :func:`_call_deltas`) as their items come."""
    if len(requests) == 1:
        async for piece in requests[0]:
            yield 0, piece
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, text_request: TextRequest) -> None:
        try:
            async for piece in text_request:
                await queue.put((index, piece, None))
        except Exception as error:  # the stream's error event, after what the other choices sent
            await queue.put((index, None, error))
            return
        await queue.put((index, None, None))

    pumps = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(requests)]
    try:
        left = len(requests)
        while left:
            index, piece, error = await queue.get()
            if error is not None:
                raise error
            if piece is None:
                left -= 1
                continue
            yield index, piece
    finally:
        for task in pumps:
            task.cancel()


async def _call_deltas(calls: Calls, text_request: TextRequest) -> AsyncIterator[tuple[dict, str | None, list]]:
    """``(delta, finish_reason, entries)`` of one chat choice: :meth:`Calls.deltas` of its pieces, each delta with
    the log probability entries of the tokens read since the previous one (text a call parser holds back carries its
    entries on to the delta that shows it)."""
    pending: list = []

    async def pieces() -> AsyncIterator[Piece]:
        async for piece in text_request:
            pending.extend(piece.logprobs)
            yield piece

    async for delta, reason in calls.deltas(pieces()):
        entries = list(pending)
        pending.clear()
        yield delta, reason, entries


def _chat_logprobs(entries) -> dict:
    """OpenAI's chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}, ...]}``."""
    return {"content": [{"token": e.text, "logprob": e.logprob, "bytes": list(e.bytes),
                         "top_logprobs": [{"token": t, "logprob": v, "bytes": list(b)} for t, b, v in e.top]}
                        for e in entries], "refusal": None}


def _completion_logprobs(entries, shift: int, echoed: int) -> dict:
    """The completions API's legacy ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs`` (a dict of the
    most likely tokens' texts, None for the prompt's first token), ``text_offset`` (the first ``echoed`` entries are
    the prompt's, offset in it; the others are shifted past the echoed prompt's ``shift`` characters)."""
    return {"tokens": [e.text for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [None if e.logprob is None else {t: v for t, _, v in e.top} for e in entries],
            "text_offset": [e.offset + (0 if i < echoed else shift) for i, e in enumerate(entries)]}


def _echoed(service: Service, echo, text_request: TextRequest, logprobs: bool) -> tuple[str, list]:
    """What a completion's choice begins with under ``echo``: the prompt's text and, with ``logprobs``, its
    entries."""
    if echo is None:
        return "", []
    text, ids = echo
    return text, service.prompt_entries(ids, text_request.prompt_logprobs or ()) if logprobs else []


async def _completion_chunks(service: Service, head: dict, requests: list[TextRequest], echoes: list,
                             logprobs: bool, usage: bool) -> AsyncIterator[dict]:
    started = [False] * len(requests)
    async for i, piece in _merged(requests):
        lead, before = ("", []) if started[i] else _echoed(service, echoes[i], requests[i], logprobs)
        shift = len(echoes[i][0]) if echoes[i] else 0
        started[i] = True
        yield {**head, "choices": [{"index": i, "text": lead + piece.text,
                                    "logprobs": _completion_logprobs(before + list(piece.logprobs), shift, len(before))
                                    if logprobs else None, "finish_reason": piece.finish_reason}]}
    if usage:
        yield {**head, "choices": [], "usage": _usage(requests)}


async def _chat_chunks(head: dict, requests: list[TextRequest], calls: Calls, logprobs: bool,
                       usage: bool) -> AsyncIterator[dict]:
    for i in range(len(requests)):
        yield {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}]}
    async for i, (delta, reason, entries) in _merged([_call_deltas(calls, r) for r in requests]):
        yield {**head, "choices": [{"index": i, "delta": delta,
                                    "logprobs": _chat_logprobs(entries) if logprobs and entries else None,
                                    "finish_reason": reason}]}
    if usage:
        yield {**head, "choices": [], "usage": _usage(requests)}


class _Gate:
    """ASGI middleware in front of the app (the module docstring): the key, the body's size and time limits, the
    request counter, and the watch on the connection (the :data:`GONE` event in the request's scope)."""

    def __init__(self, app, options, metrics):
        self.app, self.options, self.metrics = app, options, metrics
        self.limit, self.key = int(options.max_body_bytes), options.api_key
        self.state = getattr(app, "state", None)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        label = path if path in _ROUTES else "other"  # a bounded set of label values, whatever paths are asked
        status = None

        async def counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self._request(scope, receive, counted, path)
        finally:
            if status is not None:
                self.metrics.requests.labels(label, str(status)).inc()

    async def _request(self, scope, receive, send, path: str):
        if self.key and path.startswith("/v1/"):
            given = _header(scope, b"authorization")
            if not _key_matches(given, self.key):
                return await _reply(send, ApiError(401, "Incorrect API key provided" if given else
                                                   "You didn't provide an API key (Authorization: Bearer KEY)",
                                                   code="invalid_api_key"))
        body = await self._body(receive, send)
        if body is None:  # answered (413, 408) or the client left
            return
        gone, replayed = asyncio.Event(), False
        scope[GONE] = gone

        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()  # the watch reads the connection; the app hears of its end from here
            return {"type": "http.disconnect"}

        watcher = asyncio.ensure_future(watch())
        try:
            await self.app(scope, replay, send)
        finally:
            watcher.cancel()
            gone.set()  # the exchange is over: what still waits on the client (a stream never begun) lets go

    async def _body(self, receive, send) -> bytes | None:
        """The whole body (small: a limit of a few MiB), or None once answered. A body over the limit is read to its
        end (up to 16 times the limit) before the 413, so that a client still writing it reads the reply instead of
        a reset connection; one that takes longer than the client timeout to arrive gets 408."""
        chunks, size, timeout = [], 0, self.options.client_timeout
        try:
            async with asyncio.timeout(timeout):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":  # the client left
                        return None
                    size += len(message.get("body", b""))
                    if size <= self.limit:
                        chunks.append(message.get("body", b""))
                    if not message.get("more_body", False) or size > 16 * self.limit:
                        break
        except TimeoutError:
            await _reply(send, ApiError(408, f"the request body did not arrive within {timeout:g} s",
                                        type="timeout_error", code="timeout"), close=True)
            return None
        if size > self.limit:
            await _reply(send, ApiError(413, f"the request body exceeds {self.limit} bytes", code="body_too_large"))
            return None
        return b"".join(chunks)


def _header(scope, name: bytes) -> str:
    return next((value.decode("latin-1") for key, value in scope["headers"] if key == name), "")


def _key_matches(authorization: str, key: str) -> bool:
    """``Authorization: Bearer KEY`` (the scheme's case does not matter, RFC 9110 11.1), compared in constant time."""
    kind, _, token = authorization.strip().partition(" ")
    return hmac.compare_digest(token.strip().encode(), key.encode()) and kind.lower() == "bearer"


async def _reply(send, error: ApiError, close: bool = False) -> None:
    """``error`` as the whole reply, from outside the app."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), str(v).encode()) for k, v in error.headers.items()]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
