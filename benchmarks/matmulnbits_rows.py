"""What a verify run costs a 4-bit model on this CPU: MatMulNBits time against rows M.

Speculative decoding pays when a verify run over 1 + K tokens costs little more than a
one-token step. At fp32 a decode step reads 4 bytes a weight and the extra rows ride along
on the same memory traffic; at 4 bits the weights are an eighth of that and the extra rows'
arithmetic shows. This times a stack of SmolLM2-sized MatMulNBits (576 x 1536, blocks of 32,
60 of them: more weight than the CPU caches hold) at M = 1, 2, 3, 5, 9 rows, with int8
activations (accuracy_level 4, what w4a8 artifacts use) and with float ones (level 1), with and
without zero points, the configurations alternating in every round. Usage:

    python benchmarks/matmulnbits_rows.py [--threads 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

K, N, BLOCK, LAYERS = 576, 1536, 32, 60
ROWS = (1, 2, 3, 5, 9)


def session(level: int, zero_points: bool, threads: int) -> ort.InferenceSession:
    """``LAYERS`` independent MatMulNBits over one input, summed."""
    rng = np.random.default_rng(0)
    blocks = K // BLOCK
    nodes, inits = [], []
    for i in range(LAYERS):
        weight = rng.integers(0, 255, size=(N, blocks, BLOCK // 2), dtype=np.uint8)
        scale = rng.random(N * blocks, dtype=np.float32) * 0.01 + 0.001
        inits += [numpy_helper.from_array(weight, f"w{i}"), numpy_helper.from_array(scale, f"s{i}")]
        inputs = ["x", f"w{i}", f"s{i}"]
        if zero_points:
            zp = rng.integers(0, 255, size=N * ((blocks + 1) // 2), dtype=np.uint8)
            inits.append(numpy_helper.from_array(zp, f"z{i}"))
            inputs.append(f"z{i}")
        nodes.append(
            helper.make_node(
                "MatMulNBits", inputs, [f"y{i}"], domain="com.microsoft",
                K=K, N=N, bits=4, block_size=BLOCK, accuracy_level=level,
            )
        )  # fmt: skip
    nodes.append(helper.make_node("Sum", [f"y{i}" for i in range(LAYERS)], ["y"]))
    graph = helper.make_graph(
        nodes,
        "rows",
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
    configs = {
        (level, zp): session(level, zp, args.threads) for level in (4, 1) for zp in (False, True)
    }
    inputs = {m: np.random.default_rng(m).standard_normal((m, K), dtype=np.float32) for m in ROWS}
    times: dict[tuple[int, bool, int], list[float]] = {}
    print("load average", Path("/proc/loadavg").read_text().split()[:3])
    for _ in range(args.rounds):
        for key, sess in configs.items():
            for m in ROWS:
                for _ in range(3):
                    sess.run(None, {"x": inputs[m]})
                runs = []
                for _ in range(10):
                    start = time.perf_counter()
                    sess.run(None, {"x": inputs[m]})
                    runs.append(time.perf_counter() - start)
                times.setdefault((*key, m), []).append(min(runs))
    print("| accuracy level | zero points | " + " | ".join(f"M = {m}" for m in ROWS) + " |")
    print("|---|---|" + "---:|" * len(ROWS))
    for level, zp in configs:
        one = statistics.median(times[(level, zp, 1)])
        cells = []
        for m in ROWS:
            t = statistics.median(times[(level, zp, m)])
            cells.append(f"{t * 1e3:.2f} ms ({t / one:.2f}×)")
        print(f"| {level} | {'yes' if zp else 'no'} | " + " | ".join(cells) + " |")
    print("load average", Path("/proc/loadavg").read_text().split()[:3])


if __name__ == "__main__":
    main()
