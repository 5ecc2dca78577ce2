"""`specport serve`: an OpenAI-compatible HTTP server over one engine, standard library only.

One `ThreadingHTTPServer`: each connection's thread parses its request (runtime/server_protocol),
submits it to the engine and waits on the handle; the engine does all the scheduling, so the
server has no locks around the model. Every failure becomes an OpenAI error body with a status
(400 bad input, 404/405 routing, 413 oversized body, 500 engine error); nothing a client sends
can stop the server or show it a traceback.

Streaming answers are Server-Sent Events over chunked transfer encoding (the connection stays
usable). While waiting for events the thread checks whether the client went away and then
cancels the request, so an abandoned stream does not keep the engine busy.
"""

from __future__ import annotations

import json
import logging
import queue
import select
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from specport.runtime.chat_template import ChatTemplate, load_chat_template
from specport.runtime.engine.base import Engine, Event, RequestHandle
from specport.runtime.server_protocol import (
    APIError,
    ParsedRequest,
    ServedModel,
    error_body,
    parse_chat,
    parse_completion,
    parse_json_body,
)
from specport.runtime.server_responses import (
    full_response,
    model_card,
    models_list,
    stream_chunk,
    usage_chunk,
)

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024  # a full 128k-token id list is ~1 MB of JSON
_SOCKET_TIMEOUT_S = 120.0  # per read/write on a connection, idle keep-alive included
_POLL_S = 0.25  # how often a waiting thread checks that its client is still there


class SpecportServer(ThreadingHTTPServer):
    """The HTTP server: owns the routes' shared state (model, engine, counters), not the engine.

    `serve_forever()` blocks (the CLI); `start()` serves on a daemon thread (tests, notebooks).
    `shutdown()` stops accepting; closing the engine stays with whoever created it.
    """

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        model: Any,
        engine: Engine,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        model_name: str | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        self.served = ServedModel(
            model_name or model.path.name,
            model,
            engine_max_length=getattr(engine, "max_length", None),
        )
        self.engine = engine
        self.chat_template: ChatTemplate | None = load_chat_template(model)
        self.max_body_bytes = max_body_bytes
        self.counters = {"requests": 0, "errors": 0, "cancelled": 0, "active": 0}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = host.decode() if isinstance(host, bytes) else str(host)
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def count(self, name: str, delta: int = 1) -> None:
        with self._lock:
            self.counters[name] += delta

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self.counters)
        try:
            out["engine"] = self.engine.stats()
        except Exception as e:  # noqa: BLE001 - stats must never fail a health check
            out["engine"] = {"error": str(e)}
        return out

    def start(self) -> threading.Thread:
        """Serve on a daemon thread; returns it (stop with `shutdown()` then `server_close()`)."""
        self._thread = threading.Thread(
            target=self.serve_forever, args=(0.05,), name="specport-server", daemon=True
        )
        self._thread.start()
        return self._thread

    def stop(self) -> None:
        """Stop serving and release the port (does not close the engine)."""
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)


