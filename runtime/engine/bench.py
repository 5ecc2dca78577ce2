"""Measure the request engines: throughput under concurrent load, and one request alone.

    python -m specport.runtime.engine.bench /tmp/l32_shared --requests 8 --new-tokens 64

Rounds alternate (batching, serial, batching, ...) on fresh random prompts (the same prompts
for both engines within a round, so no engine profits from the prefix cache of an earlier
round); ratios are per round, then the median. "alone" compares one request through the
batching engine with `Model.generate` on the same prompt.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np

from specport.runtime.engine.base import Request


def run_load(engine: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    """Submit all prompts at once; total generated tokens / wall time until the last ends."""
    t0 = time.perf_counter()
    handles = [engine.submit(Request(p, new_tokens, ignore_eos=True)) for p in prompts]
    results = [h.result(timeout=600) for h in handles]
    wall = time.perf_counter() - t0
    if any(r.finish_reason == "error" for r in results):
        raise RuntimeError(next(r.error for r in results if r.error))
    tokens = sum(len(r.token_ids) for r in results)
    ttft = [h.first_token_at - h.created for h in handles if h.first_token_at is not None]
    return {
        "tok_per_s": tokens / wall,
        "wall_s": wall,
        "mean_ttft_ms": 1e3 * statistics.mean(ttft),
    }


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


def main(argv: list[str] | None = None) -> None:
    import specport
    from specport.runtime.engine.batching import BatchingEngine
    from specport.runtime.engine.serial import SerialEngine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    args = parser.parse_args(argv)

    model = specport.load(args.artifact, threads=args.threads)
    vocab = model.manifest.vocab_size
    batching = BatchingEngine(model, max_batch=args.requests, max_length=args.max_length)
    uncached = BatchingEngine(
        model, max_batch=args.requests, max_length=args.max_length, prefix_cache=False
    )
    serial = SerialEngine(model)

    def prompts(seed: int, n: int) -> list[list[int]]:
        rng = np.random.default_rng(seed)
        return [[1, *rng.integers(3, vocab, args.prompt_tokens - 1).tolist()] for _ in range(n)]

    rows: list[dict[str, Any]] = []
    try:
        run_load(batching, prompts(-1 % 2**32, args.requests), 8)  # warm-up
        run_load(serial, prompts(-2 % 2**32, 2), 8)
        for r in range(args.rounds):
            load_prompts = prompts(r, args.requests)
            b = run_load(batching, load_prompts, args.new_tokens)
            s = run_load(serial, load_prompts, args.new_tokens)
            alone = run_alone(batching, model, prompts(1000 + r, 1)[0], args.new_tokens)
            system, *tails = prompts(2000 + r, 5)
            system = (system * (args.prefix_tokens // len(system) + 1))[: args.prefix_tokens]
            prefix = {
                "cached_ttft_ms": run_shared_prefix(batching, system, tails, 8),
                "uncached_ttft_ms": run_shared_prefix(uncached, system, tails, 8),
            }
            rows.append({"batching": b, "serial": s, "alone": alone, "prefix": prefix})
            print(json.dumps({"round": r, **rows[-1]}, default=lambda x: round(x, 2)))
    finally:
        batching.close()
        uncached.close()
        serial.close()

    def med(f: Any) -> float:
        return round(statistics.median(f(row) for row in rows), 3)

    print(
        json.dumps(
            {
                "artifact": args.artifact,
                "threads": args.threads,
                "requests": args.requests,
                "new_tokens": args.new_tokens,
                "batching_tok_per_s": med(lambda x: x["batching"]["tok_per_s"]),
                "serial_tok_per_s": med(lambda x: x["serial"]["tok_per_s"]),
                "batching_over_serial": med(
                    lambda x: x["batching"]["tok_per_s"] / x["serial"]["tok_per_s"]
                ),
                "alone_engine_over_generate": med(
                    lambda x: x["alone"]["engine_tok_per_s"] / x["alone"]["generate_tok_per_s"]
                ),
                "alone_decode_engine_over_generate": med(
                    lambda x: (
                        x["alone"]["engine_decode_tok_per_s"]
                        / x["alone"]["generate_decode_tok_per_s"]
                    )
                ),
                "alone_same_tokens": all(x["alone"]["same_tokens"] for x in rows),
                "prefix_tokens": args.prefix_tokens,
                "shared_prefix_ttft_ms_cached": med(lambda x: x["prefix"]["cached_ttft_ms"]),
                "shared_prefix_ttft_ms_uncached": med(lambda x: x["prefix"]["uncached_ttft_ms"]),
            }
        )
    )


if __name__ == "__main__":
    main()
