"""Open-loop serving workloads for `specport loadtest --rate`: what arrives, when, and how it went.

A workload is a list of requests (prompt text, answer length, arrival time), as vLLM's
`vllm bench serve` draws them: prompt and answer lengths from a range (uniform, seeded) or the
prompts of a file, a share of every prompt that is one common prefix (a system prompt, a shared
document: what a prefix cache is for), arrivals from a Poisson process at a rate or a burstier
gamma process (`burstiness` < 1, vLLM's knob). Requests are sent at their times whatever the
server is doing (open loop: a slow server faces a growing queue, as in production), optionally
bounded by `max_concurrency` in flight.

Prompt lengths are counted in words of a fixed vocabulary (about one token each for BPE
tokenizers); the report gives the server's own count (`usage.prompt_tokens`). Each request asks
for `ignore_eos`, so answers are as long as drawn where the server supports it (vLLM, llama.cpp,
specport); others ignore the field.

Per request: time to first token (TTFT), time per output token after the first (TPOT), end to
end latency, or the error's kind (HTTP status, timeout, connection). Per rate: throughput,
percentiles, errors by kind and goodput, the requests per second that met the latency objective
(TTFT and TPOT at most the given ms, as `vllm bench serve --goodput`).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specport.bench.arrivals import arrival_offsets
from specport.bench.loadtest import WORDS, client_for
from specport.core.errors import InputError


@dataclass(frozen=True)
class Item:
    prompt: str
    max_tokens: int
    at: float  # seconds after the start


@dataclass
class Outcome:
    ttft: float | None = None
    e2e: float | None = None
    tokens: int = 0
    prompt_tokens: int | None = None
    error: str | None = None  # its kind: "http 503", "timeout", "connection", ...

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.tokens - 1)


def length_range(text: str, name: str) -> tuple[int, int]:
    """`N` or `LO:HI` (inclusive) as a range of positive integers."""
    try:
        lo, _, hi = text.partition(":")
        bounds = (int(lo), int(hi or lo))
    except ValueError:
        bounds = (0, 0)
    if not 1 <= bounds[0] <= bounds[1]:
        raise InputError(f"{name} takes N or LO:HI with 1 <= LO <= HI, got {text!r}")
    return bounds


def read_prompts(path: str) -> list[tuple[str, int | None]]:
    """Prompts of a file: JSON lines with "prompt" (and "max_tokens" if wanted), else one prompt
    per non-empty line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(
            f"cannot read --prompts {path}: {getattr(e, 'strerror', None) or e}"
        ) from None
    out: list[tuple[str, int | None]] = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if path.endswith(".jsonl"):
            try:
                row = json.loads(line)
                out.append((str(row["prompt"]), row.get("max_tokens")))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise InputError(
                    f'{path}:{i}: each line must be a JSON object with "prompt"'
                ) from None
        else:
            out.append((line, None))
    if not out:
        raise InputError(f"--prompts {path} holds no prompt")
    return out


def build(
    requests: int,
    rate: float | None,
    prompt_len: tuple[int, int],
    answer_len: tuple[int, int],
    *,
    shared_prefix: float = 0.0,
    burstiness: float = 1.0,
    prompts_file: str | None = None,
    seed: int = 0,
) -> list[Item]:
    """`requests` requests (see the module docstring); the same seed gives the same workload."""
    if not 0.0 <= shared_prefix < 1.0:
        raise InputError(f"--shared-prefix is a share in [0, 1), got {shared_prefix}")
    rng = np.random.default_rng(seed)
    at = arrival_offsets(requests, rate, seed, burstiness)
    answers = rng.integers(answer_len[0], answer_len[1] + 1, requests)
    if prompts_file is not None:
        given = read_prompts(prompts_file)
        picked = [given[i % len(given)] for i in range(requests)]
        return [
            Item(p, int(m if m is not None else a), t)
            for (p, m), a, t in zip(picked, answers, at, strict=True)
        ]
    lengths = rng.integers(prompt_len[0], prompt_len[1] + 1, requests)
    prefix = _words(rng, round(shared_prefix * prompt_len[0]))
    items = []
    for i, (n, a, t) in enumerate(zip(lengths, answers, at, strict=True)):
        own = _words(rng, max(1, int(n) - len(prefix)))
        own[0] = f"#{i}"  # unique from here on: no two requests share more than the prefix
        items.append(Item(" ".join(prefix + own), int(a), t))
    return items


def _words(rng: np.random.Generator, n: int) -> list[str]:
    return [str(w) for w in rng.choice(WORDS, size=n)] if n > 0 else []


async def _one(client: Any, model: str, item: Item) -> Outcome:
    import openai

    out = Outcome()
    t0 = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model,
            prompt=item.prompt,
            max_tokens=item.max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = 0
        async for chunk in stream:
            if chunk.usage is not None:
                out.tokens = chunk.usage.completion_tokens
                out.prompt_tokens = chunk.usage.prompt_tokens
            if chunk.choices and chunk.choices[0].text:
                chunks += 1
                if out.ttft is None:
                    out.ttft = time.perf_counter() - t0
        out.e2e = time.perf_counter() - t0
        out.tokens = out.tokens or chunks
        if out.ttft is None:
            out.error = "no tokens"
    except openai.APIStatusError as e:
        out.error = f"http {e.status_code}"
    except openai.APITimeoutError:
        out.error = "timeout"
    except openai.APIConnectionError:
        out.error = "connection"
    except Exception as e:  # noqa: BLE001 - e.g. an SSE error event mid-stream; counted
        out.error = type(e).__name__
    return out


