"""Each fusion rule on a hand-built 3-10 node graph: positive, variant, negative (with reason)."""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from specport.custom_ops.testing import run
from specport.passes.base import op_counts
from specport.passes.fuse_attention import FuseAttentionPass
from specport.passes.fuse_gelu import FuseGeluPass
from specport.passes.fuse_rms_norm import FuseRMSNormPass
from specport.passes.fuse_rotary import FuseRotaryPass
from specport.passes.fuse_skip_norm import FuseSkipNormPass

D = 8


def _model(nodes, inputs, outputs, inits=(), opset=23):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    proto.ir_version = 10
    return ir.serde.deserialize_model(proto)


def _c(name, value, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(value, dtype), name)


def _x(name="x", shape=("B", "S", D)):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def _rms_graph(square="pow", inv="div", exponent=2.0):
    sq = (
        helper.make_node("Pow", ["x", "two"], ["sq"])
        if square == "pow"
        else helper.make_node("Mul", ["x", "x"], ["sq"])
    )
    inv_node = (
        helper.make_node("Div", ["one", "root"], ["inv"])
        if inv == "div"
        else helper.make_node("Reciprocal", ["root"], ["inv"])
    )
    nodes = [
        sq,
        helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
        helper.make_node("Add", ["ms", "eps"], ["mse"]),
        helper.make_node("Sqrt", ["mse"], ["root"]),
        inv_node,
        helper.make_node("Mul", ["x", "inv"], ["xn"]),
        helper.make_node("Mul", ["w", "xn"], ["y"]),
    ]
    rng = np.random.default_rng(0)
    inits = [
        _c("two", exponent),
        _c("axes", [-1], np.int64),
        _c("eps", 1e-6),
        _c("one", 1.0),
        _c("w", rng.standard_normal(D)),
    ]
    return _model(nodes, [_x()], [_x("y")], inits)


@pytest.mark.parametrize("square,inv", [("pow", "div"), ("mul", "reciprocal")])
def test_decomposed_rms_norm(square, inv):
    model = _rms_graph(square, inv)
    x = np.random.default_rng(1).standard_normal((2, 3, D), dtype=np.float32)
    want = run(model, {"x": x})[0]
    result = FuseRMSNormPass()(model)
    assert result.modified
    assert op_counts(model) == {"specport.RMSNorm": 1}
    from specport.custom_ops import attach_functions

    attach_functions(model)
    np.testing.assert_allclose(run(model, {"x": x})[0], want, atol=1e-5)


def test_rms_norm_negative_reports_reason():
    model = _rms_graph(exponent=3.0)
    result = FuseRMSNormPass()(model)
    assert not result.modified
    reasons = {r["reason"] for r in result.report["rejected"]}
    assert "exponent is not the constant 2" in reasons


def test_skip_norm_positive_and_bias_negative():
    nodes = [
        helper.make_node("Add", ["a", "b"], ["s"]),
        helper.make_node("RMSNormalization", ["s", "w"], ["y"], epsilon=1e-5),
    ]
    inits = [_c("w", np.ones(D))]
    model = _model(nodes, [_x("a"), _x("b")], [_x("y"), _x("s")], inits)
    FuseRMSNormPass()(model)
    result = FuseSkipNormPass()(model)
    assert op_counts(model) == {"specport.SkipRMSNorm": 1}
    assert result.report["matched"]["skip_rms_norm"] == 1
    # a bias add (constant addend) is not a residual
    nodes[0] = helper.make_node("Add", ["a", "bias"], ["s"])
    model = _model(nodes, [_x("a")], [_x("y"), _x("s")], [*inits, _c("bias", np.ones(D))])
    FuseRMSNormPass()(model)
    result = FuseSkipNormPass()(model)
    assert not result.modified and result.report["rejected"]


def test_rotary_interleaved_is_refused():
    cs = helper.make_tensor_value_info("cos", TensorProto.FLOAT, ["B", "S", 4])
    sn = helper.make_tensor_value_info("sin", TensorProto.FLOAT, ["B", "S", 4])
    x = _x("x", ("B", 2, "S", D))
    for inter, fused in ((0, True), (1, False)):
        node = helper.make_node("RotaryEmbedding", ["x", "cos", "sin"], ["y"], interleaved=inter)
        model = _model([node], [x, cs, sn], [_x("y", ("B", 2, "S", D))])
        result = FuseRotaryPass()(model)
        assert result.modified is fused
        if not fused:
            assert "interleaved" in result.report["rejected"][0]["reason"]


