"""Rotary fusion (passes/fuse_rotary.py) on hand-built graphs: HF's rotate_half as TorchScript
writes it (positive), commuted with a scaled cos/sin (variant), and near misses."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from specport.custom_ops import attach_functions
from specport.custom_ops.testing import run
from specport.passes.base import op_counts
from specport.passes.fuse_rotary import FuseRotaryPass

H, DH = 2, 8


def _i(name, value):
    return numpy_helper.from_array(np.asarray(value, np.int64), name)


def _rotate_half(commuted=False, scaled=False, cos_input=False, split=DH // 2):
    """y = x * cos + rotate_half(x) * sin, cos/sin = Cos/Sin(Concat(f, f)) [B, S, Dh]."""
    nodes = [
        helper.make_node("Concat", ["f", "f"], ["emb"], axis=-1),
        helper.make_node("Cos", ["emb"], ["cos0"]),
        helper.make_node("Sin", ["emb"], ["sin0"]),
    ]
    if scaled:  # HF's attention_scaling (YaRN / longrope) multiplies both
        nodes += [
            helper.make_node("Mul", ["cos0", "k"], ["cos"]),
            helper.make_node("Mul", ["sin0", "k"], ["sin"]),
        ]
    else:
        nodes += [
            helper.make_node("Identity", ["cos0"], ["cos"]),
            helper.make_node("Identity", ["sin0"], ["sin"]),
        ]
    cos = "cos_in" if cos_input else "cos"
    nodes += [
        helper.make_node("Unsqueeze", [cos, "one"], ["c4"]),
        helper.make_node("Unsqueeze", ["sin", "one"], ["s4"]),
        helper.make_node("Slice", ["x", "zero", "half", "three"], ["x1"]),
        helper.make_node("Slice", ["x", "half", "end", "three"], ["x2"]),
        helper.make_node("Neg", ["x2"], ["nx2"]),
        helper.make_node("Concat", ["nx2", "x1"], ["rot"], axis=-1),
        helper.make_node("Mul", ["c4", "x"] if commuted else ["x", "c4"], ["a"]),
        helper.make_node("Mul", ["s4", "rot"] if commuted else ["rot", "s4"], ["b"]),
        helper.make_node("Add", ["b", "a"] if commuted else ["a", "b"], ["y"]),
    ]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", H, "S", DH]),
        helper.make_tensor_value_info("f", TensorProto.FLOAT, ["B", "S", DH // 2]),
    ]
    if cos_input:
        inputs.append(helper.make_tensor_value_info("cos_in", TensorProto.FLOAT, ["B", "S", DH]))
    inits = [
        _i("one", [1]),
        _i("zero", [0]),
        _i("half", [split]),
        _i("end", [2**63 - 1]),
        _i("three", [3]),
        numpy_helper.from_array(np.asarray(0.7, np.float32), "k"),
    ]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", H, "S", DH])
    graph = helper.make_graph(nodes, "g", inputs, [out], initializer=inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    proto.ir_version = 10
    return ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(proto))


def _feeds(model):
    rng = np.random.default_rng(0)
    feeds = {
        "x": rng.standard_normal((2, H, 3, DH), np.float32),
        "f": rng.standard_normal((2, 3, DH // 2), np.float32),
    }
    if "cos_in" in {v.name for v in model.graph.inputs}:
        feeds["cos_in"] = rng.standard_normal((2, 3, DH), np.float32)
    return feeds


@pytest.mark.parametrize("commuted,scaled", [(False, False), (True, True)], ids=["hf", "scaled"])
def test_rotate_half_fuses(commuted, scaled):
    model = _rotate_half(commuted, scaled)
    feeds = _feeds(model)
    want = run(model, feeds)[0]
    result = FuseRotaryPass()(model)
    assert result.report["matched"]["rotate_half_rotary"] == 1
    ops = op_counts(model)
    assert ops["specport.RotaryEmbedding"] == 1 and "Neg" not in ops
    attach_functions(model)
    np.testing.assert_allclose(run(model, feeds)[0], want, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs,reason",
    [
        ({"cos_input": True}, "halves are not provably equal"),  # any [B, S, Dh] tensor
        ({"split": 2}, "partial rotary"),  # rotate_half over the wrong split
    ],
)
def test_rotate_half_near_misses(kwargs, reason):
    model = _rotate_half(**kwargs)
    result = FuseRotaryPass()(model)
    assert not result.modified and "Neg" in op_counts(model)
    assert any(reason in r["reason"] for r in result.report["rejected"])
