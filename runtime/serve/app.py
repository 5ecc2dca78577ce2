"""The OpenAI-compatible ASGI app (FastAPI) over one engine: what uvicorn and Ray Serve both run.

`make_app(model, engine, settings)` returns a FastAPI app; `runtime/serve/server.py` runs it with
uvicorn, `runtime/serve/ray.py` deploys the same object with Ray Serve (`@serve.ingress`). The
engine keeps its own worker thread; a request's coroutine submits to it and awaits its events
through `bridge.merged_events` (no thread per request, no polling).

Every failure becomes an OpenAI error body with a status (400 bad input, 401 bad key, 404/405
routing, 408 a body that stalls, 413 an oversized body, 431 oversized headers, 500 engine
error, 503 engine closed): nothing a client sends can stop the server or show a traceback. A
client that goes away (mid-stream, or while waiting for a whole answer) has its requests
cancelled, so the engine stops working for nobody.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specport.errors import InputError
from specport.runtime.chat_template import ChatTemplate, load_chat_template
from specport.runtime.engine.base import Engine, Event, RequestHandle
from specport.runtime.engine.base import Request as EngineRequest
from specport.runtime.serve.bridge import first_output, merged_events
from specport.runtime.serve.guard import ClientTimeouts, read_body
from specport.runtime.serve.metrics import Metrics, RequestRecord
from specport.runtime.serve.protocol import (
    APIError,
    ParsedRequest,
    ServedModel,
    error_body,
    parse_chat,
    parse_completion,
    parse_json_body,
)
from specport.runtime.serve.responses import (
    Choice,
    TokenText,
    full_response,
    logprobs_body,
    model_card,
    models_list,
    stream_chunk,
    usage_chunk,
)

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("specport.serve.access")

MAX_BODY_BYTES = 8 * 1024 * 1024  # a full 128k-token id list is ~1 MB of JSON
MAX_HEADER_BYTES = 64 * 1024


@dataclass
class ServeSettings:
    """What an operator sets (`specport serve` flags); defaults are safe for a public port."""

    model_name: str | None = None
    chat_template: str | None = None  # template text overriding the artifact's
    api_key: str | None = None  # Bearer token for /v1/*; None: open
    cors_origins: tuple[str, ...] = ()  # CORS is off unless origins are given
    max_body_bytes: int = MAX_BODY_BYTES
    max_header_bytes: int = MAX_HEADER_BYTES
    body_timeout_s: float = 30.0  # a request body must arrive within this
    send_timeout_s: float = 60.0  # a client must take each piece of an answer within this
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class AppState:
    """The routes' shared state: the model, the engine, counters. One per app."""

    served: ServedModel
    engine: Engine
    chat_template: ChatTemplate | None
    settings: ServeSettings
    metrics: Metrics
    names: TokenText
    counters: dict[str, int] = field(
        default_factory=lambda: {"requests": 0, "errors": 0, "cancelled": 0, "active": 0}
    )
    # engine requests not yet finished, so a shutdown past its drain timeout can end them
    handles: weakref.WeakSet[RequestHandle] = field(default_factory=weakref.WeakSet)

    def cancel_in_flight(self) -> int:
        """Cancel every engine request still running or queued (any thread); how many.

        Their clients then get a clean 503 error body (or an SSE error event) instead of a
        dropped connection: the drain timeout on shutdown calls this."""
        n = 0
        for handle in list(self.handles):
            if not handle.done and not handle.cancelled:
                handle.cancel()
                n += 1
        return n

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counters)
        try:
            out["engine"] = self.engine.stats()
        except Exception as e:  # noqa: BLE001 - stats must never fail a health check
            out["engine"] = {"error": str(e)}
        return out


def make_app(model: Any, engine: Engine, settings: ServeSettings | None = None) -> FastAPI:
    """The FastAPI app serving `model` through `engine` (the caller owns and closes the engine)."""
    settings = settings or ServeSettings()
    served = ServedModel(
        settings.model_name or model.path.name,
        model,
        engine_max_length=getattr(engine, "max_length", None),
        logprobs=bool(getattr(engine, "logprobs", True)),
        speculative=bool(getattr(engine, "speculative", None)),
    )
    if settings.chat_template is not None and model.tokenizer is None:
        raise InputError(
            f"--chat-template needs a tokenizer but {model.path} has none; serve an artifact "
            "exported with its tokenizer, or send token-id prompts to /v1/completions"
        )
    template = load_chat_template(model, settings.chat_template)
    state = AppState(
        served, engine, template, settings, Metrics(served.name, engine), TokenText(model)
    )
    app = FastAPI(title="specport", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.specport = state
    app.add_middleware(ClientTimeouts, settings=settings)
    if settings.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"],
        )
    _routes(app, state)
    _handlers(app, state)
    return app


