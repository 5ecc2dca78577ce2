"""Decode over many rows with the KV buffers on 2 MiB or 4 KiB pages (not a test).

    python -m benchmarks.kv_pages ART [--rows 16] [--new 128] [--rounds 3] [--threads 2]

The batching engine puts its KV buffers on 4 KiB pages (committed as written, handed back to
keep within ``--kv-cache-space``) when rows filled to the end would overrun the space, and on
2 MiB pages (a row's first position commits the whole row) when they fit
(``engine/kv_budget.py``). This runs the same batch on both: ``rows`` greedy requests of a
~100-token prompt each, ``new`` tokens each, submitted at once to a fresh engine whose space is
just above (2 MiB pages) or just below (4 KiB pages) what its rows filled to the end take, so
admission is the same; then the same again on the now used rows (other prompts: no prefix-cache
hit), which is decode's steady state. Rounds alternate the two. Reported per setting and pass
(``fresh``, ``used``), medians over rounds: the process's CPU time and wall time per generated
token (CPU time counts every thread and is what the machine's other jobs disturb least), and
the resident memory the run added. Quote the load
average (printed) and the CPU flags.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import specport
from specport.bench.loadtest import WORDS
from specport.runtime.engine.base import Request
from specport.runtime.engine.batching import BatchingEngine
from specport.runtime.engine.kv_budget import token_bytes


def _rss() -> int:
    text = Path(f"/proc/{os.getpid()}/status").read_text()
    return 1024 * int(next(x for x in text.splitlines() if x.startswith("VmRSS:")).split()[1])


def one(model: Any, small: bool, args: argparse.Namespace) -> dict[str, float]:
    whole = args.rows * args.max_length * token_bytes(model.manifest)
    space = whole - (1 << 20) if small else whole + (1 << 20)
    gc.collect()  # the previous run's buffers go first
    rss0 = _rss()
    engine = BatchingEngine(model, max_batch=args.rows, max_length=args.max_length, kv_space=space)
    assert engine.small_pages is small
    out: dict[str, float] = {}
    try:
        for name in ("fresh", "used"):  # rows first committed, then rows already committed
            prompts = [
                model.encode(
                    f"{name} {i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(100))
                )
                for i in range(args.rows)
            ]
            cpu0, t0 = time.process_time(), time.perf_counter()
            handles = [
                engine.submit(Request(p, max_new_tokens=args.new, ignore_eos=True)) for p in prompts
            ]
            tokens = sum(len(h.result(timeout=3600).token_ids) for h in handles)
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
            out[f"{name}_cpu_ms_per_token"] = 1e3 * cpu / tokens
            out[f"{name}_wall_ms_per_token"] = 1e3 * wall / tokens
        out["rss_added_mb"] = (_rss() - rss0) / 2**20
    finally:
        engine.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--max-length", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    model = specport.load(args.artifact, threads=args.threads)
    runs: dict[str, list[dict[str, float]]] = {"2 MiB": [], "4 KiB": []}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        order = [False, True] if r % 2 == 0 else [True, False]
        for small in order:
            name = "4 KiB" if small else "2 MiB"
            runs[name].append(one(model, small, args))
            print(
                f"round {r} {name}: "
                + json.dumps({k: round(v, 2) for k, v in runs[name][-1].items()}),
                flush=True,
            )
        load.append(os.getloadavg()[0])
    summary = {
        name: {k: round(statistics.median(o[k] for o in outs), 2) for k in outs[0]}
        for name, outs in runs.items()
    }
    print(json.dumps({"summary": summary, "load_average_1min": load, "args": vars(args)}, indent=2))


if __name__ == "__main__":
    main()
