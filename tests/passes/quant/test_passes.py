"""Quantization graph passes on a real exported tiny Llama, executed by onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from specport.passes.base import op_counts
from specport.passes.quant import calibration as C
from specport.passes.quant.blockquant import dequantize
from specport.passes.quant.embedding import QuantizeEmbeddingPass
from specport.passes.quant.graph import find_weight_matmuls
from specport.passes.quant.ort_check import integer_kernel_summary
from specport.passes.quant.rtn import quantize_rtn
from specport.passes.quant.w8a8 import QuantizeW8A8Pass
from specport.passes.quant.weight_only import QuantizeWeightsNBitsPass

IDS = np.array([1, 40, 50, 60, 70, 80, 90, 33, 44, 55, 66, 77], dtype=np.int64)


def _logits(model: ir.Model, tmp: Path, name: str, ids: np.ndarray = IDS) -> np.ndarray:
    path = tmp / f"{name}.onnx"
    ir.save(model, path, external_data=f"{name}.onnx.data")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    # ORT fuses DQ(int4) -> MatMul into MatMulNBits with int8 activations (accuracy level 4)
    # by default; level 0 keeps float activations, which is what the QDQ graph means.
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return sess.run(["logits"], C.prefill_feeds(sess, ids))[0][0]


def _load(src: Path) -> ir.Model:
    return ir.load(src / "model.onnx")


@pytest.fixture(scope="module")
def stats(quant_src: Path, calib_text: Path) -> dict[str, C.ActStats]:
    seqs = C.tokenize(C.read_documents([calib_text]), quant_src / "tokenizer.json", 1, 128)
    names = sorted({s.x.name for s in find_weight_matmuls(_load(quant_src))})
    return C.capture(quant_src / "model.onnx", names, seqs)


def test_calibration_stats(stats):
    st = next(iter(stats.values()))
    assert st.rows > 100 and np.all(st.hi >= st.lo)
    h = st.hessian
    np.testing.assert_allclose(h, h.T)
    eig = np.linalg.eigvalsh(h)  # PSD up to float32 rounding of the per-chunk Gram updates
    assert np.all(eig > -1e-6 * eig.max())


@pytest.mark.parametrize("form", ["matmulnbits", "qdq"])
def test_w4_pass_equals_numpy_dequant_model(quant_src, tmp_path, form):
    """The quantized graph run by ORT == the fp32 graph with numpy-dequantized weights."""
    model = _load(quant_src)
    result = QuantizeWeightsNBitsPass(4, 32, "rtn", form=form, lm_head_bits=0)(model)
    assert result.modified
    ops = op_counts(model)
    if form == "matmulnbits":
        # head kept in float; q/k/v and gate/up packed (one MatMulNBits + Split each)
        assert ops["com.microsoft.MatMulNBits"] == len(result.report["layers"]) - 1 - 6
        assert ops["Split"] >= 4
    else:
        assert ops["DequantizeLinear"] >= 1
    ref = _load(quant_src)
    for site in find_weight_matmuls(ref):
        if site.lm_head:
            continue
        w_hat = dequantize(quantize_rtn(site.weight_array(), 4, 32))
        site.weight.const_value = ir.tensor(
            w_hat.T.copy() if site.transposed else w_hat, name=site.weight.name
        )
    np.testing.assert_allclose(
        _logits(model, tmp_path, "q"), _logits(ref, tmp_path, "ref"), atol=2e-4, rtol=1e-3
    )


def test_w4_close_to_fp32_and_gptq_better_than_rtn(quant_src, tmp_path, stats, eval_text):
    """On text like the calibration text, the calibrated algorithm beats plain RTN."""
    seqs = C.tokenize(C.read_documents([eval_text]), quant_src / "tokenizer.json", 1, 128)
    ids = np.concatenate(seqs[:4])
    base = _logits(_load(quant_src), tmp_path, "fp32", ids)
    errs = {}
    for algo in ("rtn", "hqq", "default"):
        m = _load(quant_src)
        QuantizeWeightsNBitsPass(4, 32, algo, stats=stats)(m)
        errs[algo] = float(np.abs(_logits(m, tmp_path, algo, ids) - base).mean())
    assert errs["default"] < errs["rtn"]
    assert all(e < 0.5 * np.abs(base).mean() for e in errs.values()), errs


def test_w8a8_fuses_into_integer_kernels(quant_src, tmp_path, stats, eval_text):
    """Static activation ranges hold for text like the calibration text."""
    ids = np.concatenate(
        C.tokenize(C.read_documents([eval_text]), quant_src / "tokenizer.json", 1, 128)[:4]
    )
    model = _load(quant_src)
    result = QuantizeW8A8Pass(stats, form="qdq")(model)
    assert result.modified
    rep = result.report
    assert rep["smoothing_folded"] + rep["smoothing_explicit"] >= 1
    ops = op_counts(model)
    assert ops["QuantizeLinear"] >= 4 and ops["DequantizeLinear"] >= 8
    base = _logits(_load(quant_src), tmp_path, "fp32", ids)
    got = _logits(model, tmp_path, "w8a8", ids)
    assert np.mean(base.argmax(-1) == got.argmax(-1)) >= 0.8  # random weights: near-flat logits
    # 7%: the LM head's activations are int8 too (MatMulNBits accuracy_level 4)
    assert float(np.abs(got - base).mean()) < 0.07 * float(np.abs(base).mean())
    summary = integer_kernel_summary(tmp_path / "w8a8.onnx")
    assert summary["kernels"].get("com.microsoft.MatMulIntegerToFloat", 0) >= 4
    assert summary["float_matmuls"] <= 1 and summary["dequantize_linear_left"] == 0


def test_smoothing_folds_into_norm(quant_src, tmp_path, stats):
    """Norm-fed activations get their 1/s folded into the norm scale, the MLP down input
    (silu(gate) * up) into the up projection's columns; the attention output of this unfused
    graph (MatMul attention, not GroupQueryAttention) keeps an explicit Mul."""
    model = _load(quant_src)
    result = QuantizeW8A8Pass(stats, alphas=(0.5,))(model)
    rep = result.report
    assert rep["smoothing_folded"] == 4  # 2 layers x (attention norm, MLP norm)
    assert rep["smoothing_into_producer"] == 2  # 2 layers x down projection
    assert rep["smoothing_explicit"] == 2  # 2 layers x output projection
    assert op_counts(model).get("Mul", 0) >= 2


def test_embedding_gather_block_quantized(quant_src, tmp_path):
    model = _load(quant_src)
    result = QuantizeEmbeddingPass(bits=8, group_size=32)(model)
    assert result.modified and op_counts(model)["com.microsoft.GatherBlockQuantized"] == 1
    ref = _load(quant_src)
    for node in ref.graph:
        if node.op_type == "Gather" and node.inputs[0].const_value is not None:
            e = node.inputs[0].const_value.numpy()
            e_hat = dequantize(quantize_rtn(e.T, 8, 32)).T
            node.inputs[0].const_value = ir.tensor(
                np.ascontiguousarray(e_hat), name=node.inputs[0].name
            )
    np.testing.assert_allclose(
        _logits(model, tmp_path, "emb"), _logits(ref, tmp_path, "embref"), atol=1e-4, rtol=1e-3
    )


def test_packed_siblings_compute_the_same(quant_src, tmp_path):
    """Packing q/k/v and gate/up into one MatMulNBits + Split changes no number."""
    got = {}
    for pack in (False, True):
        model = _load(quant_src)
        QuantizeWeightsNBitsPass(4, 32, "hqq", pack=pack, accuracy_level=4)(model)
        assert op_counts(model).get("Split", 0) == (4 if pack else 0)
        got[pack] = _logits(model, tmp_path, f"pack{pack}")
    np.testing.assert_allclose(got[True], got[False], atol=1e-5, rtol=1e-5)