async def run_rate(
    client: Any, model: str, items: list[Item], max_concurrency: int | None = None
) -> tuple[list[Outcome], float]:
    """Send each item at its time (open loop); the outcomes in order and the wall time."""
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()

    async def at(item: Item) -> Outcome:
        await asyncio.sleep(max(0.0, t0 + item.at - time.perf_counter()))
        if gate is None:
            return await _one(client, model, item)
        async with gate:
            return await _one(client, model, item)

    outcomes = await asyncio.gather(*(at(i) for i in items))
    return list(outcomes), time.perf_counter() - t0


def summary(
    rate: float | None,
    outcomes: list[Outcome],
    wall: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> dict[str, Any]:
    """One row: throughput, TTFT / TPOT / E2E p50 p90 p99 (ms), errors by kind, goodput."""
    ok = [o for o in outcomes if o.error is None]

    def pct(values: list[float]) -> list[float | None]:
        if not values:
            return [None, None, None]
        return [round(1e3 * float(np.percentile(values, q)), 1) for q in (50, 90, 99)]

    def good(o: Outcome) -> bool:
        ttft_ok = slo_ttft_ms is None or (o.ttft or math.inf) * 1e3 <= slo_ttft_ms
        tpot = o.tpot
        tpot_ok = slo_tpot_ms is None or tpot is None or tpot * 1e3 <= slo_tpot_ms
        return ttft_ok and tpot_ok

    met = sum(good(o) for o in ok)
    prompt_tokens = [o.prompt_tokens for o in ok if o.prompt_tokens is not None]
    return {
        "rate": "inf" if rate is None or math.isinf(rate) else rate,
        "requests": len(outcomes),
        "completed": len(ok),
        "errors": dict(Counter(o.error for o in outcomes if o.error is not None)),
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(ok) / wall, 3),
        "output_tokens_per_s": round(sum(o.tokens for o in ok) / wall, 1),
        "mean_prompt_tokens": round(float(np.mean(prompt_tokens)), 1) if prompt_tokens else None,
        "ttft_ms": pct([o.ttft for o in ok if o.ttft is not None]),
        "tpot_ms": pct([t for o in ok if (t := o.tpot) is not None]),
        "e2e_ms": pct([o.e2e for o in ok if o.e2e is not None]),
        "goodput_requests_per_s": round(met / wall, 3),
        "slo_met": round(met / len(outcomes), 3) if outcomes else None,
    }


async def sweep(
    url: str,
    model: str,
    api_key: str,
    rates: list[float | None],
    make: Any,  # rate -> list[Item]
    max_concurrency: int | None = None,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> list[dict[str, Any]]:
    """One row per rate (`make(rate)` gives its requests), rates in the order given."""
    client = client_for(url, api_key)
    rows = []
    try:
        for rate in rates:
            outcomes, wall = await run_rate(client, model, make(rate), max_concurrency)
            rows.append(summary(rate, outcomes, wall, slo_ttft_ms, slo_tpot_ms))
    finally:
        await client.close()
    return rows


COLUMNS = (
    "| rate req/s | done/sent | req/s | output tok/s | prompt tok | TTFT p50/p90/p99 ms "
    "| TPOT p50/p90/p99 ms | E2E p50/p99 ms | goodput req/s (SLO met) | errors |"
)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [COLUMNS, "|" + "---|" * (COLUMNS.count("|") - 1)]

    def three(values: list[float | None]) -> str:
        return " / ".join("-" if v is None else f"{v:g}" for v in values)

    for r in rows:
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(r["errors"].items())) or "0"
        e2e = r["e2e_ms"]
        lines.append(
            f"| {r['rate']} | {r['completed']}/{r['requests']} | {r['requests_per_s']} | "
            f"{r['output_tokens_per_s']} | {r['mean_prompt_tokens'] or '-'} | {three(r['ttft_ms'])} | "
            f"{three(r['tpot_ms'])} | {e2e[0] or '-'} / {e2e[2] or '-'} | "
            f"{r['goodput_requests_per_s']} ({r['slo_met']}) | {errors} |"
        )
    return "\n".join(lines)


@dataclass
class Plan:
    """What the CLI asked for, for the report's title."""

    requests: int
    prompt_len: tuple[int, int]
    answer_len: tuple[int, int]
    shared_prefix: float = 0.0
    burstiness: float = 1.0
    prompts_file: str | None = None
    seed: int = 0

    def title(self) -> str:
        what = (
            f"prompts from {self.prompts_file}"
            if self.prompts_file
            else f"prompts {self.prompt_len[0]}-{self.prompt_len[1]} words"
        )
        shape = "Poisson" if self.burstiness == 1.0 else f"gamma, burstiness {self.burstiness:g}"
        return (
            f"{self.requests} requests per rate, {what}, answers {self.answer_len[0]}-"
            f"{self.answer_len[1]} tokens, shared prefix {self.shared_prefix:.0%}, arrivals "
            f"{shape} (seed {self.seed})"
        )