def make_server(
    model: Any,
    engine: Engine,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> SpecportServer:
    """Bind (port 0 = any free port) an OpenAI-compatible server over `engine`; not yet serving."""
    return SpecportServer(
        model, engine, host=host, port=port, model_name=model_name, max_body_bytes=max_body_bytes
    )


class _ClientGone(Exception):
    """The client closed the connection while we were answering."""


class _Handler(BaseHTTPRequestHandler):
    server: SpecportServer
    protocol_version = "HTTP/1.1"  # keep-alive; every answer has a length or is chunked
    timeout = _SOCKET_TIMEOUT_S  # a stalled client (half a body, unread stream) frees its thread
    server_version = "specport"

    # ------------------------------------------------------------------ routing
    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_OPTIONS(self) -> None:
        self._dispatch("OPTIONS")

    def _dispatch(self, method: str) -> None:
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        served = self.server.served
        routes: dict[str, dict[str, Any]] = {
            "/health": {"GET": self._health},
            "/v1/models": {"GET": self._models},
            f"/v1/models/{served.name}": {"GET": self._model},
            "/v1/completions": {"POST": self._completions},
            "/v1/chat/completions": {"POST": self._chat},
        }
        try:
            if path not in routes and path.startswith("/v1/models/"):
                raise APIError(
                    404,
                    f"the model {path[len('/v1/models/') :]!r} does not exist; this server "
                    f"serves {served.name!r}",
                    code="model_not_found",
                    type="not_found_error",
                )
            if path not in routes:
                raise APIError(
                    404,
                    f"no route {path!r}; see /v1/models, /v1/completions, "
                    "/v1/chat/completions, /health",
                    type="not_found_error",
                )
            handler = routes[path].get("GET" if method == "HEAD" else method)
            if handler is None:
                allowed = ", ".join(routes[path])
                raise APIError(
                    405,
                    f"{method} is not allowed on {path}; use {allowed}",
                    type="invalid_request_error",
                )
            handler()
        except APIError as e:
            self.server.count("errors")
            if e.status >= 500:
                logger.error("%s %s: %s", method, path, e.message)
            self._send_json(e.status, e.body())
        except _ClientGone:
            self.close_connection = True
        except Exception as e:  # noqa: BLE001 - last resort: log it, answer 500, keep serving
            self.server.count("errors")
            logger.exception("internal error on %s %s", method, path)
            self._send_json(
                500, error_body(f"internal server error: {type(e).__name__}: {e}", "server_error")
            )

    # ------------------------------------------------------------------ routes
    def _health(self) -> None:
        self._send_json(
            200, {"status": "ok", "model": self.server.served.name, **self.server.stats()}
        )

    def _models(self) -> None:
        self._send_json(200, models_list(self.server.served))

    def _model(self) -> None:
        self._send_json(200, model_card(self.server.served))

    def _completions(self) -> None:
        self._generate(parse_completion(self._read_json(), self.server.served))

    def _chat(self) -> None:
        body = self._read_json()
        self._generate(parse_chat(body, self.server.served, self.server.chat_template))

    # ------------------------------------------------------------------ generation
    def _generate(self, parsed: ParsedRequest) -> None:
        srv = self.server
        try:
            handle = srv.engine.submit(parsed.request)
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - e.g. the engine is closed or refuses the request
            raise APIError(_status_of(e), f"the engine refused the request: {e}") from None
        srv.count("requests")
        srv.count("active")
        try:
            if parsed.stream:
                self._stream(parsed, handle)
            else:
                try:
                    self._whole(parsed, handle)
                except _ClientGone:
                    self._abandon(handle)
                    raise
        finally:
            srv.count("active", -1)

    def _whole(self, parsed: ParsedRequest, handle: RequestHandle) -> None:
        created = int(time.time())
        text, tokens, last = [], [], Event()
        for ev in self._events(handle):
            text.append(ev.text)
            tokens.extend(ev.token_ids)
            last = ev
        _raise_failed(last)
        body = full_response(
            parsed, self.server.served, "".join(text), tokens, last.finish_reason, created
        )
        self._send_json(200, body)

    def _stream(self, parsed: ParsedRequest, handle: RequestHandle) -> None:
        srv = self.server
        created = int(time.time())
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        n_tokens = 0
        try:
            if parsed.kind == "chat":
                self._sse(stream_chunk(parsed, srv.served, created, text="", role=True))
            for ev in self._events(handle):
                n_tokens += len(ev.token_ids)
                if ev.finish_reason in ("error", "cancelled"):
                    status = 500 if ev.finish_reason == "error" else 503
                    message = ev.error or "the request was cancelled (is the server shutting down?)"
                    logger.error("request %s failed: %s", parsed.request.request_id, message)
                    srv.count("errors")
                    kind = "server_error" if status == 500 else "service_unavailable"
                    self._sse(error_body(message, kind, code=str(status)))
                    break
                if ev.text or (ev.token_ids and parsed.return_token_ids):
                    self._sse(stream_chunk(parsed, srv.served, created, ev.text, ev.token_ids))
                if ev.finish_reason is not None:
                    self._sse(
                        stream_chunk(parsed, srv.served, created, engine_reason=ev.finish_reason)
                    )
            if parsed.include_usage:
                self._sse(usage_chunk(parsed, srv.served, created, n_tokens))
            self._write_chunk(b"data: [DONE]\n\n")
            self._write_chunk(b"")
        except _ClientGone:
            self._abandon(handle)
            raise
        except Exception:  # noqa: BLE001 - headers are sent: end the stream with an error event
            logger.exception("stream of request %s failed", parsed.request.request_id)
            handle.cancel()
            srv.count("errors")
            try:
                self._sse(error_body("internal server error while streaming", "server_error"))
                self._write_chunk(b"data: [DONE]\n\n")
                self._write_chunk(b"")
            except _ClientGone:
                pass

    def _events(self, handle: RequestHandle) -> Iterator[Event]:
        """The handle's events; raises _ClientGone if the client leaves (the caller cancels).

        The client is checked at the first event, then every _POLL_S while events flow or not:
        a non-streamed answer writes nothing until the end, so only this check notices."""
        checked = 0.0
        while True:
            try:
                for ev in handle.events(timeout=_POLL_S):
                    now = time.monotonic()
                    if ev.finish_reason is None and now - checked > _POLL_S:
                        checked = now
                        if self._client_gone():
                            raise _ClientGone()
                    yield ev
                return
            except queue.Empty:
                if self._client_gone():
                    raise _ClientGone() from None

    def _abandon(self, handle: RequestHandle) -> None:
        """The client left: cancel its request once, so the engine stops working for nobody."""
        if not handle.cancelled:
            handle.cancel()
            self.server.count("cancelled")
            logger.info("client left; cancelled request %s", handle.request.request_id)

    def _client_gone(self) -> bool:
        """True when the peer closed its side (readable, and a peek reads EOF) or the socket broke.

        poll, not select: select fails on descriptors past 1024 on a busy server."""
        try:
            poller = select.poll()
            poller.register(self.connection, select.POLLIN | select.POLLERR | select.POLLHUP)
            ready = poller.poll(0)
            if not ready:
                return False
            if ready[0][1] & (select.POLLERR | select.POLLHUP):
                return True
            return self.connection.recv(1, socket.MSG_PEEK) == b""  # readable: returns at once
        except (OSError, ValueError):
            return True

    # ------------------------------------------------------------------ I/O
    def _read_json(self) -> dict[str, Any]:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            self.close_connection = True
            raise APIError(411, "chunked request bodies are not supported; send a Content-Length")
        raw_length = self.headers.get("Content-Length")
        try:
            length = int(raw_length) if raw_length is not None else 0
        except ValueError:
            self.close_connection = True
            raise APIError(400, f"bad Content-Length {raw_length!r}") from None
        if length > self.server.max_body_bytes:
            self.close_connection = True  # the body stays unread: this connection is done
            raise APIError(
                413,
                f"the request body is {length} bytes; this server accepts at most "
                f"{self.server.max_body_bytes} bytes",
                code="request_too_large",
            )
        if length <= 0:
            raise APIError(400, "the request has no body; send a JSON object")
        raw = self.rfile.read(length)
        if len(raw) < length:
            self.close_connection = True
            raise _ClientGone()
        return parse_json_body(raw)

    def _send_json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode("utf-8")
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
            self.wfile.flush()
        except OSError:
            self.close_connection = True

    def _sse(self, body: dict[str, Any]) -> None:
        self._write_chunk(b"data: " + json.dumps(body).encode("utf-8") + b"\n\n")

    def _write_chunk(self, data: bytes) -> None:
        try:
            self.wfile.write(b"%X\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
        except OSError:
            self.close_connection = True
            raise _ClientGone() from None

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (malformed request line, unknown method...) as OpenAI JSON."""
        self.close_connection = True
        text = message or self.responses.get(code, ("error",))[0]
        kind = "invalid_request_error" if code < 500 else "server_error"
        self._send_json(code, error_body(f"{text}{f': {explain}' if explain else ''}", kind))

    def log_message(self, format: str, *args: Any) -> None:
        logger.info("%s %s", self.address_string(), format % args)


def _raise_failed(last: Event) -> None:
    if last.finish_reason == "error":
        raise APIError(500, f"generation failed: {last.error or 'unknown engine error'}")
    if last.finish_reason == "cancelled":
        raise APIError(
            503,
            "the request was cancelled (is the server shutting down?)",
            type="service_unavailable",
        )


def _status_of(e: Exception) -> int:
    from specport.errors import ContextLengthError, InputError

    return 400 if isinstance(e, (InputError, ContextLengthError)) else 503
