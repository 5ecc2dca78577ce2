"""What a verify run costs against a plain step, by wall clock and by CPU time, on this machine now.

`--speculative auto` and the adaptive draft length price drafts by verify costs measured in
wall time (`runtime/engine/step_cost.py`, corrected while decoding by `LiveVerifyCosts`). On an
oversubscribed machine wall time counts waiting for a core; process CPU time counts the work.
This runs batch-1 steps of each width on a KV cache with CONTEXT positions filled, interleaved
(as `measure_widths` does), and prints each width's cost relative to one token by both clocks,
at the minimum, lower quartile and median of the rounds. Usage:

    python benchmarks/verify_cost_clocks.py ARTIFACT [--threads 2] [--context 512] [--rounds 30]
        [--widths 1,2,5,9]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import specport
from specport.runtime.kv.cache import open_kv_cache

WIDTHS = "1,2,5,9"  # a plain step, and verifying 1, 4 and 8 drafts (the first is the unit)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--widths", default=WIDTHS, help="tokens per run, the first the unit")
    args = p.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    model = specport.load(args.artifact, threads=args.threads)
    cache = open_kv_cache(model.session, model.manifest, 1, args.context + max(widths) + 1)
    live = np.ones(1, dtype=bool)
    cache.step(np.zeros((1, args.context), dtype=np.int64), live)
    wall: dict[int, list[float]] = {w: [] for w in widths}
    cpu: dict[int, list[float]] = {w: [] for w in widths}
    load0 = os.getloadavg()[0]
    for r in range(args.rounds + 1):  # the first round warms up
        for w in widths:
            cache.keep(0, args.context)
            t0, c0 = time.perf_counter(), time.process_time()
            cache.step(np.zeros((1, w), dtype=np.int64), live)
            if r:
                wall[w].append(time.perf_counter() - t0)
                cpu[w].append(time.process_time() - c0)
    print(f"widths {widths}; load average {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    stats = {"min": np.min, "q25": lambda x: np.quantile(x, 0.25), "median": np.median}
    for clock, times in (("wall", wall), ("cpu", cpu)):
        for name, stat in stats.items():
            base = float(stat(times[widths[0]]))
            rel = ", ".join(f"{float(stat(times[w])) / base:.2f}" for w in widths)
            print(f"{clock:>4} {name:>6}: one token {1e3 * base:6.1f} ms; relative [{rel}]")


if __name__ == "__main__":
    main()
