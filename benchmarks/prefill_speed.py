"""A prompt's prefill time per artifact (and per chunk size), artifacts taken in turn.

What a user's time to first token is made of at batch 1: one prompt of ``--tokens`` tokens
read into an empty KV cache through specport's runtime (``open_cache(...).step``, the KV bound
in place). Each round runs every artifact once per ``--chunks`` size (0: the whole prompt in
one run; N: N tokens per run, carrying the cache, as the serving engine's chunked prefill
does), so all of them see the same machine load; the first round is a warm-up. The prompt is
random token ids: a prefill's time does not depend on which tokens it reads. Usage:

    python -m benchmarks.prefill_speed ARTIFACT [ARTIFACT ...] [--tokens 869] [--chunks 0 256]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np


def measure(
    artifacts: list[str], tokens: int, chunks: list[int], rounds: int, threads: int
) -> dict[tuple[str, int], list[float]]:
    """Seconds per prefill of each (artifact, chunk), one entry per measured round."""
    import specport
    from specport.runtime.kv.seq_cache import open_cache

    models = {a: specport.load(a, threads=threads) for a in artifacts}
    caches = {a: open_cache(m.session, m.manifest, tokens) for a, m in models.items()}
    vocab = min(m.manifest.vocab_size for m in models.values())
    ids = np.random.default_rng(0).integers(3, vocab, size=tokens).tolist()
    times: dict[tuple[str, int], list[float]] = {(a, c): [] for a in artifacts for c in chunks}
    for r in range(rounds + 1):
        for a in artifacts:
            for c in chunks:
                size = c or tokens
                caches[a].keep(0)
                t0 = time.perf_counter()
                for start in range(0, tokens, size):
                    caches[a].step(ids[start : start + size], last_only=True)
                if r:  # round 0 warms the sessions up
                    times[(a, c)].append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", nargs="+")
    parser.add_argument("--tokens", type=int, default=869, help="prompt length")
    parser.add_argument(
        "--chunks", type=int, nargs="+", default=[0], help="tokens per run (0: one run)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    print("load average", Path("/proc/loadavg").read_text().split()[:3])
    times = measure(args.artifacts, args.tokens, args.chunks, args.rounds, args.threads)
    first = statistics.median(times[(args.artifacts[0], args.chunks[0])])
    print("| artifact | tokens per run | prefill ms (median) | tok/s | time / first row's |")
    print("|---|---:|---:|---:|---:|")
    for (a, c), ts in times.items():
        t = statistics.median(ts)
        print(
            f"| {a} | {c or args.tokens} | {t * 1e3:.0f} | {args.tokens / t:.0f} | "
            f"{t / first:.3f} |"
        )
    print("load average", Path("/proc/loadavg").read_text().split()[:3])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
