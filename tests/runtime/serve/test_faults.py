"""A request that fails inside the engine, in the middle of a batch, fails alone: its client gets
an OpenAI error (500, or an SSE error event), the requests decoding beside it in the same batch
finish with the tokens they get alone, and the server keeps serving.

The failure is a grammar backend raising on a request's 5th token. Nothing a client can send
makes xgrammar raise today, so the one test-side piece is `_FaultyGrammars`: the server's real
grammar compiler, whose constraint for one regex raises from `accept` (the call the engine makes
for every token of a structured request). Everything else is real: HTTP, the batching engine,
onnxruntime, the tokenizer, xgrammar's masks for the other tokens.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest

from tests.runtime.serve.helpers import CHAT_TEMPLATE, assert_error, call, serve, stream

pytest.importorskip("xgrammar", reason="structured outputs need specport[structured]")

FAULT = "[a-z]{20}"  # the regex whose requests fail
FAIL_AT = 5  # ... at their 5th token


class _FaultyGrammars:
    """The real compiler, except that constraints for FAULT raise at their FAIL_AT-th token."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.faulty: set[int] = set()

    def compile(self, kind: str, spec: Any) -> Any:
        compiled = self.real.compile(kind, spec)
        if kind == "regex" and spec == FAULT:
            self.faulty.add(id(compiled))
        return compiled

    def constraint(self, compiled: Any) -> Any:
        constraint = self.real.constraint(compiled)
        if id(compiled) not in self.faulty:
            return constraint
        accept, seen = constraint.accept, [0]

        def failing_accept(token: int) -> bool:
            seen[0] += 1
            if seen[0] == FAIL_AT:
                raise RuntimeError("grammar matcher fell over")
            return bool(accept(token))

        constraint.accept = failing_accept
        return constraint

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


@pytest.fixture(scope="module")
def faulty(bytes_batching):
    from specport.runtime.engine import make_engine

    model, _ = bytes_batching
    engine = make_engine(model, max_batch=4, kind="batching")
    server = serve(model, engine, model_name="bytes", chat_template=CHAT_TEMPLATE)
    served = server.app.state.specport.served
    served._grammars = _FaultyGrammars(served.grammars())
    yield server, engine
    server.stop()
    engine.close()


PLAIN = {"prompt": "Once", "max_tokens": 100, "temperature": 0, "ignore_eos": True}
BROKEN = {"prompt": "Once", "max_tokens": 100, "temperature": 0, "guided_regex": FAULT}


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    with httpx.Client(timeout=120) as c:
        r = c.post(url + "/v1/completions", json=body)
        return r.status_code, r.json()


@pytest.mark.slow  # exports its own shared-KV tiny model (~10 s)
def test_engine_error_mid_batch_fails_only_that_request(faulty):
    server, engine = faulty
    status, alone = call(server, "POST", "/v1/completions", PLAIN)
    assert status == 200
    want = alone["choices"][0]["text"]
    status, body = call(server, "POST", "/v1/completions", BROKEN)
    assert_error(status, body, 500, "grammar matcher fell over")
    assert body["error"]["type"] == "server_error"

    # three plain requests and a failing one (whole and streamed) decode in one batch of 4
    results: dict[str, Any] = {}

    def run(name: str, body: dict[str, Any]) -> None:
        if body.get("stream"):
            results[name] = stream(server, "/v1/completions", body)
        else:
            results[name] = _post(server.url, body)

    jobs = [(f"plain{i}", PLAIN) for i in range(3)] + [("broken", BROKEN)]
    jobs += [
        ("plain-stream", {**PLAIN, "stream": True}),
        ("broken-stream", {**BROKEN, "stream": True}),
    ]
    threads = [threading.Thread(target=run, args=job) for job in jobs]
    errors_before = engine.stats()["errors"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for i in range(3):
        status, body = results[f"plain{i}"]
        assert status == 200 and body["choices"][0]["text"] == want, body
    status, body = results["broken"]
    assert_error(status, body, 500, "grammar matcher fell over")
    events = results["plain-stream"]
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want
    events = results["broken-stream"]
    assert events[-1] == "[DONE]", events
    assert "grammar matcher fell over" in events[-2]["error"]["message"], events
    assert engine.stats()["errors"] == errors_before + 2
    # and the server goes on serving, the grammar path included
    assert call(server, "POST", "/v1/completions", PLAIN)[1]["choices"][0]["text"] == want
    status, body = call(server, "POST", "/v1/completions", {**BROKEN, "guided_regex": "[0-9]{3}"})
    assert status == 200 and len(body["choices"][0]["text"]) == 3, body
    _, health = call(server, "GET", "/health")
    assert health["status"] == "ok" and health["active"] == 0, health
    assert json.dumps(health)  # a plain JSON body


def test_client_that_stops_reading_is_dropped_and_freed(tiny_model, caplog):
    """A client that sends requests and then reads nothing holds nothing for long: once a send
    waits longer than the send timeout (the kernel's and uvicorn's buffers full) the server
    drops it with a log line, nothing stays counted as active, and others are served."""
    import logging
    import socket
    import time

    from specport.runtime.engine import make_engine
    from tests.runtime.serve.helpers import state

    engine = make_engine(tiny_model, kind="serial")
    server = serve(tiny_model, engine, send_timeout_s=1.0)
    body = {"prompt": [1, 2, 3], "max_tokens": 120, "temperature": 0, "ignore_eos": True}
    big = json.dumps({**body, "n": 16, "logprobs": 20, "stream": True}).encode()  # 1.4 MB of SSE
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(big), big)
    )
    try:
        with caplog.at_level(logging.WARNING, logger="specport.runtime.serve.guard"):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, never read
            s.connect(server.address)
            s.sendall(request * 5)  # pipelined: more than a socket's 4 MB send buffer can hold
            try:
                t0 = time.monotonic()
                deadline = t0 + 60
                while time.monotonic() < deadline and "took no data" not in caplog.text:
                    time.sleep(0.1)
                assert "took no data for 1 s; dropped it" in caplog.text
                assert call(server, "POST", "/v1/completions", body)[0] == 200  # others go on
                while time.monotonic() < deadline and state(server).counters["active"] > 0:
                    time.sleep(0.1)
                assert state(server).counters["active"] == 0, state(server).counters
            finally:
                s.close()
        assert engine.stats()["waiting"] == 0
        _, health = call(server, "GET", "/health")
        assert health["status"] == "ok" and health["active"] == 0
    finally:
        server.stop()
        engine.close()
