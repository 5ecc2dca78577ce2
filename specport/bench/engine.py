"""Measure the request engines: throughput under concurrent load, and one request alone.

    specport bench ARTIFACT --requests 8 --new-tokens 64
    python -m specport.bench.engine ARTIFACT --requests 8 --new-tokens 64

Rounds alternate (batching, serial, batching, ...) on fresh random prompts (the same prompts
for both engines within a round, so no engine profits from the prefix cache of an earlier
round); ratios are per round, then the median. "alone" compares one request through the
batching engine with `Model.generate` on the same prompt. With a request rate the load's
requests arrive over time (specport/bench/arrivals.py: seeded Poisson, the same schedule for
both engines and every round) and each request's TTFT / TPOT / end-to-end latency is reported
from its own arrival.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
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
    serve_load,
    served_rows,
)
from specport.core.errors import InputError
from specport.core.progress import Loop
from specport.runtime.engine.base import Request
from specport.runtime.engine.batching import BatchingEngine
from specport.runtime.engine.serial import SerialEngine


def run_load(
    engine: Any, prompts: list[list[int]], new_tokens: int, offsets: list[float] | None = None
) -> dict[str, Any]:
    """Submit the prompts at their arrival offsets (all at once by default); tok/s and TTFT."""
    return serve_load(engine, prompts, new_tokens, offsets)


def run_alone(engine: Any, model: Any, prompt: list[int], new_tokens: int) -> dict[str, float]:
    """One request through the engine, then `model.generate`: tokens/s over the whole request."""
    t0 = time.perf_counter()
    handle = engine.submit(Request(prompt, new_tokens, ignore_eos=True))
    got = handle.result(timeout=600)
    engine_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    want = model.generate(prompt_ids=prompt, max_new_tokens=new_tokens, ignore_eos=True)
    generate_s = time.perf_counter() - t0
    assert handle.first_token_at is not None and handle.finished_at is not None
    return {
        "engine_tok_per_s": len(got.token_ids) / engine_s,
        "generate_tok_per_s": len(want.tokens) / generate_s,
        "engine_decode_tok_per_s": (len(got.token_ids) - 1)
        / (handle.finished_at - handle.first_token_at),
        "generate_decode_tok_per_s": float(want.metrics["decode_tok_per_s"]),
        "same_tokens": float(got.token_ids == want.tokens),
    }


def run_shared_prefix(
    engine: Any, prefix: list[int], tails: list[list[int]], new_tokens: int
) -> float:
    """Requests one after another that share `prefix` (a system prompt): median TTFT in ms."""
    ttft = []
    for tail in tails:
        handle = engine.submit(Request(prefix + tail, new_tokens, ignore_eos=True))
        handle.result(timeout=600)
        assert handle.first_token_at is not None
        ttft.append(1e3 * (handle.first_token_at - handle.created))
    return statistics.median(ttft)


@dataclass
class EngineBenchConfig:
    requests: int = 8
    new_tokens: int = 64
    prompt_tokens: int = 32
    rounds: int = 5
    threads: int = 1
    max_length: int = 512  # KV positions per batching row
    prefix_tokens: int = 384  # the shared system prompt of the prefix-cache measurement
    request_rate: float | None = None  # requests/s, Poisson arrivals; None: all at once
    seed: int = 0  # of the arrival schedule


def run_engine_bench(
    artifact: str,
    config: EngineBenchConfig,
    on_round: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every figure `specport bench --requests N` prints, as one JSON-able dict."""

    if config.requests < 1 or config.rounds < 1 or config.new_tokens < 2:
        raise InputError("--requests and --runs must be at least 1, --new-tokens at least 2.")
    if config.prompt_tokens < 2 or config.prefix_tokens < 1:
        raise InputError("--prompt-len must be at least 2 and --prefix-tokens at least 1.")
    offsets = arrival_offsets(config.requests, config.request_rate, config.seed)
    needed = config.prefix_tokens + config.prompt_tokens + config.new_tokens
    max_length = max(config.max_length, needed)
    model = specport.load(artifact, threads=config.threads)
    vocab = model.manifest.vocab_size
    batching = BatchingEngine(model, max_batch=config.requests, max_length=max_length)
    if batching.max_length < needed:  # the artifact's context is shorter
        batching.close()
        raise InputError(
            f"--prefix-tokens {config.prefix_tokens} + --prompt-len + --new-tokens need "
            f"{needed} positions; the artifact holds {batching.max_length}: lower them."
        )
    uncached = BatchingEngine(
        model, max_batch=config.requests, max_length=max_length, prefix_cache=False
    )
    serial = SerialEngine(model)

    def prompts(seed: int, n: int) -> list[list[int]]:
        rng = np.random.default_rng(seed)
        return [[1, *rng.integers(3, vocab, config.prompt_tokens - 1).tolist()] for _ in range(n)]

    rows: list[dict[str, Any]] = []
    loads: dict[str, list[dict[str, Any]]] = {"batching": [], "serial": []}
    same = True  # greedy: both engines give every request the same tokens
    try:
        run_load(batching, prompts(2**32 - 1, config.requests), 8)  # warm-up
        run_load(serial, prompts(2**32 - 2, 2), 8)
        rounds = Loop(config.rounds, "bench rounds (batching and serial engines)")
        for r in range(config.rounds):
            load_prompts = prompts(r, config.requests)
            b = run_load(batching, load_prompts, config.new_tokens, offsets)
            s = run_load(serial, load_prompts, config.new_tokens, offsets)
            loads["batching"].append(b)
            loads["serial"].append(s)
            same = same and b["tokens"] == s["tokens"]
            b, s = _figures(b), _figures(s)
            alone = run_alone(batching, model, prompts(1000 + r, 1)[0], config.new_tokens)
            system, *tails = prompts(2000 + r, 5)
            system = (system * (config.prefix_tokens // len(system) + 1))[: config.prefix_tokens]
            prefix = {
                "cached_ttft_ms": run_shared_prefix(batching, system, tails, 8),
                "uncached_ttft_ms": run_shared_prefix(uncached, system, tails, 8),
            }
            rows.append({"batching": b, "serial": s, "alone": alone, "prefix": prefix})
            if on_round is not None:
                on_round({"round": r, **rows[-1]})
            rounds.update()
        rounds.close()
    finally:
        batching.close()
        uncached.close()
        serial.close()

    def med(f: Any) -> float:
        return round(statistics.median(f(row) for row in rows), 3)

    return {
        "artifact": str(artifact),
        "config": vars(config),
        "batching_tok_per_s": med(lambda x: x["batching"]["tok_per_s"]),
        "serial_tok_per_s": med(lambda x: x["serial"]["tok_per_s"]),
        "batching_over_serial": med(
            lambda x: x["batching"]["tok_per_s"] / x["serial"]["tok_per_s"]
        ),
        "batching_mean_ttft_ms": med(lambda x: x["batching"]["mean_ttft_ms"]),
        "serial_mean_ttft_ms": med(lambda x: x["serial"]["mean_ttft_ms"]),
        "alone_engine_over_generate": med(
            lambda x: x["alone"]["engine_tok_per_s"] / x["alone"]["generate_tok_per_s"]
        ),
        "load_same_tokens": same,
        "alone_same_tokens": all(x["alone"]["same_tokens"] for x in rows),
        "shared_prefix_ttft_ms_cached": med(lambda x: x["prefix"]["cached_ttft_ms"]),
        "shared_prefix_ttft_ms_uncached": med(lambda x: x["prefix"]["uncached_ttft_ms"]),
        "arrivals_s": [round(t, 4) for t in offsets],
        "latency": {name: latency_summary(runs) for name, runs in loads.items()},
        "rounds": rows,
    }


def _figures(load: dict[str, Any]) -> dict[str, Any]:
    """A round's JSON-able figures of one engine (its tokens and timelines stay out)."""
    figures = {k: load[k] for k in ("tok_per_s", "wall_s", "mean_ttft_ms")}
    return {**figures, "requests": served_rows(load)}


def format_engine_table(report: dict[str, Any]) -> str:
    cfg = report["config"]
    arriving = load_line(cfg["requests"], cfg.get("request_rate"), cfg.get("seed", 0))
    lines = [
        f"{arriving} x {cfg['new_tokens']} new tokens "
        f"(prompts of {cfg['prompt_tokens']}), {cfg['threads']} threads, {cfg['rounds']} rounds "
        "(medians; ratios per round)",
        f"  batching engine   {report['batching_tok_per_s']:8.1f} tok/s   "
        f"mean TTFT {report['batching_mean_ttft_ms']:.1f} ms",
        f"  serial engine     {report['serial_tok_per_s']:8.1f} tok/s   "
        f"mean TTFT {report['serial_mean_ttft_ms']:.1f} ms",
        f"  batching / serial {report['batching_over_serial']:.2f}x; same tokens: "
        f"{report['load_same_tokens']}",
        "per request, from its own arrival (every round):",
        latency_line("batching", report["latency"]["batching"]),
        latency_line("serial", report["latency"]["serial"]),
        f"one request alone, batching engine / Model.generate: "
        f"{report['alone_engine_over_generate']:.2f}x (same tokens: {report['alone_same_tokens']})",
        f"shared {cfg['prefix_tokens']}-token system prompt, TTFT: prefix cache "
        f"{report['shared_prefix_ttft_ms_cached']:.1f} ms vs off "
        f"{report['shared_prefix_ttft_ms_uncached']:.1f} ms",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-length", type=int, default=512, help="batching engine KV rows")
    parser.add_argument(
        "--prefix-tokens", type=int, default=384, help="shared system prompt (prefix cache)"
    )
    parser.add_argument("--request-rate", type=float, help="requests/s (default: all at once)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrival schedule")
    args = parser.parse_args(argv)
    config = EngineBenchConfig(
        args.requests,
        args.new_tokens,
        args.prompt_tokens,
        args.rounds,
        args.threads,
        args.max_length,
        args.prefix_tokens,
        args.request_rate,
        args.seed,
    )
    report = run_engine_bench(
        args.artifact, config, on_round=lambda row: print(json.dumps(row, default=_round))
    )
    print(format_engine_table(report))


def _round(x: Any) -> Any:
    return round(x, 2) if isinstance(x, float) else x


if __name__ == "__main__":
    main()
