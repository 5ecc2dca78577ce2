"""What the MatMulNBits micro-benches share (`matmulnbits_rows`, `matmulnbits_widths`): a stack
of SmolLM2-sized weights (576 x 1536, 60 of them: more weight than the CPU caches hold) and its
timing at several row counts M, every configuration in every round so that they share the
machine's load.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

K, N, LAYERS = 576, 1536, 60


def stack_session(
    bits: int, block: int, level: int, zero_points: bool, threads: int
) -> ort.InferenceSession:
    """``LAYERS`` independent MatMulNBits (random codes, K x N) over one input x [M, K], summed."""
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
                K=K, N=N, bits=bits, block_size=block, accuracy_level=level,
            )
        )  # fmt: skip
    return _summed_session(nodes, inits, threads)


def float_stack_session(threads: int) -> ort.InferenceSession:
    """The same stack as fp32 MatMul (random K x N weights): what an fp32 artifact runs."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    for i in range(LAYERS):
        weight = rng.standard_normal((K, N), dtype=np.float32)
        inits.append(numpy_helper.from_array(weight, f"w{i}"))
        nodes.append(helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]))
    return _summed_session(nodes, inits, threads)


def _summed_session(nodes: list[Any], inits: list[Any], threads: int) -> ort.InferenceSession:
    """A session over the ``LAYERS`` products ``y0..``, summed into y [M, N]."""
    nodes.append(helper.make_node("Sum", [f"y{i}" for i in range(LAYERS)], ["y"]))
    graph = helper.make_graph(
        nodes,
        "matmul_stack",
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


def time_rows(
    sessions: dict[Hashable, ort.InferenceSession], rows: Sequence[int], rounds: int
) -> dict[tuple[Hashable, int], float]:
    """The median over `rounds` of the fastest of 10 runs (after 3 warm-up runs), per
    (configuration, M); each round runs every configuration at every M."""
    inputs = {m: np.random.default_rng(m).standard_normal((m, K), dtype=np.float32) for m in rows}
    times: dict[tuple[Hashable, int], list[float]] = {}
    for _ in range(rounds):
        for key, sess in sessions.items():
            for m in rows:
                for _ in range(3):
                    sess.run(None, {"x": inputs[m]})
                runs = []
                for _ in range(10):
                    start = time.perf_counter()
                    sess.run(None, {"x": inputs[m]})
                    runs.append(time.perf_counter() - start)
                times.setdefault((key, m), []).append(min(runs))
    return {k: statistics.median(v) for k, v in times.items()}