def _routes(app: FastAPI, state: AppState) -> None:
    served = state.served

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": served.name, **state.stats()}

    @app.get("/metrics")
    async def metrics() -> Response:
        data, content_type = state.metrics.scrape()
        return Response(data, media_type=content_type)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        _authorize(request, state)
        return models_list(served)

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request) -> dict[str, Any]:
        _authorize(request, state)
        if name != served.name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {served.name!r}",
                code="model_not_found",
                type="not_found_error",
            )
        return model_card(served)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        _authorize(request, state)
        body = parse_json_body(await read_body(request, state.settings))
        return await _generate(request, state, "/v1/completions", parse_completion(body, served))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        _authorize(request, state)
        body = parse_json_body(await read_body(request, state.settings))
        parsed = parse_chat(body, served, state.chat_template)
        return await _generate(request, state, "/v1/chat/completions", parsed)


def _handlers(app: FastAPI, state: AppState) -> None:
    routes = "/v1/models, /v1/completions, /v1/chat/completions, /health, /metrics"

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        state.counters["errors"] += 1
        if exc.status >= 500:
            logger.error("%s %s: %s", request.method, request.url.path, exc.message)
        headers = {"Connection": "close"} if exc.status in (408, 413, 431) else None
        _access(request, exc.status, None)
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        state.counters["errors"] += 1
        path = request.url.path
        if exc.status_code == 404:
            message, kind = f"no route {path!r}; see {routes}", "not_found_error"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = f"{request.method} is not allowed on {path}; use {allowed}"
            kind = "invalid_request_error"
        else:
            message, kind = str(exc.detail), "invalid_request_error"
        _access(request, exc.status_code, None)
        return JSONResponse(
            error_body(message, kind), status_code=exc.status_code, headers=exc.headers
        )


def _authorize(request: Request, state: AppState) -> None:
    key = state.settings.api_key
    if key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(
            401,
            "missing or wrong API key: send the header `Authorization: Bearer <key>` with the "
            "key this server was started with (--api-key)",
            type="invalid_request_error",
            code="invalid_api_key",
        )


def _access(request: Request, status: int, record: RequestRecord | None) -> None:
    """One structured line per request (logfmt): id, route, status, tokens, TTFT, total time."""
    fields: dict[str, Any] = {"method": request.method, "route": request.url.path}
    fields["status"] = status
    if record is not None:
        fields.update(record.fields())
    client = request.client
    if client is not None:
        fields["client"] = f"{client.host}:{client.port}"
    access_logger.info(" ".join(f"{k}={_logfmt(v)}" for k, v in fields.items()))


def _logfmt(value: Any) -> str:
    text = str(value)
    return json.dumps(text) if (" " in text or '"' in text or not text) else text


# ---------------------------------------------------------------------------- generation


def _submit(state: AppState, requests: list[EngineRequest]) -> list[RequestHandle]:
    handles: list[RequestHandle] = []
    try:
        for request in requests:
            handles.append(state.engine.submit(request))
            state.handles.add(handles[-1])
    except Exception as e:  # noqa: BLE001 - e.g. the engine is closed or refuses the request
        for handle in handles:
            handle.cancel()
        from specport.errors import ContextLengthError, InputError

        status = 400 if isinstance(e, (InputError, ContextLengthError)) else 503
        raise APIError(status, f"the engine refused the request: {e}") from None
    return handles


async def _generate(
    request: Request, state: AppState, route: str, parsed: ParsedRequest
) -> Response:
    record = RequestRecord(parsed.request_id, route, len(parsed.prompt_ids), n=len(parsed.requests))
    handles = _submit(state, parsed.requests[:1])
    if len(parsed.requests) > 1:
        # The other choices start once the first has prefilled the prompt: the batching
        # engine's prefix cache then copies its KV instead of prefilling it n times.
        await first_output(handles[0])
        handles += _submit(state, parsed.requests[1:])
    state.counters["requests"] += 1
    state.metrics.started(record)
    if parsed.stream:
        return StreamingResponse(
            _stream(request, state, parsed, handles, record),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Request-Id": parsed.request_id},
        )
    state.counters["active"] += 1
    try:
        choices = await _whole(request, state, handles, record)
    finally:
        state.counters["active"] -= 1
    if choices is None:  # the client left; nobody reads this
        state.metrics.finished(record)
        _access(request, 499, record)
        return Response(status_code=499)
    failed = next((c for c in choices if c.finish in ("error", "cancelled")), None)
    state.metrics.finished(record)
    if failed is not None:
        _access(request, 500 if failed.finish == "error" else 503, record)
        raise _failure(failed)
    echo = state.names.model.decode(parsed.prompt_ids) if parsed.echo else ""
    body = full_response(parsed, state.served, state.names, choices, int(time.time()), echo)
    _access(request, 200, record)
    return JSONResponse(body, headers={"X-Request-Id": parsed.request_id})


