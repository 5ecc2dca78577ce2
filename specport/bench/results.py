"""What one `specport bench` run of an engine measured, and how engines compare.

Separate from the run loop (artifact.py) and the printing (report.py) because the speculative
and engine benchmarks read the same medians and per-round ratios.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

# lower is better; cpu_ms_per_token = process CPU time (all threads) per generated token, which
# a shared machine's load disturbs far less than wall time
TIME_KEYS = ("ttft_ms", "tpot_ms", "cpu_ms_per_token")
RATE_KEYS = ("decode_tok_per_s", "prefill_tok_per_s")  # higher is better


@dataclass
class BenchConfig:
    prompt_len: int = 32
    new_tokens: int = 128
    batch: int = 1
    runs: int = 5
    threads: int = 0
    allow_spinning: bool | None = None
    provider: str = "cpu"
    prompt_ids: list[int] | None = None
    seed: int = 0
    peer_gguf: str | None = None  # the GGUF llama.cpp runs when the artifact's source is not one


@dataclass
class EngineResult:
    name: str
    runs: list[dict[str, Any]] = field(default_factory=list)
    peak_rss_mb: float | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def median(self, key: str) -> float | None:
        vals = [r[key] for r in self.runs if r.get(key) is not None]
        return round(statistics.median(vals), 3) if vals else None

    def best(self, key: str) -> float | None:
        vals = [r[key] for r in self.runs if r.get(key) is not None]
        if not vals:
            return None
        return round(min(vals) if key in TIME_KEYS else max(vals), 3)

    def summary(self) -> dict[str, Any]:
        keys = (*TIME_KEYS, *RATE_KEYS, "framework_overhead_pct")
        out: dict[str, Any] = {k: self.median(k) for k in keys}
        out["best"] = {k: self.best(k) for k in (*TIME_KEYS, *RATE_KEYS)}
        out["spread_pct"] = _spread(self.runs, "decode_tok_per_s")
        out["peak_rss_mb"] = self.peak_rss_mb
        out["runs"] = len(self.runs)
        return out | self.info


def _spread(runs: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key)]
    if len(vals) < 2:
        return None
    return round(100 * (max(vals) - min(vals)) / statistics.median(vals), 1)


def compare(ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, float | None]:
    """Speedup of ours over a peer per metric (>1 = ours better), from medians."""
    out: dict[str, float | None] = {}
    for key in TIME_KEYS:
        a, b = ours.get(key), peer.get(key)
        out[key] = round(b / a, 3) if a and b else None
    for key in RATE_KEYS:
        a, b = ours.get(key), peer.get(key)
        out[key] = round(a / b, 3) if a and b else None
    return out


def paired_speedup(
    ours: list[dict[str, Any]], peer: list[dict[str, Any]]
) -> dict[str, float | None]:
    """Median over rounds of ours-vs-peer speedup (>1 = ours better) per metric."""
    per_round = [compare(a, b) for a, b in zip(ours, peer)]
    out: dict[str, float | None] = {}
    for key in (*TIME_KEYS, *RATE_KEYS):
        vals = [v for r in per_round if (v := r[key]) is not None]
        out[key] = round(statistics.median(vals), 3) if vals else None
    return out
