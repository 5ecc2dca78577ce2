"""Requests decoding together per preemption mode at a fixed KV space, by count (not a test).

    nice -n 19 python -m benchmarks.preemption_rows ART [--requests 48] [--concurrency 24]
        [--kv-space 0.4] [--prompt 100:1000] [--answer 128:512] [--threads 2] [--json]

A chat-like mix (the load test's: prompts of random token ids, lengths drawn uniformly from
``--prompt``, greedy answers of a length drawn from ``--answer`` with ``ignore_eos``), kept at
``--concurrency`` requests in flight until ``--requests`` are answered, runs on a fresh batching
engine per ``--preemption-mode`` (``none``, then ``recompute``) at ``--kv-space`` GiB of KV.
Reported per mode, all counts from the engine's stats: decode steps, mean rows per decode step
(how many requests ran at once), prompt tokens prefilled (recomputed ones included),
preemptions and recomputed positions, the engine's thread CPU seconds; and whether every
request's tokens were the same in both modes. No wall-clock time is reported: timed runs are
`specport loadtest` against `specport serve --preemption-mode ...`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import numpy as np

import specport
from specport.runtime.engine.base import Request
from specport.runtime.engine.batching import BatchingEngine

KEYS = (
    "decode_steps", "mean_decode_rows", "prefill_tokens", "prompt_tokens", "preemptions",
    "recomputed_tokens", "generated_tokens", "engine_cpu_seconds",
)  # fmt: skip


def _span(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(":"))
    return lo, hi


def mix(args: argparse.Namespace, vocab: int) -> list[Request]:
    rng = np.random.default_rng(args.seed)
    lo, hi = _span(args.prompt)
    alo, ahi = _span(args.answer)
    return [
        Request(
            rng.integers(100, vocab, int(rng.integers(lo, hi + 1))).tolist(),
            max_new_tokens=int(rng.integers(alo, ahi + 1)),
            ignore_eos=True,
            request_id=str(i),
        )
        for i in range(args.requests)
    ]


def run(model: Any, mode: str, requests: list[Request], args: argparse.Namespace) -> dict:
    engine = BatchingEngine(
        model,
        max_length=args.max_length,
        kv_space=int(args.kv_space * 2**30),
        preemption=mode,
    )
    try:
        pending = list(requests)
        live = [engine.submit(pending.pop(0)) for _ in range(min(args.concurrency, len(pending)))]
        done = []
        while live:
            time.sleep(0.05)  # closed loop: a finished request's client sends the next one
            for handle in [h for h in live if h.done]:
                live.remove(handle)
                done.append(handle)
                if pending:
                    live.append(engine.submit(pending.pop(0)))
        stats = engine.stats()
    finally:
        engine.close()
    tokens = {h.request.request_id: h.result(0).token_ids for h in done}
    return {"stats": {k: stats[k] for k in KEYS}, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--kv-space", type=float, default=0.4, help="GiB")
    ap.add_argument("--prompt", default="100:1000")
    ap.add_argument("--answer", default="128:512")
    ap.add_argument("--max-length", type=int, default=1536)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    model = specport.load(args.artifact, provider="cpu", threads=args.threads)
    requests = mix(args, model.manifest.vocab_size)
    out = {mode: run(model, mode, requests, args) for mode in ("none", "recompute")}
    a, b = out["none"]["tokens"], out["recompute"]["tokens"]
    same = sum(a[k] == b[k] for k in a)
    report = {
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        **{mode: r["stats"] for mode, r in out.items()},
        "same_tokens": f"{same}/{len(a)}",
        "load_average": list(os.getloadavg()),
    }
    if args.json:
        print(json.dumps(report))
        return
    for mode in ("none", "recompute"):
        print(mode, json.dumps(report[mode]))
    print("same tokens in both modes:", report["same_tokens"], "load", report["load_average"])


if __name__ == "__main__":
    main()
