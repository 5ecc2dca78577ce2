"""Quantization algorithms vs numpy references and a real onnxruntime MatMulNBits kernel."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from specport.core.errors import QuantizationError
from specport.passes.quant import smoothquant as SQ
from specport.passes.quant.blockquant import check_group_size, dequantize, pack_matmul_nbits
from specport.passes.quant.gptq import quantize_gptq, refit_scales
from specport.passes.quant.hqq import quantize_hqq, quantize_symmetric_search
from specport.passes.quant.rtn import quantize_clip, quantize_rtn


def _w(k=128, n=48, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((k, n)) * 0.05).astype(np.float32)


def _correlated_x(k=128, rows=2048, seed=1):
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((k, k)) / np.sqrt(k)
    scales = np.exp(rng.standard_normal(k))  # uneven channel magnitudes
    return (rng.standard_normal((rows, k)) @ mix * scales).astype(np.float32)


def test_int8_per_channel_roundtrip():
    w = _w()
    q, s = SQ.quantize_int8_per_channel(w)
    assert q.dtype == np.int8 and s.shape == (w.shape[1],)
    err = np.abs(q * s - w)
    assert np.all(err <= s / 2 + 1e-7)


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("g", [32, 64, 128])
def test_rtn_roundtrip_bound(sym, g):
    w = _w()
    bq = quantize_rtn(w, 4, g, sym)
    w_hat = dequantize(bq)
    assert w_hat.shape == w.shape
    # Asymmetric: within half a step. Symmetric maps the signed extreme to -8, so the other
    # side may clip at +7: within one step.
    step = np.abs(np.repeat(bq.scale, g, axis=1)[:, : w.shape[0]].T)
    bound = step if sym else step / 2
    assert np.all(np.abs(w_hat - w) <= bound + 1e-6)


def test_rtn_pads_k_not_multiple():
    w = _w(k=172)
    bq = quantize_rtn(w, 4, 32, False)
    assert bq.n_blocks == 6 and dequantize(bq).shape == (172, 48)


def test_bad_group_size():
    with pytest.raises(QuantizationError, match="group size 48"):
        quantize_rtn(_w(), 4, 48)
    with pytest.raises(QuantizationError, match="does not divide"):
        check_group_size(172, 32, allow_pad=False)


def test_hqq_beats_rtn_weight_error():
    rng = np.random.default_rng(3)
    w = (rng.standard_t(3, (256, 64)) * 0.02).astype(np.float32)  # heavy tails
    e_rtn = np.abs(dequantize(quantize_rtn(w, 4, 64)) - w).mean()
    e_hqq = np.abs(dequantize(quantize_hqq(w, 4, 64)) - w).mean()
    assert e_hqq < e_rtn


@pytest.mark.parametrize("g", [32, 64])
def test_symmetric_search_beats_symmetric_rtn_and_runs_without_zero_points(g):
    """The searched scale errs less than symmetric RTN on heavy-tailed weights and keeps the
    implicit zero of 8 (no zero_points input; the kernel check is below)."""
    rng = np.random.default_rng(5)
    w = (rng.standard_t(3, (256, 64)) * 0.02).astype(np.float32)
    searched = quantize_symmetric_search(w, 4, g)
    rtn = quantize_rtn(w, 4, g, symmetric=True)
    assert ((dequantize(searched) - w) ** 2).sum() < 0.95 * ((dequantize(rtn) - w) ** 2).sum()
    assert searched.symmetric and np.all(searched.zero == 8)
    assert "zero_points" not in pack_matmul_nbits(searched)


def _out_err(x, w, bq):
    return float(np.sum((x @ w - x @ dequantize(bq)) ** 2) / np.sum((x @ w) ** 2))


def test_gptq_and_clip_beat_rtn_on_correlated_inputs():
    w, x = _w(), _correlated_x()
    h = x.astype(np.float64).T @ x
    e_rtn = _out_err(x, w, quantize_rtn(w, 4, 32))
    e_gptq = _out_err(x, w, quantize_gptq(w, h, 4, 32))
    e_clip = _out_err(x, w, quantize_clip(w, h, 4, 32))
    assert e_gptq < 0.7 * e_rtn
    assert e_clip < e_rtn


def test_smoothquant_exact_in_float_and_helps_outliers():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((512, 64)).astype(np.float32)
    x[:, 3] *= 60.0  # outlier channel
    w = _w(64, 32)
    amax = np.abs(x).max(0)
    s = SQ.smoothquant_scales(amax, np.abs(w).max(1), 0.5)
    np.testing.assert_allclose((x / s) @ (w * s[:, None]), x @ w, rtol=1e-4, atol=1e-4)
    alpha, s2, err = SQ.search_smoothquant(x, [w], amax)
    assert alpha is not None and err < SQ.w8a8_error(x, w, None) / 2


def _run_matmul_nbits(x, packed, k, n, bits, g):
    inits = [
        numpy_helper.from_array(packed["B"], "B"),
        numpy_helper.from_array(packed["scales"], "S"),
    ]
    ins = ["x", "B", "S"]
    if "zero_points" in packed:
        inits.append(numpy_helper.from_array(packed["zero_points"], "Z"))
        ins.append("Z")
    node = helper.make_node(
        "MatMulNBits", ins, ["y"], domain="com.microsoft", K=k, N=n, bits=bits, block_size=g
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])],
        inits,
    )
    model = helper.make_model(
        graph,
        ir_version=10,
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
    )
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


@pytest.mark.parametrize(
    "algo,k,g,sym",
    [
        ("rtn", 128, 32, False),
        ("rtn", 128, 64, True),
        ("rtn", 172, 32, False),
        ("hqq", 128, 128, False),
        ("hqq", 172, 32, True),
        ("gptq", 96, 32, False),
        ("rtn8", 128, 32, False),
    ],
)
def test_matmul_nbits_matches_numpy_dequant(algo, k, g, sym):
    w = _w(k=k)
    x = np.random.default_rng(5).standard_normal((7, k)).astype(np.float32)
    bits = 8 if algo == "rtn8" else 4
    if algo == "hqq":
        bq = quantize_symmetric_search(w, 4, g) if sym else quantize_hqq(w, 4, g)
    elif algo == "gptq":
        xc = _correlated_x(k)
        bq = quantize_gptq(w, xc.T.astype(np.float64) @ xc, 4, g)
    else:
        bq = quantize_rtn(w, bits, g, sym)
    y = _run_matmul_nbits(x, pack_matmul_nbits(bq), k, w.shape[1], bits, g)
    np.testing.assert_allclose(y, x @ dequantize(bq), rtol=1e-4, atol=1e-4)


def test_act_order_and_refit_reduce_output_error():
    w, x = _w(), _correlated_x()
    h = x.astype(np.float64).T @ x
    plain = quantize_gptq(w, h, 4, 32)
    ao = quantize_gptq(w, h, 4, 32, mse_clip=True, act_order=True)
    refit = refit_scales(ao, w, h)
    assert not refit.integer_zero
    assert _out_err(x, w, refit) < _out_err(x, w, ao)
    assert _out_err(x, w, refit) < _out_err(x, w, plain)
