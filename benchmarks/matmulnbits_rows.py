"""What a verify run costs a 4-bit model on this CPU: MatMulNBits time against rows M.

Speculative decoding pays when a verify run over 1 + K tokens costs little more than a
one-token step. At fp32 a decode step reads 4 bytes a weight and the extra rows ride along
on the same memory traffic; at 4 bits the weights are an eighth of that and the extra rows'
arithmetic shows. This times a stack of SmolLM2-sized MatMulNBits (576 x 1536, blocks of 32,
60 of them: more weight than the CPU caches hold) at M = 1, 2, 3, 5, 9 rows, with int8
activations (accuracy_level 4, what w4a8 artifacts use) and with float ones (level 1), with and
without zero points, the configurations alternating in every round. Usage:

    python -m benchmarks.matmulnbits_rows [--threads 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.matmulnbits import stack_session, time_rows

BITS, BLOCK = 4, 32
ROWS = (1, 2, 3, 5, 9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    configs = {
        (level, zp): stack_session(BITS, BLOCK, level, zp, args.threads)
        for level in (4, 1)
        for zp in (False, True)
    }
    print("load average", Path("/proc/loadavg").read_text().split()[:3])
    times = time_rows(configs, ROWS, args.rounds)
    print("| accuracy level | zero points | " + " | ".join(f"M = {m}" for m in ROWS) + " |")
    print("|---|---|" + "---:|" * len(ROWS))
    for level, zp in configs:
        one = times[((level, zp), 1)]
        cells = []
        for m in ROWS:
            t = times[((level, zp), m)]
            cells.append(f"{t * 1e3:.2f} ms ({t / one:.2f}×)")
        print(f"| {level} | {'yes' if zp else 'no'} | " + " | ".join(cells) + " |")
    print("load average", Path("/proc/loadavg").read_text().split()[:3])


if __name__ == "__main__":
    main()
