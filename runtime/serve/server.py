"""Run the app with uvicorn: bind first (so a busy port is a clear error), then serve.

`Server.serve_forever()` blocks in the main thread (the CLI: SIGINT / SIGTERM drain in-flight
requests for up to `drain_s`, then stop); `Server.start()` serves on a thread (tests, notebooks)
and `stop()` ends it. Malformed HTTP (garbage bytes, a bad request line) is answered by the
protocol layer before the app sees it; our protocol class makes that answer an OpenAI error
body too, and closes connections that send nothing at all within the keep-alive timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from typing import Any

import uvicorn

logger = logging.getLogger(__name__)

DRAIN_GRACE_S = 5.0  # after the drain timeout: time to deliver the cancelled requests' errors

try:  # the C parser when it is installed (uvicorn[standard]), else h11
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _Base
except ImportError:  # pragma: no cover
    from uvicorn.protocols.http.h11_impl import H11Protocol as _Base  # type: ignore[assignment]


class _Protocol(_Base):  # type: ignore[misc,valid-type]
    """uvicorn's HTTP protocol with OpenAI-style JSON for malformed requests and an idle timer
    from the moment a connection opens (uvicorn starts it only after a first request)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(
            {
                "error": {
                    "message": f"malformed HTTP request: {msg}",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": None,
                }
            }
        ).encode()
        head = (
            b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
        )
        self.transport.write(head + body)
        self.transport.close()


class _Uvicorn(uvicorn.Server):
    """uvicorn's server with a drain deadline: `drain_s` after the first signal, requests still
    in flight are cancelled through the app (`AppState.cancel_in_flight`), so their clients get
    a 503 error body or an SSE error event; uvicorn's own graceful timeout, `DRAIN_GRACE_S`
    later, only backs that up (it cuts connections)."""

    def __init__(self, config: uvicorn.Config, drain_s: float, app: Any) -> None:
        super().__init__(config)
        self.drain_s = drain_s
        self.app = app
        self._deadline: threading.Timer | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.should_exit:
            logger.warning(
                "shutting down: finishing requests in flight for up to %g s (signal %d)",
                self.drain_s,
                sig,
            )
            self.start_drain()
        super().handle_exit(sig, frame)

    def start_drain(self) -> None:
        state = getattr(getattr(self.app, "state", None), "specport", None)
        if state is not None:
            state.draining = True  # /ready answers 503 from now on, new requests too
        if self._deadline is None:
            self._deadline = threading.Timer(self.drain_s, self._expire)
            self._deadline.daemon = True
            self._deadline.start()

    def _expire(self) -> None:
        state = getattr(getattr(self.app, "state", None), "specport", None)
        n = state.cancel_in_flight() if state is not None else 0
        if n:
            logger.warning(
                "drain timeout (%g s): cancelled %d request(s) in flight", self.drain_s, n
            )


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0 = any free port); OSError when it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class Server:
    """uvicorn over an already-bound socket (see the module docstring)."""

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 8000,
        *,
        drain_s: float = 30.0,
        keep_alive_s: int = 5,
        log_level: str = "warning",
    ) -> None:
        self.sock = bind(host, port)
        self.app = app
        config = uvicorn.Config(
            app,
            http=_Protocol,
            lifespan="off",
            access_log=False,  # the app logs one structured line per request itself
            log_config=None,  # uvicorn's loggers go to whatever the host configured
            log_level=log_level,
            timeout_keep_alive=keep_alive_s,
            timeout_graceful_shutdown=drain_s + DRAIN_GRACE_S,  # type: ignore[arg-type]
            server_header=False,
        )
        self.server = _Uvicorn(config, drain_s, app)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.sock.getsockname()[:2]
        return str(host), int(port)

    def serve_forever(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        finally:
            if self.server._deadline is not None:
                self.server._deadline.cancel()

    def start(self, timeout: float = 30.0) -> Server:
        """Serve on a daemon thread; returns once it accepts connections."""
        self._thread = threading.Thread(
            target=self.serve_forever, name="specport-uvicorn", daemon=True
        )
        self._thread.start()
        waited = threading.Event()
        while not self.server.started and self._thread.is_alive():
            waited.wait(0.01)
        if not self.server.started:
            raise RuntimeError("the HTTP server did not start; see the log")
        return self

    def stop(self) -> None:
        """Stop serving (in-flight requests get `drain_s`) and release the port."""
        self.server.start_drain()
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=60)
        self.sock.close()
