"""Load and fault test for an OpenAI-compatible server (specport's, or any peer's).

    specport loadtest http://127.0.0.1:8000 --model NAME --concurrency 1,4,16,64 \
        --requests 64 --max-tokens 64 [--faults] [--plot load.svg]
    specport loadtest --peer llama.cpp --artifact ART --gguf FILE.gguf \
        --concurrency 1,4,16,64 --requests 64 --max-tokens 64 [--out table.md]

Built on the official `openai` async client (streaming, as users call it). First the greedy
answer of every prompt is taken one request at a time (the reference); then, per concurrency
level, every request's streamed answer must equal its own prompt's reference (complete, not
truncated, not another request's). Reported per level, as serving benchmarks do: requests/s,
output tokens/s, time to first token and inter-token latency at p50/p90/p99, errors and
mismatches. `--faults` then hits the server with what misbehaving clients send (a stream dropped
halfway, a truncated body, an oversized body, garbage bytes, an idle connection) and checks after
each that it still answers correctly. Speed claims come from here, never from timed tests.

A connection-level failure before the first streamed token (a refused or reset connection, a
keep-alive connection the server closed, as llama.cpp's server does) is retried on a fresh
connection, up to `RETRIES` times, and counted apart (`reconnects`): it says something about
the server's connection handling, not about its answers. A failure after the first token is an
error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import numpy as np

logger = logging.getLogger(__name__)

WORDS = [
    "once",
    "upon",
    "a",
    "time",
    "there",
    "was",
    "a",
    "little",
    "cat",
    "who",
    "liked",
    "to",
    "play",
    "in",
    "the",
    "sun",
    "with",
    "a",
    "red",
    "ball",
]


def prompts(count: int, seed: int = 0) -> list[str]:
    """Distinct seeded text prompts (the same for every run with the same seed)."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(4, 12)))) for _ in range(count)]


RETRIES = 3  # fresh connections tried after a connection-level failure before the first token


@dataclass
class Result:
    text: str = ""
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None
    reconnects: int = 0
    connection_failed: bool = False  # the error was a connection failure before any token


async def one(client: Any, model: str, prompt: str, max_tokens: int) -> Result:
    """One streamed greedy request; connection failures before the first token are retried on
    a fresh connection (a new client with its own pool) and counted in `reconnects`."""
    out = await _attempt(client, model, prompt, max_tokens)
    reconnects = 0
    while out.connection_failed and reconnects < RETRIES:
        reconnects += 1
        fresh = client_for(str(client.base_url).rstrip("/").removesuffix("/v1"), client.api_key)
        try:
            out = await _attempt(fresh, model, prompt, max_tokens)
        finally:
            await fresh.close()
    out.reconnects = reconnects
    return out


async def _attempt(client: Any, model: str, prompt: str, max_tokens: int) -> Result:
    import openai

    out = Result()
    t0 = time.perf_counter()
    last = t0
    chunks = 0
    try:
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                out.tokens = chunk.usage.completion_tokens
            if not chunk.choices or not chunk.choices[0].text:
                continue
            chunks += 1
            if out.ttft is None:
                out.ttft = now - t0
            else:
                out.gaps.append(now - last)
            last = now
            out.text += chunk.choices[0].text
        if not out.tokens:  # no usage chunk (llama-cpp-python's server): one token per chunk
            out.tokens = chunks
    except openai.APIConnectionError as e:  # includes timeouts; reset, refused, closed
        out.error = f"{type(e).__name__}: {e}"
        out.connection_failed = chunks == 0
    except Exception as e:  # noqa: BLE001 - counted and reported, the run goes on
        out.error = f"{type(e).__name__}: {e}"
    return out


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q) * 1e3) if values else float("nan")


