"""`specport loadtest` retries a connection that fails before the first token on a fresh
connection and counts it apart (llama.cpp's server closes keep-alive connections); a failure
after the first token stays an error."""

from __future__ import annotations

import asyncio
from typing import Any

from specport.bench import loadtest


class _Client:
    base_url = "http://127.0.0.1:9/v1/"
    api_key = "k"

    def __init__(self) -> None:
        self.closed = False

    async def close(self) -> None:
        self.closed = True


def _run(outcomes: list[loadtest.Result], monkeypatch) -> tuple[loadtest.Result, list[Any]]:
    used: list[Any] = []
    made: list[Any] = []

    async def attempt(client: Any, model: str, prompt: str, max_tokens: int) -> loadtest.Result:
        used.append(client)
        return outcomes.pop(0)

    def fresh(url: str, api_key: str) -> _Client:
        assert url == "http://127.0.0.1:9" and api_key == "k"
        made.append(_Client())
        return made[-1]

    monkeypatch.setattr(loadtest, "_attempt", attempt)
    monkeypatch.setattr(loadtest, "client_for", fresh)
    first = _Client()
    result = asyncio.run(loadtest.one(first, "m", "p", 4))
    assert used[0] is first and used[1:] == made  # every retry on its own new client
    assert all(c.closed for c in made)
    return result, made


def test_connection_failure_before_first_token_is_retried(monkeypatch) -> None:
    dropped = loadtest.Result(error="APIConnectionError: closed", connection_failed=True)
    ok = loadtest.Result(text="abc", tokens=3, ttft=0.01)
    result, made = _run([dropped, dropped, ok], monkeypatch)
    assert result.error is None and result.text == "abc" and result.reconnects == 2
    assert len(made) == 2


def test_retries_are_bounded(monkeypatch) -> None:
    dropped = loadtest.Result(error="APIConnectionError: refused", connection_failed=True)
    result, made = _run([dropped] * (loadtest.RETRIES + 1), monkeypatch)
    assert result.error and result.reconnects == loadtest.RETRIES


def test_failure_mid_stream_is_an_error_not_a_retry(monkeypatch) -> None:
    cut = loadtest.Result(text="ab", tokens=2, error="APIConnectionError: reset")
    result, made = _run([cut], monkeypatch)
    assert result.error and result.reconnects == 0 and made == []
