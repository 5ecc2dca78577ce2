"""One generation request through the engine to the client: a whole JSON answer or an SSE stream.

The coroutine submits the parsed request's engine requests, then awaits their events through
`bridge.merged_events` (no thread per request, no polling). A client that goes away (mid-stream,
or while waiting for a whole answer) has its requests cancelled, so the engine stops working
for nobody; an engine error or a cancellation becomes an OpenAI error body (500 / 503) or an
SSE error event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specport.core.errors import ContextLengthError, InputError
from specport.runtime.engine.base import Event, RequestHandle
from specport.runtime.engine.base import Request as EngineRequest
from specport.runtime.serve.api_error import APIError, error_body
from specport.runtime.serve.bridge import first_output, merged_events
from specport.runtime.serve.metrics import RequestRecord
from specport.runtime.serve.protocol import ParsedRequest
from specport.runtime.serve.responses import (
    Choice,
    full_response,
    logprobs_body,
    stream_chunk,
    usage_chunk,
)
from specport.runtime.serve.state import AppState, log_access

logger = logging.getLogger(__name__)


class _ClosingStream(StreamingResponse):
    """A StreamingResponse that always closes its body generator. Starlette leaves it suspended
    at a `yield` when a send fails (a client that stopped reading past the send timeout) or is
    cancelled there (a disconnect): its `finally` (cancel the engine requests, count the request
    done, write the access line) would wait for the garbage collector."""

    async def stream_response(self, send: Any) -> None:
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def _submit(state: AppState, requests: list[EngineRequest]) -> list[RequestHandle]:
    handles: list[RequestHandle] = []
    try:
        for request in requests:
            handles.append(state.engine.submit(request))
            state.handles.add(handles[-1])
    except Exception as e:  # noqa: BLE001 - e.g. the engine is closed or refuses the request
        for handle in handles:
            handle.cancel()

        status = 400 if isinstance(e, (InputError, ContextLengthError)) else 503
        raise APIError(status, f"the engine refused the request: {e}") from None
    return handles


def _refuse_when_full(state: AppState) -> None:
    """503 with Retry-After while the server takes no new requests (`AppState.not_ready`):
    a full queue would only make every waiting client's answer later."""
    why = state.not_ready()
    if why is None:
        return
    wait = state.settings.retry_after_s
    state.counters["refused"] += 1
    state.metrics.refused.labels(state.metrics.model).inc()
    raise APIError(
        503,
        f"the server takes no new requests now: {why}; retry in {wait} s",
        type="service_unavailable",
        code="server_overloaded",
        headers={"Retry-After": str(wait)},
    )


def _timeout_error(state: AppState) -> APIError:
    state.counters["timeouts"] += 1
    state.metrics.timed_out.labels(state.metrics.model).inc()
    return APIError(
        504,
        f"the request took longer than this server's request timeout of "
        f"{state.settings.request_timeout_s:g} s (--request-timeout), queueing included; "
        "ask for fewer tokens or retry later",
        type="timeout_error",
        code="request_timeout",
    )


async def generate(
    request: Request, state: AppState, route: str, parsed: ParsedRequest
) -> Response:
    _refuse_when_full(state)
    record = RequestRecord(parsed.request_id, route, len(parsed.prompt_ids), n=len(parsed.requests))
    timeout = state.settings.request_timeout_s
    deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
    handles = _submit(state, parsed.requests[:1])
    if len(parsed.requests) > 1:
        # The other choices start once the first has prefilled the prompt: the batching
        # engine's prefix cache then copies its KV instead of prefilling it n times.
        try:
            await first_output(handles[0], deadline)
        except asyncio.TimeoutError:
            handles[0].cancel()
            log_access(request, 504, record)
            raise _timeout_error(state) from None
        handles += _submit(state, parsed.requests[1:])
    state.counters["requests"] += 1
    state.metrics.started(record)
    if parsed.stream:
        return _ClosingStream(
            _stream(request, state, parsed, handles, record, deadline),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Request-Id": parsed.request_id},
        )
    state.counters["active"] += 1
    try:
        choices = await _whole(request, state, handles, record, deadline)
    except asyncio.TimeoutError:
        _abandon(state, handles, record, "request timeout")
        state.metrics.finished(record)
        log_access(request, 504, record)
        raise _timeout_error(state) from None
    finally:
        state.counters["active"] -= 1
    if choices is None:  # the client left; nobody reads this
        state.metrics.finished(record)
        log_access(request, 499, record)
        return Response(status_code=499)
    failed = next((c for c in choices if c.finish in ("error", "cancelled")), None)
    state.metrics.finished(record)
    if failed is not None:
        log_access(request, 500 if failed.finish == "error" else 503, record)
        raise _failure(failed)
    echo = state.names.model.decode(parsed.prompt_ids) if parsed.echo else ""
    body = full_response(parsed, state.served, state.names, choices, int(time.time()), echo)
    log_access(request, 200, record)
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
    request: Request,
    state: AppState,
    handles: list[RequestHandle],
    record: RequestRecord,
    deadline: float | None,
) -> list[Choice] | None:
    """Collect every choice; None (and the handles cancelled) if the client leaves first;
    `asyncio.TimeoutError` past `deadline`."""
    choices = [Choice() for _ in handles]

    async def collect() -> None:
        async for i, ev in merged_events(handles, deadline):
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


def _abandon(
    state: AppState, handles: list[RequestHandle], record: RequestRecord, why: str = "client left"
) -> None:
    """The client left (or the request timed out): cancel its requests once, so the engine
    stops working for nobody."""
    cancelled = False
    for handle in handles:
        if not handle.cancelled and not handle.done:
            handle.cancel()
            cancelled = True
    if cancelled:
        state.counters["cancelled"] += 1
        record.finish = "cancelled"
        logger.info("%s; cancelled request %s", why, record.request_id)


async def _until(
    events: AsyncIterator[tuple[int, Event]],
) -> AsyncIterator[tuple[int, Event | None]]:
    """`events`, then (-1, None) if they ran past their deadline."""
    try:
        async for item in events:
            yield item
    except asyncio.TimeoutError:
        yield -1, None


def _sse(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode("utf-8") + b"\n\n"


async def _stream(
    request: Request,
    state: AppState,
    parsed: ParsedRequest,
    handles: list[RequestHandle],
    record: RequestRecord,
    deadline: float | None,
) -> AsyncIterator[bytes]:
    """The SSE body. Starlette cancels this generator when the client disconnects; `finally`
    then cancels the engine requests. Past `deadline` the stream ends with an error event."""
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
        async for i, ev in _until(merged_events(handles, deadline)):
            if ev is None:  # past the deadline
                status = 504
                error = _timeout_error(state)
                _abandon(state, handles, record, "request timeout")
                yield _sse(error_body(error.message, error.type, code="504"))
                break
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
        log_access(request, status, record)