async def level(
    client: Any,
    model: str,
    texts: list[str],
    refs: dict[str, str],
    concurrency: int,
    max_tokens: int,
) -> dict[str, Any]:
    gate = asyncio.Semaphore(concurrency)

    async def gated(p: str) -> tuple[str, Result]:
        async with gate:
            return p, await one(client, model, p, max_tokens)

    t0 = time.perf_counter()
    done = await asyncio.gather(*(gated(p) for p in texts))
    wall = time.perf_counter() - t0
    results = [r for _, r in done]
    ttft = [r.ttft for r in results if r.ttft is not None]
    gaps = [g for r in results for g in r.gaps]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "errors": sum(r.error is not None for r in results),
        "reconnects": sum(r.reconnects for r in results),
        "mismatches": sum(r.error is None and r.text != refs[p] for p, r in done),
        "requests_per_s": round(len(results) / wall, 2),
        "output_tokens_per_s": round(sum(r.tokens for r in results) / wall, 1),
        "ttft_ms": [round(_pct(ttft, q), 1) for q in (50, 90, 99)],
        "itl_ms": [round(_pct(gaps, q), 2) for q in (50, 90, 99)],
    }


def client_for(url: str, api_key: str) -> Any:
    """The official async client on any OpenAI-compatible base URL (`http://host:port`)."""
    import openai

    return openai.AsyncOpenAI(  # its pool allows 1000 connections
        base_url=url.rstrip("/") + "/v1", api_key=api_key, max_retries=0, timeout=600
    )


async def references(client: Any, model: str, texts: list[str], max_tokens: int) -> dict[str, str]:
    """Each prompt's greedy answer, one request at a time: what every loaded answer must equal."""
    refs = {}
    for p in dict.fromkeys(texts):
        r = await one(client, model, p, max_tokens)
        if r.error:
            raise RuntimeError(f"reference request failed: {r.error}")
        refs[p] = r.text
    return refs


async def run_load(
    url: str, model: str, concurrency: list[int], requests: int, max_tokens: int, api_key: str
) -> list[dict[str, Any]]:
    client = client_for(url, api_key)
    texts = prompts(requests)
    refs = await references(client, model, texts, max_tokens)
    rows = []
    for c in concurrency:
        row = await level(client, model, texts, refs, c, max_tokens)
        logger.info("%s", row)
        rows.append(row)
    await client.close()
    return rows


# ---------------------------------------------------------------------------- faults


def _raw(url: str, data: bytes, read: bool = True, hold: float = 0.0) -> bytes:
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port or 80), timeout=30) as s:
        s.sendall(data)
        time.sleep(hold)
        if not read:
            return b""
        try:
            return s.recv(4096)
        except OSError:
            return b""


def faults(url: str, model: str, api_key: str, check: Any) -> dict[str, str]:
    """Each fault, then a correct answer from the server (`check()` returns True)."""
    body = json.dumps({"model": model, "prompt": "once upon", "max_tokens": 200, "stream": True})
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + auth
    cases = {
        "disconnect mid-stream": (head + f"Content-Length: {len(body)}\r\n\r\n{body}").encode(),
        "truncated body": (head + f"Content-Length: {len(body)}\r\n\r\n{body[:10]}").encode(),
        "oversized body": (head + "Content-Length: 99999999999\r\n\r\n{").encode(),
        "garbage bytes": b"\x00\xffGARBAGE \x13\x37\r\n\r\n",
        "idle connection": b"",
    }
    out = {}
    for name, data in cases.items():
        reply = _raw(
            url, data, read=name not in ("disconnect mid-stream", "truncated body"), hold=0.5
        )
        status = reply.split(b"\r\n", 1)[0].decode(errors="replace") if reply else "(closed)"
        out[name] = f"{status}; then {'serving correctly' if check() else 'BROKEN'}"
    return out


COLUMNS = (
    "| concurrency | req/s | output tok/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms "
    "| errors | mismatches | reconnects |"
)


def table(rows: list[dict[str, Any]], server: bool = False) -> str:
    """Markdown rows (with a leading `server` column when the rows carry one)."""
    head = ("| server " if server else "") + COLUMNS
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            (f"| {r['server']} " if server else "")
            + f"| {r['concurrency']} | {r['requests_per_s']} | {r['output_tokens_per_s']} | "
            f"{' / '.join(map(str, r['ttft_ms']))} | {' / '.join(map(str, r['itl_ms']))} | "
            f"{r['errors']} | {r['mismatches']} | {r.get('reconnects', 0)} |"
        )
    return "\n".join(lines)
