"""4-bit min/max RTN with float zero points: llama.cpp's Q4_1 (w = d*q + m per block of 32)
in onnxruntime's MatMulNBits. It reproduces a Q4_1 grid exactly, counts 6.0 bits per weight,
runs right on onnxruntime's kernel, and a size budget that may pick it decodes token-exactly
against its own fake-quantized reference."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from specport.build import quantize
from specport.core.weight_size import graph_weight_size
from specport.loading import load
from specport.passes.quant.blockquant import dequantize, pack_matmul_nbits
from specport.passes.quant.budget import plan_bit_budget
from specport.passes.quant.head import nbits_bytes
from specport.passes.quant.rtn import quantize_rtn
from specport.passes.quant.weight_only import QuantizeWeightsNBitsPass
from specport.passes.quant.weight_quant import better_rows, quantize_weight
from tests.passes.quant.test_algorithms import _correlated_x, _run_matmul_nbits
from tests.passes.quant.test_budget import PROMPT, _reference


def _q4_1_grid(k: int = 128, n: int = 48, seed: int = 0) -> np.ndarray:
    """Weights [K, N] as a dequantized Q4_1 tensor: per (column, block of 32 along K) an fp16
    step d and offset m, codes 0..15 with both ends used (as llama.cpp's min/max rounding)."""
    rng = np.random.default_rng(seed)
    nb = k // 32
    d = rng.uniform(0.002, 0.01, (n, nb)).astype(np.float16).astype(np.float32)
    m = -rng.uniform(0.02, 0.08, (n, nb)).astype(np.float16).astype(np.float32)
    q = rng.integers(0, 16, (n, nb, 32))
    q[..., 0], q[..., 1] = 0, 15
    return (q * d[..., None] + m[..., None]).reshape(n, k).T.astype(np.float32)


def test_float_zero_reproduces_a_q4_1_grid_and_integer_zero_does_not():
    w = _q4_1_grid()
    exact = quantize_rtn(w, 4, 32, float_zero=True)
    assert not exact.integer_zero
    np.testing.assert_allclose(dequantize(exact), w, rtol=0, atol=1e-7)
    shifted = dequantize(quantize_rtn(w, 4, 32))
    assert np.abs(shifted - w).max() > 1e-3  # the integer zero moves the grid


def test_float_zero_bytes_are_six_bits_per_weight_at_block_32():
    k, n = 576, 96
    bq = quantize_rtn(_q4_1_grid(k, n), 4, 32, float_zero=True)
    packed = pack_matmul_nbits(bq)
    assert packed["zero_points"].dtype == np.float32
    stored = sum(a.nbytes for a in packed.values())
    assert stored == nbits_bytes(k, n, 4, 32, float_zero=True)
    assert 8 * stored / (k * n) == 6.0
    assert 8 * nbits_bytes(k, n, 4, 32) / (k * n) == 5.125  # packed uint4 zero points


def test_float_zero_runs_right_on_matmulnbits():
    w = _q4_1_grid(128, 40)
    x = np.random.default_rng(3).standard_normal((5, 128)).astype(np.float32)
    bq = quantize_rtn(w, 4, 32, float_zero=True)
    y = _run_matmul_nbits(x, pack_matmul_nbits(bq), 128, 40, 4, 32)
    np.testing.assert_allclose(y, x @ w, rtol=1e-4, atol=1e-5)


def test_better_rows_keeps_the_grid_that_gptq_leaves():
    """GPTQ's clipped, refit ranges move a Q4_1 weight off its grid; per row the pass keeps
    min/max RTN where it errs less, which on grid weights is every row."""
    w, x = _q4_1_grid(), _correlated_x()
    h = x.astype(np.float64).T @ x

    class Stats:  # the part of ActStats quantize_weight reads
        hessian = h

    gptq = quantize_weight(w, "default", 4, 32, False, Stats(), True)  # type: ignore[arg-type]
    assert np.abs(dequantize(gptq) - w).max() > 1e-4
    best = better_rows(gptq, quantize_rtn(w, 4, 32, float_zero=True), w, h)
    np.testing.assert_allclose(dequantize(best), w, rtol=0, atol=1e-7)


def test_better_rows_does_not_trust_a_channel_calibration_never_saw():
    """A row that errs hugely along input channels with zero calibration activation (zero
    rows in H) loses to a row that errs a little everywhere: H is damped."""
    w, x = _q4_1_grid(), _correlated_x()
    x[:, :32] = 0.0  # block 0's channels never excited
    h = x.astype(np.float64).T @ x
    good = quantize_rtn(w, 4, 32)  # integer zero points: a small error everywhere
    blown = quantize_rtn(w, 4, 32, float_zero=True)
    blown.scale[:, 0] *= 1e4  # block 0 (channels 0-31) blown up
    blown.zero[:, 0] /= 1e4
    best = better_rows(blown, good, w, h)
    np.testing.assert_array_equal(best.scale, good.scale)


def test_budget_offers_float_zero_only_when_asked(quant_src):
    from specport.artifact.manifest import read_manifest
    from specport.core.weight_size import artifact_weight_size

    m = read_manifest(quant_src)
    model = ir.load(quant_src / m.model_file)
    size = artifact_weight_size(quant_src, m)
    args = (model, None, 8.0, size.params, size.weight_bytes)
    plain, _ = plan_bit_budget(*args, widths=(4,))
    offered, report = plan_bit_budget(*args, widths=(4,), float_zero=True)
    assert not plain.float_zero
    assert offered.float_zero and "float zero points offered" in report["measured_with"]
    for name in offered.float_zero:
        row = report["tensors"][name]
        assert row["bits"] == 4 and row["float_zero"] and row["kind"] != "head+table"


@pytest.mark.parametrize(("scheme", "target"), [("w4a16", 6.5), ("w4a8", 6.2)])
def test_float_zero_budget_decodes_like_its_fake_quantized_reference(
    quant_src, calib_text, tmp_path, scheme, target
):
    """A budget with float zero points offered: the chosen sites keep float32 zero points,
    the file holds exactly the planned bytes, and the weights read back and dequantized give
    the same greedy tokens (float zero points run onnxruntime's exact dequantizing path, so
    W4A8's int8 activations touch only the integer-zero sites)."""
    out = tmp_path / "q"
    m = quantize(
        quant_src,
        out,
        scheme=scheme,
        calib_files=[calib_text],
        bits_per_weight=target,
        float_zero=True,
    )
    size, plan = m.quant["size"], m.quant["budget"]
    assert any(t.get("float_zero") for t in plan["tensors"].values())
    assert size["bits_per_weight"] <= target
    assert size["bits_per_weight"] == pytest.approx(plan["planned_bits_per_weight"], abs=1e-3)
    if scheme == "w4a16":
        ref = _reference(out, tmp_path / "ref")
        kw = {"prompt_ids": PROMPT, "max_new_tokens": 24, "greedy": True, "ignore_eos": True}
        assert load(out).generate(**kw).tokens == load(ref).generate(**kw).tokens


def _one_matmul(k: int, n: int, rank_known: bool) -> tuple[ir.Model, np.ndarray]:
    """x [1, S, K] @ W [K, N] as an onnx_ir model; without `rank_known` x has no shape."""
    w = np.random.default_rng(4).standard_normal((k, n)).astype(np.float32) * 0.05
    x = ir.Value(
        name="x",
        shape=ir.Shape([1, "S", k]) if rank_known else None,
        type=ir.TensorType(ir.DataType.FLOAT),
    )
    wv = ir.Value(name="w", shape=ir.Shape([k, n]), type=ir.TensorType(ir.DataType.FLOAT))
    wv.const_value = ir.tensor(w, name="w")
    mm = ir.node("MatMul", [x, wv], name="/model/layers.0/mlp/down_proj/MatMul")
    y = mm.outputs[0]
    y.name, y.type = "y", ir.TensorType(ir.DataType.FLOAT)
    graph = ir.Graph([x], [y], nodes=[mm], initializers=[wv], opset_imports={"": 21})
    return ir.Model(graph, ir_version=10), w


@pytest.mark.parametrize(("k", "rank_known"), [(96, True), (80, True), (96, False)])
@pytest.mark.parametrize("level", [None, 4])
def test_block_offsets_compute_the_float_zero_matmul(k, rank_known, level):
    """Float zero points run as symmetric MatMulNBits codes plus block sums times offsets
    (with K padded to whole blocks); onnxruntime's output is x @ w_hat of the min/max grid.
    Without the input's rank, MatMulNBits takes the float zero points itself."""
    model, w = _one_matmul(k, 40, rank_known)
    result = QuantizeWeightsNBitsPass(
        4, 32, "rtn", float_zero=True, accuracy_level=level, lm_head_bits=4
    )(model)
    assert result.modified
    ops = [n.op_type for n in model.graph]
    nbits = next(n for n in model.graph if n.op_type == "MatMulNBits")
    if rank_known:
        assert "ReduceSum" in ops and len(nbits.inputs) == 3  # no zero points: codes only
        assert ("Pad" in ops) == (k % 32 != 0)
    else:
        assert "ReduceSum" not in ops and nbits.inputs[3].const_value.dtype == ir.DataType.FLOAT
    proto = ir.serde.serialize_model(model)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(5).standard_normal((1, 7, k)).astype(np.float32)
    (y,) = sess.run(None, {"x": x})
    ref = x @ dequantize(quantize_rtn(w, 4, 32, float_zero=True))
    tol = 2e-2 if level == 4 else 1e-5  # int8 activations inside the kernel
    np.testing.assert_allclose(y, ref, rtol=tol, atol=tol * np.abs(ref).max())
    size = graph_weight_size(proto)
    assert size.by_role["zero_points"] == 40 * (-(-k // 32)) * 4  # one float32 per block
