"""Requests that arrive over time, and the per-request latency figures serving benchmarks report.

`specport bench --requests N --request-rate R` sends its requests the way vLLM's
benchmark_serving does: a seeded Poisson process (exponential gaps of mean 1/R seconds, the
first request at 0), each submitted from the bench's own thread at its time while the engine
works on the earlier ones. Submitting everything at once only measures a full batch; users of a
server see requests join a batch that is already running, and judge it by each request's own
time to first token (TTFT), time per output token after the first (TPOT) and end-to-end latency,
all from the moment that request arrived, not from the start of the run.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from specport.core.errors import InputError
from specport.runtime.engine.base import Request

logger = logging.getLogger(__name__)


def arrival_offsets(
    n: int, rate: float | None, seed: int = 0, burstiness: float = 1.0
) -> list[float]:
    """Seconds after the start at which each of `n` requests arrives.

    A Poisson process of `rate` requests per second from `seed`, as benchmark_serving draws it:
    the first request at 0, then exponential gaps. `burstiness` other than 1: gamma gaps of the
    same mean with that shape, as `vllm bench serve --burstiness` (below 1: bursts and lulls).
    `rate` None or infinite: all at 0 (today's "all at once" load). The same seed gives the
    same schedule, so two engines measured in turn face the same arrivals."""
    if rate is None or math.isinf(rate):
        return [0.0] * n
    if not rate > 0:  # also refuses nan
        raise InputError(f"the request rate must be > 0 requests/s (or inf), got {rate}.")
    if not burstiness > 0:
        raise InputError(f"the burstiness must be > 0 (1 = Poisson), got {burstiness}.")
    rng = np.random.default_rng(seed)
    if burstiness == 1.0:
        gaps = rng.exponential(1.0 / rate, max(n - 1, 0))
    else:
        gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), max(n - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:n]


@dataclass
class Served:
    """One request's timeline, seconds from its own arrival (when it was submitted)."""

    arrival_s: float  # scheduled arrival, from the start of the run
    late_ms: float  # how far the submission fell behind the schedule
    ttft_s: float
    e2e_s: float
    tokens: int

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None for a one-token answer."""
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else None


def serve_load(
    engine: Any, prompts: list[list[int]], new_tokens: int, offsets: list[float] | None = None
) -> dict[str, Any]:
    """Submit each prompt at its offset (all at once without `offsets`); wait for every answer.

    Returns tok_per_s (all generated tokens / wall time until the last request ends), wall_s,
    mean_ttft_ms, each request's `tokens` and its `served` timeline. A failed request raises:
    its figures would be meaningless."""
    offsets = offsets if offsets is not None else [0.0] * len(prompts)
    t0 = time.perf_counter()
    handles = []
    for prompt, at in zip(prompts, offsets, strict=True):
        wait = t0 + at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        handles.append(engine.submit(Request(prompt, new_tokens, ignore_eos=True)))
    results = [h.result(timeout=600) for h in handles]
    wall = time.perf_counter() - t0
    failed = [r.error for r in results if r.finish_reason == "error"]
    if failed:
        raise RuntimeError(failed[0])
    served: list[Served] = []
    for h, r, at in zip(handles, results, offsets, strict=True):
        if h.first_token_at is None or h.finished_at is None:
            raise RuntimeError(f"request {len(served)} ended without a token ({r.finish_reason})")
        served.append(
            Served(
                arrival_s=at,
                late_ms=1e3 * max(0.0, h.created - t0 - at),
                ttft_s=h.first_token_at - h.created,
                e2e_s=h.finished_at - h.created,
                tokens=len(r.token_ids),
            )
        )
    late = max(s.late_ms for s in served)
    if late > 50:
        logger.warning("requests were submitted up to %.0f ms behind their schedule", late)
    return {
        "tok_per_s": sum(len(r.token_ids) for r in results) / wall,
        "wall_s": wall,
        "mean_ttft_ms": 1e3 * float(np.mean([s.ttft_s for s in served])),
        "tokens": [r.token_ids for r in results],
        "served": served,
    }


def latency_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """TTFT, TPOT and end-to-end latency p50 / p99 (ms) over every request of `runs` (results of
    `serve_load`), and output tok/s over the whole of them (all tokens / all wall time)."""
    served: list[Served] = [s for run in runs for s in run["served"]]

    def pct(values: list[float], q: float) -> float | None:
        return round(1e3 * float(np.percentile(values, q)), 2) if values else None

    ttft = [s.ttft_s for s in served]
    tpot = [s.tpot_s for s in served if s.tpot_s is not None]
    e2e = [s.e2e_s for s in served]
    wall = sum(run["wall_s"] for run in runs)
    return {
        "requests": len(served),
        "ttft_ms_p50": pct(ttft, 50),
        "ttft_ms_p99": pct(ttft, 99),
        "tpot_ms_p50": pct(tpot, 50),
        "tpot_ms_p99": pct(tpot, 99),
        "e2e_ms_p50": pct(e2e, 50),
        "e2e_ms_p99": pct(e2e, 99),
        "output_tok_per_s": round(sum(s.tokens for s in served) / wall, 2) if wall else None,
        "late_ms_max": round(max((s.late_ms for s in served), default=0.0), 2),
    }


def served_rows(run: dict[str, Any]) -> list[dict[str, float]]:
    """A run's per-request timelines as JSON-able rows (seconds, late_ms in ms)."""
    return [{k: round(v, 4) for k, v in asdict(s).items()} for s in run["served"]]


def load_line(requests: int, rate: float | None, seed: int) -> str:
    """How the requests arrive, for a table's header."""
    if rate is None or math.isinf(rate):
        return f"{requests} concurrent requests"
    return f"{requests} requests arriving at {rate:g}/s (Poisson, seed {seed})"


def latency_line(name: str, summary: dict[str, Any], indent: int = 2) -> str:
    """One table line: an engine's per-request latency percentiles and output tok/s."""

    def pair(key: str) -> str:
        lo, hi = summary[f"{key}_p50"], summary[f"{key}_p99"]
        return "n/a" if lo is None else f"{lo:.1f}/{hi:.1f}"

    return (
        f"{' ' * indent}{name:<12} p50/p99 ms: TTFT {pair('ttft_ms')}  TPOT {pair('tpot_ms')}  "
        f"E2E {pair('e2e_ms')}   output {summary['output_tok_per_s']:.1f} tok/s"
    )
