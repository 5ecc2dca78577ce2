"""Overload: a full queue is refused at once (503 + Retry-After), `/ready` tells a load balancer
the truth, and a request past `--request-timeout` is cancelled and answered 504.

The server is real (uvicorn, the serial engine on the tiny Llama: one request at a time, so
concurrent requests queue in the engine). The load is sized from a request timed in the test,
so the queue fills on a fast machine or a slow one.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.runtime.serve.helpers import serve, state

LONG = {"prompt": [1, 5, 9], "max_tokens": 120, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def serial_server(tiny_model):
    from specport.runtime.engine import make_engine

    engine = make_engine(tiny_model, kind="serial")
    server = serve(tiny_model, engine, model_name="tiny", max_queue=2)
    yield server
    server.stop()
    engine.close()


def _post(server: Any, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120)


def _one_request_s(server: Any) -> float:
    t0 = time.perf_counter()
    assert _post(server, LONG).status_code == 200
    return time.perf_counter() - t0


def test_full_queue_is_503_with_retry_after(serial_server):
    _one_request_s(serial_server)  # warm
    with ThreadPoolExecutor(12) as pool:
        replies = list(pool.map(lambda _: _post(serial_server, LONG), range(12)))
        ready = httpx.get(serial_server.url + "/ready")  # the queue is (still) full now?
    codes = sorted(r.status_code for r in replies)
    assert set(codes) <= {200, 503}, codes
    refused = [r for r in replies if r.status_code == 503]
    assert refused and 200 in codes, codes
    for r in refused:
        assert r.headers["Retry-After"] == "1"
        err = r.json()["error"]
        assert err["code"] == "server_overloaded" and "--max-queue 2" in err["message"], err
    assert ready.status_code in (200, 503)
    if ready.status_code == 503:
        assert "queue is full" in ready.json()["reason"]
        assert ready.headers["Retry-After"] == "1"
    assert state(serial_server).counters["refused"] >= len(refused)
    # once the queue drains, the server is ready and serves again
    deadline = time.time() + 60
    while httpx.get(serial_server.url + "/ready").status_code != 200:
        assert time.time() < deadline
        time.sleep(0.05)
    assert httpx.get(serial_server.url + "/ready").json()["status"] == "ready"
    assert _post(serial_server, LONG).status_code == 200


def test_ready_is_503_while_the_queue_is_full(serial_server):
    """/ready answers 503 while `max_queue` requests wait (here the 16 choices of one request,
    which the serial engine decodes one after another), and 200 again after."""
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(_post, serial_server, {**LONG, "n": 16})
        seen = set()
        while not reply.done():
            seen.add(httpx.get(serial_server.url + "/ready").status_code)
    assert reply.result().status_code == 200
    assert 503 in seen, seen
    assert httpx.get(serial_server.url + "/ready").status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_request_timeout_is_504_and_frees_the_engine(serial_server, stream):
    """A request of 16 choices (16 requests' work on the serial engine) against a timeout of
    a quarter of its time alone: it is answered 504 (a stream: an error event) and its choices
    still queued are cancelled."""
    body = {**LONG, "n": 16, "stream": stream}
    t0 = time.perf_counter()
    assert _post(serial_server, body).status_code == 200
    alone = time.perf_counter() - t0
    app = state(serial_server)
    cancelled = app.engine.stats()["cancelled"]
    app.settings.request_timeout_s = alone / 4
    try:
        reply = _post(serial_server, body)
    finally:
        app.settings.request_timeout_s = None
    if stream:  # the status went out with the first byte: the timeout is an SSE error event
        assert reply.status_code == 200
        events = [e for e in reply.text.split("\n\n") if e.startswith("data: {")]
        error = json.loads(events[-1][len("data: ") :])["error"]
        assert error["type"] == "timeout_error" and "--request-timeout" in error["message"]
        assert reply.text.rstrip().endswith("data: [DONE]")
    else:
        assert reply.status_code == 504, reply.text
        err = reply.json()["error"]
        assert err["code"] == "request_timeout" and "--request-timeout" in err["message"]
    assert app.counters["timeouts"] >= 1
    # the choices still queued were cancelled, not left to run for nobody
    deadline = time.time() + 60
    while app.engine.stats()["cancelled"] <= cancelled:
        assert time.time() < deadline
        time.sleep(0.05)
    assert _post(serial_server, LONG).status_code == 200


def test_draining_server_is_not_ready_and_refuses(serial_server):
    """After SIGTERM (`Server.start_drain` sets `draining`) /ready says 503 at once, so a load
    balancer stops sending, and a request that still comes is refused, not started."""
    app = state(serial_server)
    app.draining = True
    try:
        ready = httpx.get(serial_server.url + "/ready")
        reply = _post(serial_server, LONG)
    finally:
        app.draining = False
    assert ready.status_code == 503 and "shutting down" in ready.json()["reason"]
    assert reply.status_code == 503 and reply.headers["Retry-After"] == "1"
    assert "shutting down" in reply.json()["error"]["message"]
    assert httpx.get(serial_server.url + "/ready").status_code == 200


@pytest.mark.slow
def test_twice_the_capacity_is_answered_or_refused(bytes_batching):
    """Poisson arrivals at twice what the batching engine serves (measured here: 2 rows, a
    request's time alone), through the open-loop load test: every request is answered in full
    or refused with 503, the refusals are counted, the KV held stays within the KV space and
    the server still answers after."""
    import asyncio
    from collections import Counter

    from specport.bench import workload
    from specport.bench.loadtest import client_for
    from specport.runtime.engine import make_engine

    model, _ = bytes_batching
    engine = make_engine(model, max_batch=2, kind="batching")
    server = serve(model, engine, model_name="bytes", max_queue=2)
    try:
        body = {"prompt": "Once upon a", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
        _post(server, body)  # warm
        t0 = time.perf_counter()
        assert _post(server, body).status_code == 200
        capacity = 2 / (time.perf_counter() - t0)  # requests/s with both rows busy, at best
        items = workload.build(24, 2 * capacity, (3, 8), (48, 48), seed=0)

        async def run() -> list[Any]:
            client = client_for(server.url, "unused")
            try:
                return (await workload.run_rate(client, "bytes", items))[0]
            finally:
                await client.close()

        outcomes = asyncio.run(run())
        kinds = Counter(o.error for o in outcomes)
        assert set(kinds) <= {None, "http 503"}, kinds
        assert all(o.tokens == 48 for o in outcomes if o.error is None)
        assert kinds[None] >= 2
        assert state(server).counters["refused"] == kinds["http 503"]
        stats = engine.stats()
        if stats.get("kv_space_tokens"):
            assert stats["kv_reserved_tokens"] <= stats["kv_space_tokens"]
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        assert _post(server, body).status_code == 200
    finally:
        server.stop()
        engine.close()
