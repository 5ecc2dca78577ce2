"""What a 4-bit weight's zero points cost a step on this CPU, as specport emits them: packed
uint4 zero points, none (symmetric), float zero points as symmetric codes plus block offsets
(passes/quant/block_offsets.py), and float zero points handed to MatMulNBits itself (what an
input of unknown rank gets). Each is one SmolLM2-shaped MatMul quantized by
QuantizeWeightsNBitsPass (RTN, block 32), checked against numpy's x @ w_hat, and timed in
process CPU time at M = 1 and 8 rows, one thread, float (accuracy_level 0) and int8
(accuracy_level 4) activations, the forms alternating in every round. Usage:

    python -m benchmarks.matmulnbits_zero_points [--rounds 5] [--runs 200]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from specport.passes.quant.blockquant import dequantize
from specport.passes.quant.rtn import quantize_rtn
from specport.passes.quant.weight_only import QuantizeWeightsNBitsPass

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # packed QKV, o, gate/up, down
FORMS = ("uint4 zero points", "symmetric", "float zero: block offsets", "float zero: MatMulNBits")


def _session(k: int, n: int, form: str, level: int) -> tuple[ort.InferenceSession, np.ndarray]:
    """One MatMul x [1, S, K] @ w [K, N] quantized in `form`; also returns numpy's w_hat."""
    w = np.random.default_rng(k + n).standard_normal((k, n)).astype(np.float32) * 0.05
    rank_known = form != "float zero: MatMulNBits"
    x = ir.Value(name="x", shape=ir.Shape([1, "S", k]) if rank_known else None)
    x.type = ir.TensorType(ir.DataType.FLOAT)
    wv = ir.Value(name="w", shape=ir.Shape([k, n]), type=ir.TensorType(ir.DataType.FLOAT))
    wv.const_value = ir.tensor(w, name="w")
    mm = ir.node("MatMul", [x, wv], name="/model/layers.0/mlp/MatMul")
    mm.outputs[0].name, mm.outputs[0].type = "y", ir.TensorType(ir.DataType.FLOAT)
    model = ir.Model(
        ir.Graph([x], [mm.outputs[0]], nodes=[mm], initializers=[wv], opset_imports={"": 21}),
        ir_version=10,
    )
    float_zero = form.startswith("float")
    QuantizeWeightsNBitsPass(
        4,
        32,
        "rtn",
        symmetric=form == "symmetric",
        float_zero=float_zero,
        accuracy_level=level or None,
        lm_head_bits=4,
    )(model)
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    proto = ir.serde.serialize_model(model).SerializeToString()
    sess = ort.InferenceSession(proto, so, providers=["CPUExecutionProvider"])
    w_hat = dequantize(quantize_rtn(w, 4, 32, form == "symmetric", float_zero=float_zero))
    return sess, w_hat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=200, help="runs per round at M = 1")
    args = parser.parse_args()
    print("load average", os.getloadavg(), "onnxruntime", ort.__version__)
    print("| K x N | activations | zero points | max rel. error | M = 1 (us) | M = 8 (us) |")
    print("|---|---|---|---:|---:|---:|")
    rng = np.random.default_rng(0)
    for k, n in SHAPES:
        for level in (0, 4):
            built = {f: _session(k, n, f, level) for f in FORMS}
            xs = {m: rng.standard_normal((1, m, k)).astype(np.float32) for m in (1, 8)}
            err = {}
            for f, (sess, w_hat) in built.items():
                (y,) = sess.run(None, {"x": xs[8]})
                ref = xs[8][0].astype(np.float64) @ w_hat
                err[f] = float(np.abs(y[0] - ref).max() / np.abs(ref).max())
            cpu: dict[tuple[str, int], list[float]] = {}
            for _ in range(args.rounds):
                for f, (sess, _) in built.items():
                    for m in (1, 8):
                        runs = max(1, args.runs // (m * (10 if "MatMulNBits" in f else 1)))
                        t0 = time.process_time()
                        for _ in range(runs):
                            sess.run(None, {"x": xs[m]})
                        cpu.setdefault((f, m), []).append((time.process_time() - t0) / runs)
            act = "float" if level == 0 else "int8"
            for f in FORMS:
                t1, t8 = (1e6 * float(np.median(cpu[(f, m)])) for m in (1, 8))
                print(f"| {k} x {n} | {act} | {f} | {err[f]:.1e} | {t1:.1f} | {t8:.1f} |")
    print("load average", os.getloadavg())


if __name__ == "__main__":
    main()