def test_tanh_gelu():
    c = math.sqrt(2 / math.pi)
    nodes = [
        helper.make_node("Mul", ["x", "half"], ["hx"]),
        helper.make_node("Pow", ["x", "three"], ["x3"]),
        helper.make_node("Mul", ["x3", "k"], ["kx3"]),
        helper.make_node("Add", ["x", "kx3"], ["inner"]),
        helper.make_node("Mul", ["inner", "c"], ["scaled"]),
        helper.make_node("Tanh", ["scaled"], ["t"]),
        helper.make_node("Add", ["t", "one"], ["t1"]),
        helper.make_node("Mul", ["hx", "t1"], ["y"]),
    ]
    inits = [_c("half", 0.5), _c("three", 3.0), _c("k", 0.044715), _c("c", c), _c("one", 1.0)]
    model = _model(nodes, [_x()], [_x("y")], inits)
    x = np.random.default_rng(2).standard_normal((2, 3, D), dtype=np.float32)
    want = run(model, {"x": x})[0]
    assert FuseGeluPass()(model).modified
    assert op_counts(model) == {"Gelu": 1}
    np.testing.assert_allclose(run(model, {"x": x})[0], want, atol=1e-5)


def test_attention_needs_the_spine_mask():
    q = _x("q", ("B", 4, "S", D))
    node = helper.make_node("Attention", ["q", "q", "q"], ["y"])
    model = _model([node], [q], [_x("y", ("B", 4, "S", D))])
    result = FuseAttentionPass()(model)
    assert not result.modified and "attention_mask" in result.report["note"]


def test_attention_without_cache_is_kept():
    q = _x("q", ("B", 4, "S", D))
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["B", "T"])
    node = helper.make_node("Attention", ["q", "q", "q"], ["y"], is_causal=1)
    model = _model([node], [q, mask], [_x("y", ("B", 4, "S", D))])
    result = FuseAttentionPass()(model)
    # no cache: the Attention-23 node already is the one fused node; nothing to rewrite
    assert not result.modified and "rejected" not in result.report
    assert result.report["no_cache_attention"][0]["op"] == "Attention-23"


def _ln_graph(commuted=False, axis=-1):
    """TorchScript LayerNorm below opset 17: (x - mean) / sqrt(var + eps) * w + b."""
    nodes = [
        helper.make_node("ReduceMean", ["x", "axes"], ["mean"], keepdims=1),
        helper.make_node("Sub", ["x", "mean"], ["d"]),
        helper.make_node("Pow", ["d", "two"], ["d2"]),
        helper.make_node("ReduceMean", ["d2", "axes2"], ["var"], keepdims=1),
        helper.make_node("Add", ["eps", "var"] if commuted else ["var", "eps"], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["sd"]),
        helper.make_node("Div", ["d", "sd"], ["n"]),
        helper.make_node("Mul", ["w", "n"] if commuted else ["n", "w"], ["nw"]),
        helper.make_node("Add", ["b", "nw"] if commuted else ["nw", "b"], ["y"]),
    ]
    rng = np.random.default_rng(0)
    inits = [
        _c("axes", [-1], np.int64),
        _c("axes2", [axis], np.int64),
        _c("two", 2.0),
        _c("eps", 1e-5),
        _c("w", rng.standard_normal(D)),
        _c("b", rng.standard_normal(D)),
    ]
    return _model(nodes, [_x()], [_x("y")], inits)


@pytest.mark.parametrize("commuted", [False, True], ids=["torchscript", "commuted"])
def test_decomposed_layer_norm(commuted):
    model = _ln_graph(commuted)
    x = np.random.default_rng(1).standard_normal((2, 3, D), dtype=np.float32)
    want = run(model, {"x": x})[0]
    result = FuseRMSNormPass()(model)
    assert result.report["matched"]["decomposed_layer_norm"] == 1
    assert op_counts(model) == {"LayerNormalization": 1}
    np.testing.assert_allclose(run(model, {"x": x})[0], want, atol=1e-5)


def test_layer_norm_over_another_axis_is_refused():
    model = _ln_graph(axis=1)  # variance over the sequence axis: not a LayerNorm
    result = FuseRMSNormPass()(model)
    assert not result.modified
    assert any("not the last axis" in r["reason"] for r in result.report["rejected"])


