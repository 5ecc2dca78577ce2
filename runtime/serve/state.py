"""What the serving routes share: the operator's settings, the per-app state, the access log.

Kept apart from the routes (`app.py`) and the generation path (`generate.py`) so both can use
them without importing each other.
"""

from __future__ import annotations

import json
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from specport.core.chat_template import ChatTemplate
from specport.runtime.engine.base import Engine, RequestHandle
from specport.runtime.serve.metrics import Metrics, RequestRecord
from specport.runtime.serve.responses import TokenText
from specport.runtime.serve.served import ServedModel

access_logger = logging.getLogger("specport.serve.access")

MAX_BODY_BYTES = 8 * 1024 * 1024  # a full 128k-token id list is ~1 MB of JSON
MAX_HEADER_BYTES = 64 * 1024
MAX_QUEUE = 256  # requests waiting for a KV row before new ones are refused (503)
RETRY_AFTER_S = 1  # what a refused client is told to wait (seconds)


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
    max_tokens: int | None = None  # default new tokens for requests that give none, and a cap
    max_queue: int = MAX_QUEUE  # queued (not yet running) requests; more are refused (503)
    request_timeout_s: float | None = None  # a request's whole time, queue included; then 504
    retry_after_s: int = RETRY_AFTER_S  # the Retry-After of a refusal for overload
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
        default_factory=lambda: dict.fromkeys(
            ("requests", "errors", "cancelled", "active", "refused", "timeouts"), 0
        )
    )
    # engine requests not yet finished, so a shutdown past its drain timeout can end them
    handles: weakref.WeakSet[RequestHandle] = field(default_factory=weakref.WeakSet)
    draining: bool = False  # the server is shutting down: not ready, takes no new requests

    def not_ready(self) -> str | None:
        """Why a load balancer should send this server no new request now (None: ready)."""
        if self.draining:
            return "the server is shutting down"
        if getattr(self.engine, "closed", False):  # engines from before `closed` / `queued`
            return "the engine is closed"
        queued = self.queued()
        if queued >= self.settings.max_queue:
            return (
                f"the queue is full: {queued} requests wait for a KV row "
                f"(--max-queue {self.settings.max_queue})"
            )
        return None

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

    def queued(self) -> int:
        queued = getattr(self.engine, "queued", None)
        return int(queued()) if queued is not None else 0

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counters)
        try:
            out["engine"] = self.engine.stats()
        except Exception as e:  # noqa: BLE001 - stats must never fail a health check
            out["engine"] = {"error": str(e)}
        return out


def log_access(request: Request, status: int, record: RequestRecord | None) -> None:
    """One structured line per request (logfmt): id, route, status, tokens, TTFT, total time."""
    fields: dict[str, Any] = {"method": request.method, "route": request.url.path}
    fields["status"] = status
    if record is not None:
        fields.update(record.fields())
    client = request.client
    if client is not None:
        fields["client"] = f"{client.host}:{client.port}"
    access_logger.info(" ".join(f"{k}={logfmt(v)}" for k, v in fields.items()))


def logfmt(value: Any) -> str:
    text = str(value)
    return json.dumps(text) if (" " in text or '"' in text or not text) else text