def _failure(choice: Choice) -> APIError:
    if choice.finish == "error":
        return APIError(500, f"generation failed: {choice.text[-1] if choice.text else ''}")
    return APIError(
        503, "the request was cancelled (is the server shutting down?)", type="service_unavailable"
    )


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _whole(
    request: Request, state: AppState, handles: list[RequestHandle], record: RequestRecord
) -> list[Choice] | None:
    """Collect every choice; None (and the handles cancelled) if the client leaves first."""
    choices = [Choice() for _ in handles]

    async def collect() -> None:
        async for i, ev in merged_events(handles):
            record.observe(ev)
            _add(choices[i], ev)

    work = asyncio.ensure_future(collect())
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this task was cancelled (e.g. a forced shutdown)
        work.cancel()
        _abandon(state, handles, record)
        raise
    finally:
        gone.cancel()
    if not work.done():
        work.cancel()
        _abandon(state, handles, record)
        return None
    work.result()
    return choices


def _add(choice: Choice, ev: Event) -> None:
    if ev.finish_reason == "error":
        choice.text.append(ev.error or "unknown engine error")
    else:
        choice.text.append(ev.text)
    choice.tokens.extend(ev.token_ids)
    if ev.logprobs:
        choice.logprobs.extend(ev.logprobs)
    if ev.finish_reason is not None:
        choice.finish = ev.finish_reason


def _abandon(state: AppState, handles: list[RequestHandle], record: RequestRecord) -> None:
    """The client left: cancel its requests once, so the engine stops working for nobody."""
    cancelled = False
    for handle in handles:
        if not handle.cancelled and not handle.done:
            handle.cancel()
            cancelled = True
    if cancelled:
        state.counters["cancelled"] += 1
        record.finish = "cancelled"
        logger.info("client left; cancelled request %s", record.request_id)


def _sse(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode("utf-8") + b"\n\n"


async def _stream(
    request: Request,
    state: AppState,
    parsed: ParsedRequest,
    handles: list[RequestHandle],
    record: RequestRecord,
) -> AsyncIterator[bytes]:
    """The SSE body. Starlette cancels this generator when the client disconnects; `finally`
    then cancels the engine requests."""
    served, names = state.served, state.names
    created = int(time.time())
    offsets = [0] * len(handles)
    status = 200
    state.counters["active"] += 1
    try:
        if parsed.kind == "chat":
            for i in range(len(handles)):
                yield _sse(stream_chunk(parsed, served, created, i, text="", role=True))
        elif parsed.echo:
            echo = names.model.decode(parsed.prompt_ids)
            for i in range(len(handles)):
                offsets[i] = len(echo)
                yield _sse(stream_chunk(parsed, served, created, i, text=echo))
        async for i, ev in merged_events(handles):
            record.observe(ev)
            if ev.finish_reason in ("error", "cancelled"):
                status = 500 if ev.finish_reason == "error" else 503
                message = ev.error or "the request was cancelled (is the server shutting down?)"
                logger.error("request %s failed: %s", parsed.request_id, message)
                state.counters["errors"] += 1
                kind = "server_error" if status == 500 else "service_unavailable"
                for handle in handles:
                    handle.cancel()
                yield _sse(error_body(message, kind, code=str(status)))
                break
            if ev.text or (ev.token_ids and (parsed.return_token_ids or ev.logprobs)):
                lp = logprobs_body(parsed, names, ev.logprobs or [], offsets[i])
                offsets[i] += len(ev.text)
                yield _sse(
                    stream_chunk(parsed, served, created, i, ev.text, ev.token_ids, logprobs=lp)
                )
            if ev.finish_reason is not None:
                yield _sse(stream_chunk(parsed, served, created, i, engine_reason=ev.finish_reason))
        if parsed.include_usage:
            yield _sse(usage_chunk(parsed, served, created, record.completion_tokens))
        yield b"data: [DONE]\n\n"
    except BaseException:
        status = 499  # cancelled by a disconnect (or a send that timed out)
        _abandon(state, handles, record)
        raise
    finally:
        state.counters["active"] -= 1
        state.metrics.finished(record)
        _access(request, status, record)