def _cached_attention_graph(softcap: float):
    """Attention-23 (softcap) over Concat(past, new) KV, one decode token: the exported shape."""
    d, h, p = 16, 4, 5
    past = [_x(f"past_key_values.0.{n}", ("B", h, "P", d)) for n in ("key", "value")]
    new = [_x(n, ("B", h, 1, d)) for n in ("q", "k", "v")]
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["B", "T"])
    nodes = [
        helper.make_node("Concat", ["past_key_values.0.key", "k"], ["present.0.key"], axis=2),
        helper.make_node("Concat", ["past_key_values.0.value", "v"], ["present.0.value"], axis=2),
        helper.make_node("Equal", ["attention_mask", "one"], ["real"]),
        helper.make_node("Unsqueeze", ["real", "axes"], ["mask4"]),  # [B, 1, 1, T] bool
        helper.make_node(
            "Attention",
            ["q", "present.0.key", "present.0.value", "mask4"],
            ["y"],
            scale=0.5,
            softcap=softcap,
        ),
    ]
    outs = [
        _x("y", ("B", h, 1, d)),
        *(_x(f"present.0.{n}", ("B", h, "T", d)) for n in ("key", "value")),
    ]
    inits = [_c("one", 1, np.int64), _c("axes", [1, 2], np.int64)]
    model = _model(nodes, [*new, *past, mask], outs, inits)
    rng = np.random.default_rng(0)
    feeds = {v.name: rng.standard_normal((2, h, 1, d)).astype(np.float32) for v in new}
    for v in past:
        feeds[v.name] = rng.standard_normal((2, h, p, d)).astype(np.float32)
    feeds["attention_mask"] = np.ones((2, p + 1), np.int64)
    return model, feeds


def test_attention_softcap_is_carried_into_the_fused_op():
    """Gemma 2's soft-capped scores: fused with the cap, and onnxruntime's lowered kernel gives
    the unfused graph's numbers (which differ from the uncapped ones)."""
    from specport.custom_ops.lowering import lower_model

    model, feeds = _cached_attention_graph(softcap=2.0)
    want = run(model, feeds)[0]
    uncapped = run(_cached_attention_graph(softcap=0.0)[0], feeds)[0]
    assert np.abs(want - uncapped).max() > 1e-2  # the cap changes the result
    result = FuseAttentionPass()(model)
    assert result.modified, result.report
    assert result.report["fused"][0]["softcap"] == 2.0
    lower_model(model, "cpu")
    assert op_counts(model).get("com.microsoft.GroupQueryAttention") == 1
    np.testing.assert_allclose(run(model, feeds)[0], want, atol=1e-5)


@pytest.mark.parametrize("trans_b", [0, 1], ids=["conv1d", "transposed-gemm"])
def test_conv1d_gemm_becomes_matmul(trans_b):
    """GPT-2's Conv1D (TorchScript): Reshape -> Gemm -> Reshape(x.shape[:-1] + [N]) becomes
    MatMul + Add on the 3-D input; a transposed Gemm (a near miss) is left alone."""
    from specport.passes.cleanup import CleanupPass

    n = 6
    nodes = [
        helper.make_node("Reshape", ["x", "flat"], ["x2"]),
        helper.make_node("Gemm", ["x2", "w", "b"], ["g"], transB=trans_b),
        helper.make_node("Shape", ["x"], ["sh"]),
        helper.make_node("Gather", ["sh", "i0"], ["d0"], axis=0),
        helper.make_node("Gather", ["sh", "i1"], ["d1"], axis=0),
        helper.make_node("Unsqueeze", ["d0", "ax"], ["u0"]),
        helper.make_node("Unsqueeze", ["d1", "ax"], ["u1"]),
        helper.make_node("Concat", ["u0", "u1", "nn"], ["shape"], axis=0),
        helper.make_node("Reshape", ["g", "shape"], ["y"]),
    ]
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, D) if trans_b else (D, n))
    inits = [
        _c("flat", [-1, D], np.int64),
        _c("w", w),
        _c("b", rng.standard_normal(n)),
        _c("i0", 0, np.int64),
        _c("i1", 1, np.int64),
        _c("ax", [0], np.int64),
        _c("nn", [n], np.int64),
    ]
    model = _model(nodes, [_x()], [_x("y", ("B", "S", n))], inits)
    x = rng.standard_normal((2, 3, D)).astype(np.float32)
    want = run(model, {"x": x})[0]
    CleanupPass()(model)
    ops = op_counts(model)
    assert ("Gemm" in ops) == bool(trans_b)
    if not trans_b:
        assert ops == {"MatMul": 1, "Add": 1}
    np.testing.assert_allclose(run(model, {"x": x})[0], want, atol=1e-5)
