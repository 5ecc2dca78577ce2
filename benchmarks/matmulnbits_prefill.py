"""What a prefill costs a 4-bit model on this CPU: MatMulNBits against fp32 MatMul at prompt-sized M.

Decode reads every weight once per token, so 4-bit weights make it up to several times faster
than fp32. A prefill (or a serving round that carries prompt chunks) multiplies hundreds of
rows by each weight and is bound by arithmetic instead: whether a 4-bit file serves long
prompts faster than fp32 depends on how fast the int8 kernel (accuracy_level 4, what w4a8
artifacts use) computes, not on how little it reads. This times the stack of SmolLM2-sized
weights (576 x 1536, 60 of them) at M = 1 to 512 rows as fp32 MatMul and as MatMulNBits at
4 bits (blocks of 32 and 64, with and without zero points) and 8 bits, every configuration in
every round, and prints milliseconds and GFLOP/s (2 M K N per weight). Usage:

    python -m benchmarks.matmulnbits_prefill [--threads 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.matmulnbits import LAYERS, K, N, float_stack_session, stack_session, time_rows

ROWS = (1, 8, 64, 256, 512)
# label -> (bits, block, accuracy level, zero points); None: fp32 MatMul
CONFIGS: dict[str, tuple[int, int, int, bool] | None] = {
    "fp32 MatMul": None,
    "4-bit/32, zero points, int8": (4, 32, 4, True),
    "4-bit/32, int8": (4, 32, 4, False),
    "4-bit/64, int8": (4, 64, 4, False),
    "8-bit/64, int8": (8, 64, 4, False),
    "4-bit/32, zero points, fp32 (level 1)": (4, 32, 1, True),
    "4-bit/32, fp32 (level 1)": (4, 32, 1, False),
    "8-bit/64, fp32 (level 1)": (8, 64, 1, False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--rows", type=int, nargs="+", default=list(ROWS), help="the M values (prompt rows)"
    )
    args = parser.parse_args()
    rows = tuple(args.rows)
    sessions = {
        label: float_stack_session(args.threads)
        if cfg is None
        else stack_session(*cfg, args.threads)
        for label, cfg in CONFIGS.items()
    }
    print("load average", Path("/proc/loadavg").read_text().split()[:3])
    times = time_rows(sessions, rows, args.rounds)
    print("| weights | " + " | ".join(f"M = {m}" for m in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for label in CONFIGS:
        cells = []
        for m in rows:
            t = times[(label, m)]
            cells.append(f"{t * 1e3:.2f} ms ({2 * m * K * N * LAYERS / t / 1e9:.0f})")
        print(f"| {label} | " + " | ".join(cells) + " |")
    print("load average", Path("/proc/loadavg").read_text().split()[:3])


if __name__ == "__main__":
    main()
