"""Decomposed attention -> Attention-23 (passes/fuse_sdpa.py) and its KV-cache follow-up in
fuse_attention, on hand-built graphs: positive, another exporter's spelling, near misses."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from specport.custom_ops.testing import run
from specport.passes.base import op_counts
from specport.passes.fuse_attention import FuseAttentionPass
from specport.passes.fuse_sdpa import fuse_sdpa

H, DH = 4, 8


def _c(name, value, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(value, dtype), name)


def _t(name, shape, dtype=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dtype, list(shape))


def _model(nodes, inputs, outputs, inits=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    proto.ir_version = 10
    return ir.serde.deserialize_model(proto)


def _optimum_style(scale_after_mask=False, axis=-1, scale_input=False):
    """Optimum / torch sdpa spelling: sqrt(scale) on Q and on K^T, additive bias, NaN guard."""
    c = "c_in" if scale_input else "c"
    scores = ["Mul", ["qk", c], ["qk_s"]] if scale_after_mask else None
    nodes = [
        helper.make_node("Mul", ["q", "c"], ["qs"]),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("Mul", ["kt", c], ["kts"]),
        helper.make_node("MatMul", ["qs", "kts"], ["qk"]),
    ]
    if scores:
        nodes += [
            helper.make_node("Add", ["qk", "bias"], ["qkb0"]),
            helper.make_node("Mul", ["qkb0", "c"], ["qkb"]),
        ]
    else:
        nodes.append(helper.make_node("Add", ["qk", "bias"], ["qkb"]))
    nodes += [
        helper.make_node("Softmax", ["qkb"], ["p"], axis=axis),
        helper.make_node("IsNaN", ["p"], ["nan"]),
        helper.make_node("Where", ["nan", "zero", "p"], ["pg"]),
        helper.make_node("MatMul", ["pg", "v"], ["y"]),
    ]
    inputs = [
        _t("q", ["B", H, "S", DH]),
        _t("k", ["B", H, "T", DH]),
        _t("v", ["B", H, "T", DH]),
        _t("bias", ["B", 1, "S", "T"]),
    ]
    if scale_input:
        inputs.append(_t("c_in", []))
    inits = [_c("c", DH**-0.25), _c("zero", 0.0)]
    return _model(nodes, inputs, [_t("y", ["B", H, "S", DH])], inits)


def _gpt2_eager_style():
    """onnxruntime gpt2-helper / HF eager spelling: K as [B, T, H, Dh] transposed to K^T with
    perm [0, 2, 3, 1], scale as a Div after the MatMul, a boolean causal mask via Where."""
    nodes = [
        helper.make_node("Transpose", ["k_bshd"], ["kt"], perm=[0, 2, 3, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["qk"]),
        helper.make_node("Div", ["qk", "d"], ["qk_s"]),
        helper.make_node("Where", ["keep", "qk_s", "fill"], ["qk_m"]),
        helper.make_node("Softmax", ["qk_m"], ["p"], axis=3),
        helper.make_node("MatMul", ["p", "v"], ["y"]),
    ]
    inputs = [
        _t("q", ["B", H, "S", DH]),
        _t("k_bshd", ["B", "T", H, DH]),
        _t("v", ["B", H, "T", DH]),
        _t("keep", [1, 1, "S", "T"], TensorProto.BOOL),
    ]
    inits = [_c("d", np.sqrt(DH)), _c("fill", np.finfo(np.float32).min)]
    return _model(nodes, inputs, [_t("y", ["B", H, "S", DH])], inits)


def _feeds(model, s=3, t=5, seed=0):
    rng = np.random.default_rng(seed)
    names = {v.name for v in model.graph.inputs}
    feeds = {
        "q": rng.standard_normal((2, H, s, DH), np.float32),
        "v": rng.standard_normal((2, H, t, DH), np.float32),
    }
    if "k" in names:
        feeds["k"] = rng.standard_normal((2, H, t, DH), np.float32)
    if "k_bshd" in names:
        feeds["k_bshd"] = rng.standard_normal((2, t, H, DH), np.float32)
    causal = np.arange(t)[None, :] <= np.arange(t - s, t)[:, None]
    if "bias" in names:
        feeds["bias"] = np.where(causal, 0.0, -np.inf).astype(np.float32)[None, None].repeat(2, 0)
    if "keep" in names:
        feeds["keep"] = causal[None, None]
    return feeds


@pytest.mark.parametrize("build", [_optimum_style, _gpt2_eager_style], ids=["optimum", "gpt2"])
def test_decomposed_attention_fuses(build):
    model = build()
    feeds = _feeds(model)
    want = run(model, feeds)[0]
    report = fuse_sdpa(model)
    assert len(report["fused"]) == 1 and not report["rejected"]
    assert report["fused"][0]["scale"] == pytest.approx(DH**-0.5, abs=1e-6)
    ops = op_counts(model)
    assert ops["Attention"] == 1 and "Softmax" not in ops and "MatMul" not in ops
    np.testing.assert_allclose(run(model, feeds)[0], want, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs,reason",
    [
        ({"axis": 2}, "Softmax over axis 2"),
        ({"scale_after_mask": True}, "scaled after the mask"),
        ({"scale_input": True}, "K^T is not a Transpose"),  # a run-time factor is not a scale
    ],
)
def test_near_misses_are_left_with_a_reason(kwargs, reason):
    model = _optimum_style(**kwargs)
    before = op_counts(model)
    report = fuse_sdpa(model)
    assert not report["fused"] and op_counts(model) == before
    assert reason in report["rejected"][0]["reason"]


def _cached_attention(mask_input="attention_mask"):
    """Attention-23 over Concat(past, new) whose mask is computed from `mask_input`."""
    nodes = [
        helper.make_node("Concat", ["past_key_values.0.key", "k"], ["present.0.key"], axis=2),
        helper.make_node("Concat", ["past_key_values.0.value", "v"], ["present.0.value"], axis=2),
        helper.make_node("Cast", [mask_input], ["mf"], to=TensorProto.FLOAT),
        helper.make_node("Sub", ["mf", "one"], ["neg"]),
        helper.make_node("Mul", ["neg", "big"], ["b2"]),
        helper.make_node("Unsqueeze", ["b2", "axes"], ["bias"]),
        helper.make_node(
            "Attention", ["q", "present.0.key", "present.0.value", "bias"], ["y"], is_causal=1
        ),
    ]
    past = ["B", 2, "P", DH]
    inputs = [
        _t("q", ["B", H, "S", DH]),
        _t("k", ["B", 2, "S", DH]),
        _t("v", ["B", 2, "S", DH]),
        _t("past_key_values.0.key", past),
        _t("past_key_values.0.value", past),
        _t(mask_input, ["B", "T"], TensorProto.INT64),
    ]
    if mask_input != "attention_mask":
        inputs.append(_t("attention_mask", ["B", "T"], TensorProto.INT64))
    inits = [_c("one", 1.0), _c("big", 1e9), _c("axes", [1, 2], np.int64)]
    outs = [_t("y", ["B", H, "S", DH]), _t("present.0.key", ["B", 2, "T", DH])]
    return _model(nodes, inputs, [*outs, _t("present.0.value", ["B", 2, "T", DH])], inits)


def test_cached_attention_becomes_group_query_attention():
    model = _cached_attention()
    result = FuseAttentionPass()(model)
    assert result.report["matched"] == 1
    assert op_counts(model).get("specport.GroupQueryAttention") == 1


def test_mask_from_another_input_is_not_fused():
    """The fused op derives causal + padding from attention_mask: a mask built from something
    else would silently change which keys are visible."""
    model = _cached_attention(mask_input="custom_bias")
    result = FuseAttentionPass()(model)
    assert result.report["matched"] == 0
    assert "not computed from the 'attention_mask'" in result.report["rejected"][0]["reason"]
