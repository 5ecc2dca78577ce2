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
import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from specport.passes.quant.head import nbits_bytes

K, N, LAYERS = 576, 1536, 60
ROWS = (1, 8)
CONFIGS = [(b, g, zp) for b in (4, 8) for g in (32, 64, 128) for zp in (False, True)]


def session(bits: int, block: int, zero_points: bool, threads: int) -> ort.InferenceSession:
    rng = np.random.default_rng(0)
    blocks = -(-K // block)
    nodes, inits = [], []
    for i in range(LAYERS):
        weight = rng.integers(0, 255, size=(N, blocks, block * bits // 8), dtype=np.uint8)
        scale = rng.random(N * blocks, dtype=np.float32) * 0.01 + 0.001
        inits += [numpy_helper.from_array(weight, f"w{i}"), numpy_helper.from_array(scale, f"s{i}")]
        inputs = ["x", f"w{i}", f"s{i}"]
        if zero_points:
            zp = rng.integers(0, 255, size=N * -(-blocks * bits // 8), dtype=np.uint8)
            inits.append(numpy_helper.from_array(zp, f"z{i}"))
            inputs.append(f"z{i}")
        nodes.append(
            helper.make_node(
                "MatMulNBits", inputs, [f"y{i}"], domain="com.microsoft",
                K=K, N=N, bits=bits, block_size=block, accuracy_level=4,
            )
        )  # fmt: skip
    nodes.append(helper.make_node("Sum", [f"y{i}" for i in range(LAYERS)], ["y"]))
    graph = helper.make_graph(
        nodes,
        "widths",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", N])],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    sessions = {c: session(*c, args.threads) for c in CONFIGS}
    inputs = {m: np.random.default_rng(m).standard_normal((m, K), dtype=np.float32) for m in ROWS}
    times: dict[tuple[int, int, bool, int], list[float]] = {}
    print("load average", Path("/proc/loadavg").read_text().split()[:3])
    for _ in range(args.rounds):
        for c, sess in sessions.items():
            for m in ROWS:
                for _ in range(3):
                    sess.run(None, {"x": inputs[m]})
                runs = []
                for _ in range(10):
                    start = time.perf_counter()
                    sess.run(None, {"x": inputs[m]})
                    runs.append(time.perf_counter() - start)
                times.setdefault((*c, m), []).append(min(runs))
    base = statistics.median(times[(4, 32, True, 1)])
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
            t = statistics.median(times[(bits, block, zp, m)])
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
