"""Limits that keep one misbehaving client from holding the server or its engine.

- `read_body`: a request body larger than the limit is refused (413) before it is read (from
  Content-Length) or as soon as it passes the limit (chunked); a body that stops arriving
  (fewer bytes than its Content-Length, then silence) is refused (408) after `body_timeout_s`;
  a client that hangs up halfway is simply dropped. No engine work has started in any case.
- `ClientTimeouts` (ASGI middleware): headers over the limit are refused (431); a client that
  stops reading its answer has `send_timeout_s` to take each piece, then the connection is
  dropped and its requests cancelled (the engine row is freed), with a log line, not a traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specport.runtime.serve.api_error import APIError, error_body

logger = logging.getLogger(__name__)


class _ClientGone(APIError):
    """The client hung up while sending its body: there is nobody to answer."""

    def __init__(self) -> None:
        super().__init__(499, "client closed the connection while sending the request body")


async def read_body(request: Request, settings: Any) -> bytes:
    """The whole request body within `settings.max_body_bytes` and `settings.body_timeout_s`."""
    limit = settings.max_body_bytes
    raw_length = request.headers.get("content-length")
    if raw_length is not None:
        try:
            length = int(raw_length)
        except ValueError:
            raise APIError(400, f"bad Content-Length {raw_length!r}") from None
        if length > limit:
            raise APIError(
                413,
                f"the request body is {length} bytes; this server accepts at most {limit} bytes",
                code="request_too_large",
            )
    chunks: list[bytes] = []
    size = 0
    stream = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), settings.body_timeout_s)
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise APIError(
                408,
                f"the request body did not arrive within {settings.body_timeout_s:g} s "
                f"({size} bytes of {raw_length or 'unknown'} received); send the whole body",
                code="request_timeout",
            ) from None
        except ClientDisconnect:
            raise _ClientGone() from None
        size += len(chunk)
        if size > limit:
            raise APIError(
                413,
                f"the request body is over {limit} bytes; this server accepts at most "
                f"{limit} bytes",
                code="request_too_large",
            )
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body:
        raise APIError(400, "the request has no body; send a JSON object")
    return body


class _SlowClient(Exception):
    """A send to the client did not complete within the send timeout."""


class ClientTimeouts:
    """Pure ASGI middleware: header-size limit and per-send timeout (see the module docstring)."""

    def __init__(self, app: ASGIApp, settings: Any) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header_bytes = sum(len(k) + len(v) + 4 for k, v in scope.get("headers", []))
        if header_bytes > self.settings.max_header_bytes:
            await _send_json(
                send,
                431,
                error_body(
                    f"the request headers are {header_bytes} bytes; this server accepts at "
                    f"most {self.settings.max_header_bytes}",
                    "invalid_request_error",
                ),
            )
            return
        timeout = self.settings.send_timeout_s

        async def timed_send(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), timeout)
            except asyncio.TimeoutError:
                raise _SlowClient() from None

        try:
            await self.app(scope, receive, timed_send)
        except _SlowClient:
            client = scope.get("client")
            logger.warning(
                "client %s took no data for %.0f s; dropped it and cancelled its request",
                f"{client[0]}:{client[1]}" if client else "?",
                timeout,
            )


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})
