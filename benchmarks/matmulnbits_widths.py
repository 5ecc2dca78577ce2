"""What each weight width and block costs a decode step on this CPU: MatMulNBits (int8
activations, accuracy_level 4, as w4a8 artifacts run) over a stack of SmolLM2-sized weights
(576 x 1536, 60 of them: more than the caches hold), for 4 and 8 bits, blocks of 32, 64 and
128, with and without zero points, at M = 1 and 8 rows, the configurations alternating in
every round so that they share the machine's load. Also prints each configuration's bits per
weight as stored (codes, float32 scales, zero points). Usage:

    python -m benchmarks.matmulnbits_widths [--threads 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.matmulnbits import K, N, stack_session, time_rows
from specport.passes.quant.head import nbits_bytes

ROWS = (1, 8)
CONFIGS = [(b, g, zp) for b in (4, 8) for g in (32, 64, 128) for zp in (False, True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    sessions = {(b, g, zp): stack_session(b, g, 4, zp, args.threads) for b, g, zp in CONFIGS}
    print("load average", Path("/proc/loadavg").read_text().split()[:3])
    times = time_rows(sessions, ROWS, args.rounds)
    base = times[((4, 32, True), 1)]
    print(
        "| bits | block | zero points | bits per weight | "
        + " | ".join(f"M = {m}" for m in ROWS)
        + " |"
    )
    print("|---:|---:|---|---:|" + "---:|" * len(ROWS))
    for bits, block, zp in CONFIGS:
        bpw = 8 * nbits_bytes(K, N, bits, block, zp) / (K * N)
        cells = []
        for m in ROWS:
            t = times[((bits, block, zp), m)]
            cells.append(f"{t * 1e3:.2f} ms" + (f" ({t / base:.2f}×)" if m == 1 else ""))
        print(
            f"| {bits} | {block} | {'yes' if zp else 'no'} | {bpw:.2f} | "
            + " | ".join(cells)
            + " |"
        )
    print("(× : against 4 bits, block 32, zero points, M = 1: the w4a8 default)")
    print("load average", Path("/proc/loadavg").read_text().split()[:3])


if __name__ == "__main__":
    main()
