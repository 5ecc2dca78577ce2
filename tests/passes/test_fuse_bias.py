"""fuse_bias on hand-built graphs: positive, variant and near-miss negative per rule, each run in
onnxruntime against the unfused graph; plus the TorchScript GPT-2 fixtures end to end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from specport.passes.base import op_counts
from specport.passes.fuse_bias import FuseBiasPass
from specport.passes.pipelines import optimize_model

D = 8
MS = "com.microsoft"
FIXTURES = Path(__file__).parent / "fixtures"


def _proto(nodes, inputs, outputs, inits):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits)
    ops = [helper.make_opsetid("", 20), helper.make_opsetid(MS, 1)]
    proto = helper.make_model(graph, opset_imports=ops)
    proto.ir_version = 10
    return proto


def _x(name, shape=("B", "S", D)):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def _inits(bias_shape=(D,)):
    rng = np.random.default_rng(0)
    arrays = {
        "w": rng.standard_normal((D, D)),
        "b": rng.standard_normal(bias_shape),
        "g": 1 + 0.1 * rng.standard_normal(D),
        "beta": 0.1 * rng.standard_normal(D),
    }
    return [numpy_helper.from_array(v.astype(np.float32), k) for k, v in arrays.items()]


def _run(proto, model=None):
    """Outputs of `proto` (or of the fused `model`) on fixed random inputs, ORT optimizations off
    so the fused graph itself is what runs."""
    data = ir.serde.serialize_model(model) if model is not None else proto
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(data.SerializeToString(), so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    feeds = {i.name: rng.standard_normal((2, 3, D)).astype(np.float32) for i in sess.get_inputs()}
    return sess.run(None, feeds)


def _fuse(proto):
    model = ir.serde.deserialize_model(proto)
    result = FuseBiasPass()(model)
    return model, result


def _check_parity(proto, model):
    for want, got in zip(_run(proto), _run(proto, model)):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def _gelu_graph(approximate="tanh", bias_first=False, bias_shape=(D,)):
    add_in = ["b", "h"] if bias_first else ["h", "b"]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", add_in, ["hb"]),
        helper.make_node("Gelu", ["hb"], ["y"], approximate=approximate),
    ]
    return _proto(nodes, [_x("x")], [_x("y")], _inits(bias_shape))


def test_bias_gelu_tanh_becomes_fast_gelu():
    proto = _gelu_graph("tanh")
    model, result = _fuse(proto)
    assert op_counts(model) == {"MatMul": 1, f"{MS}.FastGelu": 1}
    assert result.report["matched"]["bias_gelu"] == 1
    _check_parity(proto, model)


def test_bias_gelu_variant_erf_with_bias_first():
    """torch's default (erf) GELU, bias written as the Add's first input (dynamo's addmm)."""
    proto = _gelu_graph("none", bias_first=True)
    model, _ = _fuse(proto)
    assert op_counts(model) == {"MatMul": 1, f"{MS}.BiasGelu": 1}
    _check_parity(proto, model)


@pytest.mark.parametrize(
    "bias_shape, reason", [((1, D), "bias is not 1-D"), ((1,), "bias length 1 != last dim 8")]
)
def test_bias_gelu_negative_not_a_channel_bias(bias_shape, reason):
    model, result = _fuse(_gelu_graph("tanh", bias_shape=bias_shape))
    assert op_counts(model) == {"MatMul": 1, "Add": 1, "Gelu": 1}
    assert any(r["reason"].startswith(reason) for r in result.report["rejected"])


def _skip_graph(op="SkipLayerNormalization", skip_side=False, extra_use=False, residual=False):
    b = "r2" if residual else "b"
    params = ["g", "beta"] if op == "SkipLayerNormalization" else ["g"]
    pair = ["res", "hb"] if skip_side else ["hb", "res"]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", b], ["hb"]),
        helper.make_node(op, [*pair, *params], ["y", "", "", "sum"], domain=MS, epsilon=1e-5),
    ]
    inputs = [_x("x"), _x("res")] + ([_x("r2")] if residual else [])
    outputs = [_x("y"), _x("sum")] + ([_x("hb")] if extra_use else [])
    return _proto(nodes, inputs, outputs, _inits())


def test_skip_layer_norm_takes_the_bias():
    proto = _skip_graph()
    model, result = _fuse(proto)
    assert op_counts(model) == {"MatMul": 1, f"{MS}.SkipLayerNormalization": 1}
    node = next(n for n in model.graph if n.op_type == "SkipLayerNormalization")
    assert node.inputs[4] is not None and node.inputs[4].name == "b"
    assert result.report["matched"]["skip_ln_bias"] == 1
    _check_parity(proto, model)


@pytest.mark.parametrize("op", ["SkipLayerNormalization", "SkipSimplifiedLayerNormalization"])
def test_skip_norm_bias_variant_on_the_skip_input(op):
    """The biased projection feeds `skip` (GPT-2's MLP output: residual + mlp); and the RMS form."""
    proto = _skip_graph(op, skip_side=True)
    model, _ = _fuse(proto)
    assert op_counts(model) == {"MatMul": 1, f"{MS}.{op}": 1}
    _check_parity(proto, model)


@pytest.mark.parametrize(
    "kw, reason",
    [
        ({"extra_use": True}, None),  # x + b is also a graph output: cannot disappear
        ({"residual": True}, "addend is not a constant"),  # a residual add, not a bias
    ],
)
def test_skip_norm_bias_negative(kw, reason):
    model, result = _fuse(_skip_graph(**kw))
    assert op_counts(model)["Add"] == 1
    assert not result.modified
    if reason:
        assert any(r["reason"].startswith(reason) for r in result.report["rejected"])


@pytest.mark.parametrize(
    "name, skip_biases",
    [
        ("ts_gpt2_past_eager.onnx", 4),
        ("ts_gpt2_past_sdpa.onnx", 4),
        ("optimum_gpt2.onnx", 4),
        ("dynamo_gpt2_past.onnx", 2),
    ],
)
def test_gpt2_exports_fold_biases(name, skip_biases):
    """Each layer: FastGelu for c_fc; the SkipLayerNorms take the MLP's c_proj bias (and, in
    TorchScript's spelling, the attention c_proj's too: dynamo's stays a Gemm, as in
    onnxruntime's optimizer). The cpu default lowers skip-norms to Add + LayerNormalization
    (faster there), so the contrib kernel is asked for here, as cuda gets it.
    Logits vs the input model: test_third_party_exports."""
    model, report = optimize_model(FIXTURES / name, "cpu", skip_layer_norm="contrib")
    counts = op_counts(model)
    fb = next(p for p in report["passes"] if p["name"] == "fuse_bias")
    assert counts[f"{MS}.FastGelu"] == 2 and "Gelu" not in counts
    assert fb["matched"]["skip_ln_bias"] + fb["matched"]["skip_ln_bias_skip"] == skip_biases
