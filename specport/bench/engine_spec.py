"""Measure speculative decoding inside the batching engine: the same engine with and without it.

    specport bench ARTIFACT --requests 4 --speculative ngram [--spec-max-rows 4]

N requests are submitted at once (or arrive over time at `request_rate`, the same seeded
Poisson schedule for both engines: specport/bench/arrivals.py) to two batching engines over one loaded model, one plain and
one speculating (`BatchingEngine(speculative=...)`), alternating which goes first each round,
on the same fresh prompts. The prompts are a "copy" workload: a random segment said twice, so
n-gram drafts find matches (its favourable case; MTP and draft models do not need it). Reported
per engine: generated tokens/s (all tokens / wall time until the last request ends), and TTFT,
TPOT and end-to-end latency p50 / p99 over every request of every round, each from the
request's own arrival; the speed-up is the median of per-round ratios.
Greedy, so both engines must give the same tokens (`same_tokens`). Run N = 1, 4, 16 to see
where the compute-bound rule (`--spec-max-rows`) should sit on a machine.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import specport
from specport.bench.arrivals import (
    arrival_offsets,
    latency_line,
    latency_summary,
    load_line,
    served_rows,
)
from specport.bench.arrivals import serve_load as _load
from specport.bench.prompt_sets import CHAT_SETS, PROMPT_SETS, chat_prompt_ids
from specport.core.errors import ArtifactError, InputError
from specport.core.progress import Loop
from specport.runtime.engine.batching import BatchingEngine
from specport.runtime.engine.speculation import SPEC_MAX_ROWS, SPEC_MAX_TOKENS


@dataclass
class SpecEngineBenchConfig:
    requests: int = 4
    new_tokens: int = 64
    prompt_tokens: int = 32
    rounds: int = 3
    threads: int = 1  # 0: onnxruntime's default
    method: str = "ngram"
    num_draft: int | None = None
    draft: str | None = None
    spec_max_rows: int | None = None  # None: the engine's default (SPEC_MAX_ROWS)
    spec_max_tokens: int | None = None  # None: the engine's default (SPEC_MAX_TOKENS)
    max_length: int = 512  # KV positions per batching row
    prompt_set: str | None = None  # None: random copy prompts; else a --prompt-set name
    request_rate: float | None = None  # requests/s, Poisson arrivals; None: all at once
    seed: int = 0  # of the arrival schedule
    suffix_corpus: str | None = None  # earlier answers, for method="suffix"


def copy_prompts(seed: int, n: int, length: int, vocab: int) -> list[list[int]]:
    """`n` prompts of `length` ids: BOS, then a random segment twice (truncated to fit)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        half = rng.integers(3, vocab, max(1, length // 2)).tolist()
        out.append([1, *(half + half)[: length - 1]])
    return out


def set_prompts(model: Any, name: str, n: int) -> list[list[int]]:
    """`n` prompts from a built-in set (story, copy, chat...), cycled: the same every round."""

    if name in CHAT_SETS:
        encoded = chat_prompt_ids(model, name)
    elif name in PROMPT_SETS:
        encoded = [model.encode(text) for text in PROMPT_SETS[name]]
    else:
        raise InputError(
            f"unknown prompt set {name!r}; use one of {sorted(PROMPT_SETS) + list(CHAT_SETS)}."
        )
    return [list(encoded[i % len(encoded)]) for i in range(n)]


def run_spec_engine_bench(
    artifact: str,
    config: SpecEngineBenchConfig,
    on_round: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every figure `specport bench --requests N --speculative METHOD` prints, as a dict."""

    if config.requests < 1 or config.rounds < 1 or config.new_tokens < 2:
        raise InputError("--requests and --runs must be at least 1, --new-tokens at least 2.")
    if config.prompt_tokens < 2:
        raise InputError("--prompt-len must be at least 2.")
    offsets = arrival_offsets(config.requests, config.request_rate, config.seed)
    model = specport.load(artifact, threads=config.threads, suffix_corpus=config.suffix_corpus)
    # Rounds repeat the same prompts: a suffix index learning round 1's answers would draft
    # round 2's perfectly. Served traffic does learn (a server's default).
    model.suffix_index.learn = False
    if model.manifest.kv.layout != "shared":
        raise ArtifactError(
            f"{artifact} has the {model.manifest.kv.layout!r} KV layout; the batching engine "
            "needs a shared-KV artifact (`specport export MODEL --kv-layout shared`)."
        )
    max_length = max(config.max_length, config.prompt_tokens + config.new_tokens + 1)
    max_rows = SPEC_MAX_ROWS if config.spec_max_rows is None else config.spec_max_rows
    max_tokens = SPEC_MAX_TOKENS if config.spec_max_tokens is None else config.spec_max_tokens
    plain = BatchingEngine(model, max_batch=config.requests, max_length=max_length)
    spec = BatchingEngine(
        model,
        max_batch=config.requests,
        max_length=max_length,
        speculative=config.method,
        num_draft=config.num_draft,
        draft=config.draft,
        spec_max_rows=max_rows,
        spec_max_tokens=max_tokens,
    )
    vocab = model.manifest.vocab_size
    fixed = None
    if config.prompt_set is not None:
        fixed = set_prompts(model, config.prompt_set, config.requests)
    rows: list[dict[str, Any]] = []
    loads: dict[str, list[dict[str, Any]]] = {"plain": [], "speculative": []}
    same = True
    try:
        warm = fixed or copy_prompts(2**32 - 1, config.requests, config.prompt_tokens, vocab)
        _load(plain, warm, 8)
        _load(spec, warm, 8)
        before = spec.stats()
        rounds = Loop(config.rounds, "bench rounds (plain and speculative engines)")
        for r in range(config.rounds):
            prompts = fixed or copy_prompts(r, config.requests, config.prompt_tokens, vocab)
            order = [("plain", plain), ("speculative", spec)]
            if r % 2:  # alternate which engine runs first
                order.reverse()
            got = {name: _load(eng, prompts, config.new_tokens, offsets) for name, eng in order}
            same = same and got["plain"]["tokens"] == got["speculative"]["tokens"]
            for name in loads:
                loads[name].append(got[name])
            rows.append(
                {
                    name: {"tok_per_s": run["tok_per_s"], "requests": served_rows(run)}
                    for name, run in got.items()
                }
            )
            if on_round is not None:
                on_round({"round": r, **rows[-1]})
            rounds.update()
        rounds.close()
        after = spec.stats()
    finally:
        plain.close()
        spec.close()
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    steps = after["spec_steps"] - before["spec_steps"]

    def med(name: str) -> float:
        return round(statistics.median(x[name]["tok_per_s"] for x in rows), 2)

    latency = {name: latency_summary(runs) for name, runs in loads.items()}

    return {
        "artifact": str(artifact),
        "config": {**vars(config), "spec_max_rows": max_rows, "spec_max_tokens": max_tokens},
        "plain_tok_per_s": med("plain"),
        "speculative_tok_per_s": med("speculative"),
        "speculative_over_plain": round(
            statistics.median(
                x["speculative"]["tok_per_s"] / x["plain"]["tok_per_s"] for x in rows
            ),
            3,
        ),
        "plain_ttft_ms_p50": latency["plain"]["ttft_ms_p50"],
        "plain_ttft_ms_p99": latency["plain"]["ttft_ms_p99"],
        "speculative_ttft_ms_p50": latency["speculative"]["ttft_ms_p50"],
        "speculative_ttft_ms_p99": latency["speculative"]["ttft_ms_p99"],
        "same_tokens": same,
        "spec_steps": steps,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
        "step_cost_ms": after.get("spec_step_cost_ms"),  # [base, per extra token], measured
        "arrivals_s": [round(t, 4) for t in offsets],
        "latency": latency,
        "rounds": rows,
    }


def format_spec_engine_table(report: dict[str, Any]) -> str:
    cfg = report["config"]
    prompts = (
        f"copy prompts of {cfg['prompt_tokens']}"
        if cfg.get("prompt_set") is None
        else f"--prompt-set {cfg['prompt_set']}"
    )
    arriving = load_line(cfg["requests"], cfg.get("request_rate"), cfg.get("seed", 0))
    lines = [
        f"{arriving} x {cfg['new_tokens']} new tokens ({prompts}), "
        f"batching engine, {cfg['threads']} threads, "
        f"{cfg['rounds']} rounds; speculative {cfg['method']}: rows verify one by one while <= "
        f"{cfg['spec_max_rows']} decode, else together at the width the measured step cost "
        f"favours (rows x (1 + drafts) <= {cfg['spec_max_tokens']})",
        f"  plain        {report['plain_tok_per_s']:8.1f} tok/s   TTFT p50 "
        f"{report['plain_ttft_ms_p50']:.1f} ms  p99 {report['plain_ttft_ms_p99']:.1f} ms",
        f"  speculative  {report['speculative_tok_per_s']:8.1f} tok/s   TTFT p50 "
        f"{report['speculative_ttft_ms_p50']:.1f} ms  p99 "
        f"{report['speculative_ttft_ms_p99']:.1f} ms",
        f"  speculative / plain {report['speculative_over_plain']:.2f}x (median of rounds); "
        f"same tokens: {report['same_tokens']}",
        f"  {report['spec_steps']} verify steps, {report['accepted']}/{report['drafted']} drafts "
        f"accepted ({100 * report['acceptance_rate']:.1f}%)",
        "  per request, from its own arrival (every round):",
        latency_line("plain", report["latency"]["plain"], indent=4),
        latency_line("speculative", report["latency"]["speculative"], indent=4),
    ]
    if report.get("step_cost_ms"):
        base, per_token, plain, verify = report["step_cost_ms"]
        lines.append(
            f"  step cost measured at engine start: {base:.1f} ms + {per_token:.2f} ms per "
            f"extra token; scaled by timed steps: plain x{plain:.2f}, verify x{verify:.2f}"
        )
    return "\n".join(lines)
