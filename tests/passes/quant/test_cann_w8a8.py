"""W8A8 on a `--target cann` artifact: Ascend's layout (symmetric per-output-channel int8
weights, int8 activations with one scale and one offset per tensor), standard ops only, and
numbers close to the float graph on the CPU provider."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from specport.core.errors import ProviderError, QuantizationError
from specport.custom_ops.cann import check_ops
from specport.passes.quant import smoothquant as SQ
from specport.passes.quant.apply import quantize_artifact
from specport.passes.quant.calibration import ActStats
from specport.passes.quant.w8a8 import QuantizeW8A8Pass
from specport.runtime.eval import perplexity
from tests.passes.quant._tiny import with_tokenizer


@pytest.fixture(scope="module")
def cann_src(tiny_zoo, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.export_cache import cached_export

    tmp = tmp_path_factory.mktemp("cann")
    cached_export(tiny_zoo.source("llama"), tmp / "raw", target="cann", progress=False)
    return with_tokenizer(tmp / "raw", tmp / "src")


@pytest.fixture(scope="module")
def cann_w8a8(cann_src: Path, calib_text: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cann_q") / "w8a8"
    quantize_artifact(cann_src, out, "w8a8", None, "default", [calib_text])
    return out


def _two_matmuls(w1: np.ndarray, w2: np.ndarray) -> ir.Model:
    """h = Relu(x @ w1) (a body MatMul), logits = h @ w2 (the LM head)."""
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, "S", 64]))
    c1 = ir.Value(name="w1", const_value=ir.tensor(w1, name="w1"))
    c2 = ir.Value(name="w2", const_value=ir.tensor(w2, name="w2"))
    mm1 = ir.node("MatMul", [x, c1], name="mm1")
    relu = ir.node("Relu", [mm1.outputs[0]], name="relu")
    mm2 = ir.node("MatMul", [relu.outputs[0], c2], name="mm2")
    relu.outputs[0].name, mm2.outputs[0].name = "h", "logits"
    graph = ir.Graph(
        [x], [mm2.outputs[0]], nodes=[mm1, relu, mm2], initializers=[c1, c2], opset_imports={"": 21}
    )
    return ir.Model(graph, ir_version=10)


def _stats(x: np.ndarray) -> ActStats:
    st = ActStats.empty(x.shape[-1])
    st.update(x, np.random.default_rng(0), 512)
    st.flush()
    return st


def test_ascend_form_is_the_uint8_grid_in_int8_codes() -> None:
    """Same numbers as the uint8 QDQ form (the grid shifted by 128), head included, and no
    com.microsoft op; int8 activations with a scalar offset, int8 symmetric weights."""
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((64, 48)) * 0.05).astype(np.float32)
    w2 = (rng.standard_normal((48, 32)) * 0.05).astype(np.float32)
    x = rng.standard_normal((1, 16, 64)).astype(np.float32)
    h = np.maximum(x @ w1, 0)
    stats = {"x": _stats(x[0]), "h": _stats(h[0])}
    outs = {}
    for form in ("ascend",):
        model = _two_matmuls(w1, w2)
        report = QuantizeW8A8Pass(stats, smooth=False, form=form).rewrite(model)[1]
        proto = ir.to_proto(model)
        if form == "ascend":  # loop kept for more forms of the same layout
            assert report["layers"]["mm2"]["lm_head"]
            assert all(n.domain in ("", "ai.onnx") for n in proto.graph.node)
            zeros = [i for i in proto.graph.initializer if i.name.endswith(".act_zero")]
            assert len(zeros) == 2 and all(z.data_type == onnx.TensorProto.INT8 for z in zeros)
            assert all(not z.dims for z in zeros)  # one offset per tensor
        so = ort.SessionOptions()
        so.add_session_config_entry("session.disable_quant_qdq", "1")  # as the manifest says
        sess = ort.InferenceSession(
            proto.SerializeToString(), so, providers=["CPUExecutionProvider"]
        )
        outs[form] = sess.run(["logits"], {"x": x})[0]

    def fake(v: np.ndarray, calibrated: np.ndarray) -> np.ndarray:  # the calibrated grid
        sa, za = SQ.quantize_activation_uint8(calibrated.min(), calibrated.max())
        return SQ.fake_quant_uint8(v, float(sa), int(za))

    def wq(w: np.ndarray) -> np.ndarray:
        q, scale = SQ.quantize_int8_per_channel(w)
        return q.astype(np.float32) * scale

    want = fake(np.maximum(fake(x, x) @ wq(w1), 0), h) @ wq(w2)
    assert np.abs(outs["ascend"] - want).max() < 1e-4 * np.abs(want).max() + 1e-6
    # W8A8 per-tensor on a random 64-wide layer: a few percent of the largest float output
    ref = h @ w2
    assert np.abs(outs["ascend"] - ref).max() < 0.1 * np.abs(ref).max()


def _graph(artifact: Path) -> onnx.ModelProto:
    return onnx.load(str(artifact / "model.onnx"))


@pytest.mark.slow
def test_cann_w8a8_is_ascend_layout(cann_w8a8: Path) -> None:
    manifest = json.loads((cann_w8a8 / "specport.json").read_text())
    assert manifest["target"] == "cann" and manifest["quant"]["form"] == "ascend"
    assert manifest["quant"]["accuracy_level"] == 0
    assert manifest["quant"]["ort_session_config"] == {"session.disable_quant_qdq": "1"}
    proto = _graph(cann_w8a8)
    assert all(n.domain in ("", "ai.onnx") for n in proto.graph.node)
    import onnx_ir as ir

    report = check_ops(ir.from_proto(proto))
    assert report["forbidden"] == {}
    assert set(report["quant_ops"]) == {"QuantizeLinear", "DequantizeLinear"}
    inits = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    weights = acts = 0
    for node in proto.graph.node:
        if node.op_type == "DequantizeLinear" and inits.get(node.input[0]) is not None:
            q, scale = inits[node.input[0]], inits[node.input[1]]
            assert q.dtype == np.int8 and q.ndim == 2 and q.min() >= -127  # symmetric
            assert scale.shape == (q.shape[1],)  # one scale per output channel
            assert len(node.input) < 3 or not inits[node.input[2]].any()  # no weight offset
            assert {a.name: a.i for a in node.attribute}.get("axis", 1) == 1
            weights += 1
        if node.op_type == "QuantizeLinear":
            scale, zero = inits[node.input[1]], inits[node.input[2]]
            assert scale.shape == () and zero.shape == () and zero.dtype == np.int8
            acts += 1
    assert weights and acts
    # every weight MatMul, LM head included, reads an int8-QDQ'd activation
    matmuls = [n for n in proto.graph.node if n.op_type == "MatMul"]
    producers = {o: n for n in proto.graph.node for o in n.output}
    quantized = [
        n
        for n in matmuls
        if all(producers.get(i, n).op_type == "DequantizeLinear" for i in n.input)
    ]
    assert len(quantized) == weights


@pytest.mark.slow
def test_cann_w8a8_numbers_close_to_float(cann_src: Path, cann_w8a8: Path, eval_text: Path) -> None:
    """Logits on the CPU provider (the graph's own arithmetic: the manifest's session config)
    against the float artifact, and perplexity within 5%."""
    ids = np.array([[1, 5, 9, 20, 33, 41, 7, 3]], np.int64)
    outs = []
    for art in (cann_src, cann_w8a8):
        so = ort.SessionOptions()
        config = json.loads((art / "specport.json").read_text()).get("quant") or {}
        for key, value in (config.get("ort_session_config") or {}).items():
            so.add_session_config_entry(key, value)
        sess = ort.InferenceSession(str(art / "model.onnx"), so, providers=["CPUExecutionProvider"])
        feeds = {}
        for inp in sess.get_inputs():
            if inp.name == "input_ids":
                feeds[inp.name] = ids
            elif inp.name == "attention_mask":
                feeds[inp.name] = np.ones_like(ids)
            elif inp.name == "position_ids":
                feeds[inp.name] = np.arange(ids.shape[1], dtype=np.int64)[None]
            else:  # empty past KV
                shape = [
                    1 if d == "batch" else 0 if not isinstance(d, int) else d for d in inp.shape
                ]
                feeds[inp.name] = np.zeros(shape, np.float32)
        outs.append(sess.run(["logits"], feeds)[0])
    ref, got = outs
    base, ppl = perplexity(cann_src, eval_text)["ppl"], perplexity(cann_w8a8, eval_text)["ppl"]
    # A random 2-layer model (near-uniform predictions): measured 19% mean logit change, 7 of
    # 8 top-1 tokens kept, perplexity -0.2%. Stories260K (real weights): +0.5% perplexity.
    assert np.abs(ref - got).mean() < 0.3 * np.abs(ref).mean()
    assert (ref.argmax(-1) == got.argmax(-1)).mean() >= 0.75
    assert ppl < base * 1.05, (ppl, base)


@pytest.mark.slow
def test_cann_refuses_the_dynamic_form(cann_src: Path, calib_text: Path, tmp_path: Path) -> None:
    with pytest.raises(QuantizationError, match="--form ascend"):
        quantize_artifact(
            cann_src, tmp_path / "d", "w8a8", None, "default", [calib_text], form="dynamic"
        )


def test_cann_provider_refused_without_ascend_toolkit() -> None:
    from specport.runtime.providers import available, resolve

    if "cann" in available():
        pytest.skip("this onnxruntime has the CANN provider")
    with pytest.raises(ProviderError, match="CANN provider on an Ascend machine"):
        resolve("cann")
