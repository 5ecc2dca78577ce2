"""The W8A8 graph forms (matmulnbits, dynamic, qdq) against numpy references of their integer
arithmetic, in a bare onnxruntime InferenceSession: the activations really are quantized."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from specport.core.errors import QuantizationError
from specport.passes.base import op_counts
from specport.passes.quant import smoothquant as SQ
from specport.passes.quant.blockquant import dequantize
from specport.passes.quant.calibration import ActStats
from specport.passes.quant.ort_check import integer_kernel_summary
from specport.passes.quant.rtn import quantize_rtn
from specport.passes.quant.w8a8 import QuantizeW8A8Pass

K, N, G = 256, 96, 128


def _model(w1: np.ndarray, w2: np.ndarray) -> ir.Model:
    """h = Relu(x @ w1) (a body MatMul), y = h @ w2 (the LM head: it feeds an output)."""
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, "S", K]))
    c1 = ir.Value(name="w1", const_value=ir.tensor(w1, name="w1"))
    c2 = ir.Value(name="w2", const_value=ir.tensor(w2, name="w2"))
    mm1 = ir.node("MatMul", [x, c1], name="mm1")
    relu = ir.node("Relu", [mm1.outputs[0]], name="relu")
    mm2 = ir.node("MatMul", [relu.outputs[0], c2], name="mm2")
    relu.outputs[0].name, mm2.outputs[0].name, mm1.outputs[0].name = "h", "logits", "a"
    graph = ir.Graph(
        [x],
        [relu.outputs[0], mm2.outputs[0]],
        nodes=[mm1, relu, mm2],
        initializers=[c1, c2],
        opset_imports={"": 21},
    )
    return ir.Model(graph, ir_version=10)


def _stats(x: np.ndarray) -> ActStats:
    st = ActStats.empty(x.shape[-1])
    st.update(x, np.random.default_rng(0), 512)
    st.flush()
    return st


def _run(model: ir.Model, tmp: Path, x: np.ndarray) -> np.ndarray:
    path = tmp / "m.onnx"
    ir.save(model, path)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return sess.run(["h"], {"x": x})[0][0]


def _act_int8_blocks(x: np.ndarray, g: int) -> np.ndarray:
    """MatMulNBits accuracy_level 4: symmetric int8 per block of g along K, scale amax/127."""
    xb = x.reshape(x.shape[0], -1, g)
    s = np.abs(xb).max(-1, keepdims=True) / 127.0
    s[s == 0] = 1.0
    return (np.round(xb / s) * s).reshape(x.shape)


def _act_uint8_tensor(x: np.ndarray) -> np.ndarray:
    """DynamicQuantizeLinear: asymmetric uint8 over the whole tensor (range includes 0)."""
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    s = (hi - lo) / 255.0
    zp = np.clip(np.round(-lo / s), 0, 255)
    return (np.clip(np.round(x / s) + zp, 0, 255) - zp) * s


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
    w2 = (rng.standard_normal((N, 64)) * 0.05).astype(np.float32)
    x = rng.standard_normal((1, 24, K)).astype(np.float32)
    x[..., 3] *= 8.0  # an outlier channel, as in real activations
    return w1, w2, x


@pytest.mark.parametrize("form", ["matmulnbits", "dynamic", "qdq"])
def test_forms_match_integer_reference(form, data, tmp_path):
    """Each form's integer arithmetic, as onnxruntime runs it on this CPU: on AVX2 without VNNI
    the uint8 x int8 kernels saturate (the outlier channel drives codes to 255), so the
    dynamic and qdq forms must hold uint8 weights to match."""
    w1, w2, x = data
    model = _model(w1, w2)
    result = QuantizeW8A8Pass({"x": _stats(x[0])}, smooth=False, group_size=G, form=form)(model)
    assert result.report["form"] == form and result.report["layers"]["mm1"]["form"] == form
    ops = op_counts(model)
    body = {
        "matmulnbits": "MatMulNBits",
        "dynamic": "DynamicQuantizeMatMul",
        "qdq": "MatMulIntegerToFloat",  # what onnxruntime fuses the QDQ MatMul into
    }[form]
    graph_op = "DequantizeLinear" if form == "qdq" else f"com.microsoft.{body}"
    assert ops.get(graph_op, 0) >= 1
    got = _run(model, tmp_path, x)
    xs = x[0].astype(np.float64)
    if form == "matmulnbits":
        w_hat = dequantize(quantize_rtn(w1, 8, G, symmetric=False))
        xq = _act_int8_blocks(xs, G)
    else:
        q, s, z = SQ.quantize_uint8_per_channel(w1)
        assert q.dtype == np.uint8  # uint8 x uint8: no int16 saturation on AVX2 without VNNI
        w_hat = (q.astype(np.float64) - z) * s
        xq = _act_uint8_tensor(xs)
    want = np.maximum(xq @ w_hat, 0)
    float_act = np.maximum(xs @ w_hat, 0)
    err = np.abs(got - want).max()
    assert err < 2e-3 * np.abs(want).max(), err
    # the kernel quantized the activations: much closer to the int8 reference than to float ones
    assert err < 0.25 * np.abs(float_act - want).max()
    kernels = integer_kernel_summary(tmp_path / "m.onnx")["kernels"]
    assert kernels.get(f"com.microsoft.{body}", 0) >= 1


def test_head_is_int8_matmulnbits_and_qdq_form_static(data, tmp_path):
    w1, w2, x = data
    model = _model(w1, w2)
    stats = {"x": _stats(x[0]), "h": _stats(np.maximum(x[0] @ w1, 0))}
    result = QuantizeW8A8Pass(stats, group_size=G, form="qdq")(model)
    head = result.report["layers"]["mm2"]
    assert head["bits"] == 8 and head["lm_head"]
    nbits = [n for n in model.graph if n.op_type == "MatMulNBits"]
    assert len(nbits) == 1 and nbits[0].attributes.get_int("accuracy_level") == 4
    assert op_counts(model)["QuantizeLinear"] == 1
    got = _run(model, tmp_path, x)
    ref = np.maximum(x[0] @ w1, 0)
    assert np.abs(got - ref).mean() < 0.02 * np.abs(ref).mean()
    assert (
        integer_kernel_summary(tmp_path / "m.onnx")["kernels"].get(
            "com.microsoft.MatMulIntegerToFloat", 0
        )
        == 1
    )


def test_without_calibration_matmulnbits_is_unsmoothed_rtn(data, tmp_path):
    """No calibration text: the dynamic MatMulNBits form needs no activation ranges, so it is
    the same numbers as the unsmoothed pass with statistics; forms that need static ranges
    say so."""
    w1, w2, x = data
    with_stats = _model(w1, w2)
    QuantizeW8A8Pass({"x": _stats(x[0])}, smooth=False, group_size=G)(with_stats)
    bare = _model(w1, w2)
    report = QuantizeW8A8Pass(None, group_size=G)(bare).report
    assert report["layers"]["mm1"]["act_range"] is None
    assert report["smoothing_folded"] + report["smoothing_into_producer"] == 0
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
    want = _run(with_stats, tmp_path / "a", x)
    assert np.array_equal(_run(bare, tmp_path / "b", x), want)
    for form in ("dynamic", "qdq", "ascend"):
        with pytest.raises(QuantizationError, match="needs calibration"):
            QuantizeW8A8Pass(None, form=form)


def test_unknown_form_refused(data):
    with pytest.raises(QuantizationError, match="form"):
        QuantizeW8A8Pass({}, form="int4")
