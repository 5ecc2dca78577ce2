"""exporter.eagle_lengths: a fused draft graph of the earlier form (its attention's lengths
derived from the past's shape) gets the length inputs and computes what the new form does."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from specport.core.contract import EAGLE_LENGTH_INPUTS
from specport.exporter.eagle_graph import fused_draft_graph
from specport.exporter.eagle_head import EagleHead
from specport.exporter.eagle_lengths import lengths_as_inputs
from tests.fixtures import eagle_config


def _earlier_form(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph as fused_draft_graph wrote it before: seqlens_k and the total length computed
    from Shape(past_key)[2] + Shape(input_ids)[1]."""
    old = onnx.ModelProto()
    old.CopyFrom(model)
    g = old.graph
    for name in EAGLE_LENGTH_INPUTS:
        g.input.remove(next(i for i in g.input if i.name == name))

    def const(name: str, value: object, dtype: object) -> str:
        g.initializer.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def node(op: str, inputs: list[str], out: str, **attrs: object) -> onnx.NodeProto:
        return helper.make_node(op, inputs, [out], name=out, **attrs)

    chain = [
        node("Shape", ["past_key"], "past_shape"),
        node("Shape", ["input_ids"], "ids_shape"),
        node("Gather", ["past_shape", const("two", 2, np.int64)], "past_len"),
        node("Gather", ["ids_shape", const("one", 1, np.int64)], "new_len"),
        node("Add", ["past_len", "new_len"], "total_len"),
        node("Cast", ["total_len"], "total_len_i32", to=TensorProto.INT32),
        node("Sub", ["total_len_i32", const("one_i32", 1, np.int32)], "last_pos"),
        node(
            "Slice",
            ["ids_shape", const("zero_1d", [0], np.int64), const("one_1d", [1], np.int64)],
            "batch",
        ),
        node("Expand", ["last_pos", "batch"], "seqlens_k"),  # the name it had
    ]
    attention = next(n for n in g.node if n.op_type == "GroupQueryAttention")
    attention.input[5], attention.input[6] = "seqlens_k", "total_len_i32"
    at = list(g.node).index(attention)
    for i, n in enumerate(chain):
        g.node.insert(at + i, n)
    return old


def test_an_earlier_fused_graph_gets_the_length_inputs_and_the_same_outputs():
    import onnxruntime as ort

    torch.manual_seed(0)
    cfg = dataclasses.replace(eagle_config(), heads=2, kv_heads=1, head_dim=16)
    head = EagleHead(cfg, torch.randn(50, 32), torch.arange(0, 40, 2)).eval()
    new = fused_draft_graph(head, max_positions=32)
    assert not lengths_as_inputs(new)  # already the new form
    old = _earlier_form(new)
    assert lengths_as_inputs(old)
    assert {i.name for i in old.graph.input} == {i.name for i in new.graph.input}
    assert not {n.op_type for n in old.graph.node} & {"Shape", "Expand", "Slice"}
    assert len(old.graph.node) == len(new.graph.node)
    rng = np.random.default_rng(0)
    past, s = 5, 2
    feeds = {
        "input_ids": rng.integers(0, 50, (1, s)).astype(np.int64),
        "features": rng.standard_normal((1, s, 96)).astype(np.float32),
        "hidden_in": np.zeros((1, s, 32), np.float32),
        "past_key": rng.standard_normal((1, 1, past, 16)).astype(np.float32),
        "past_value": rng.standard_normal((1, 1, past, 16)).astype(np.float32),
        "seqlens_k": np.array([past + s - 1], np.int32),
        "total_sequence_length": np.array(past + s, np.int32),
    }
    runs = [
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, feeds
        )
        for m in (new, old)
    ]
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
