"""Give a shared-layout graph a `tree_mask` input: token trees through the fused attention's bias.

Tree speculative decoding scores every node of a token tree in one run: node i sits at
position P + depth(i) and attends the cached past plus its own ancestors. The concat export
builds that mask in the traced attention (exporter/wrapper.py); the shared layout's
GroupQueryAttention builds its own causal mask instead, but onnxruntime's kernel also takes

    position_ids    int64 [B, S]        rotary positions (input 9, used with do_rotary=1)
    attention_bias  float [B, 1, S, T]  added to the scaled scores (input 10)

on top of the in-place past (batch 1 for several new tokens, as every multi-token shared
step). This pass adds the concat contract's inputs, `tree_mask` int64 [B, S, S] (1 = new
token i may attend new token j) and `position_ids` (when rotary was folded and the input
dropped), and derives the bias once per run for every layer:

    bias[b, 0, i, P + j] = dtype min  where j < i and tree_mask[b, i, j] == 0, else 0
    bias[b, 0, i, c < P] = 0                                   (P = T - S: the cached past)

Only the blocked pairs below the diagonal carry the bias; j > i is the kernel's causal mask
(a tree in topological order attends only earlier nodes). So a lower-triangular `tree_mask`
(what plain runs feed) gives an all-zero bias: plain decoding is exact whatever the rows'
lengths, and a branching tree is exact at batch 1, where the new tokens are the last S slots.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import onnx_ir as ir

from specport.core.contract import TREE_MASK
from specport.passes.base import Pass
from specport.passes.shared_kv import SEQLENS, TOTAL

logger = logging.getLogger(__name__)

POSITION_IDS = "position_ids"
_POS_SLOT, _BIAS_SLOT = 9, 10  # GroupQueryAttention's position_ids / attention_bias inputs


def _gqa_nodes(model: ir.Model) -> list[ir.Node]:
    return [
        n for n in model.graph if n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft"
    ]


class TreeBiasPass(Pass):
    name = "tree_bias"

    def precondition(self, model: ir.Model) -> str | None:
        names = {v.name for v in model.graph.inputs}
        if SEQLENS not in names or TOTAL not in names:
            return "not a shared-layout graph (run shared_kv first)"
        if not _gqa_nodes(model):
            return "no com.microsoft GroupQueryAttention in the main graph"
        taken = [
            n.name
            for n in _gqa_nodes(model)
            if len(n.inputs) > _BIAS_SLOT and n.inputs[_BIAS_SLOT] is not None
        ]
        if taken:
            return f"attention already takes a bias: {taken[:3]}"
        return None

    def rewrite(self, model: ir.Model) -> tuple[bool, dict[str, Any]]:
        graph = model.graph
        inputs = {v.name: v for v in graph.inputs}
        if TREE_MASK in inputs:
            return False, {"note": "already has a tree_mask input"}
        ids = inputs.get("input_ids")
        batch: int | str | ir.SymbolicDim = "batch"
        seq: int | str | ir.SymbolicDim = "sequence_length"
        if ids is not None and ids.shape is not None and ids.shape.rank() == 2:
            batch, seq = ids.shape[0], ids.shape[1]  # the same symbolic dims as input_ids
        tree = ir.Value(
            name=TREE_MASK, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([batch, seq, seq])
        )
        graph.inputs.append(tree)
        positions = inputs.get(POSITION_IDS)
        added_positions = positions is None
        if positions is None:
            positions = ir.Value(
                name=POSITION_IDS,
                type=ir.TensorType(ir.DataType.INT64),
                shape=ir.Shape([batch, seq]),
            )
            graph.inputs.append(positions)
        nodes = _gqa_nodes(model)
        query = nodes[0].outputs[0]
        dtype = query.dtype if query.dtype is not None else ir.DataType.FLOAT
        bias, new_nodes = _bias_nodes(tree, inputs[TOTAL], dtype)
        for node in reversed(new_nodes):
            graph.insert_before(nodes[0], node)
        rotary = 0
        for node in nodes:
            if len(node.inputs) <= _BIAS_SLOT:
                node.resize_inputs(_BIAS_SLOT + 1)
            node.replace_input_with(_BIAS_SLOT, bias)
            attr = node.attributes.get("do_rotary")
            if attr is not None and attr.value:
                node.replace_input_with(_POS_SLOT, positions)
                rotary += 1
        if not positions.uses():
            graph.inputs.remove(positions)  # rotary neither folded nor outside: no positions
            added_positions = False
        return True, {
            "layers": len(nodes),
            "new_inputs": [TREE_MASK, *([POSITION_IDS] if added_positions else [])],
            "rotary_positions_layers": rotary,
        }


def _bias_nodes(
    tree: ir.Value, total: ir.Value, dtype: ir.DataType
) -> tuple[ir.Value, list[ir.Node]]:
    """attention_bias [B, 1, S, T] from tree_mask [B, S, S] and total_sequence_length []."""
    nodes: list[ir.Node] = []

    def const(name: str, array: np.ndarray) -> ir.Value:
        value = ir.tensor(array, name=f"tree_bias/{name}")
        node = ir.node("Constant", [], {"value": value}, name=f"tree_bias/{name}")
        nodes.append(node)
        return node.outputs[0]

    def op(kind: str, args: list[ir.Value], name: str, **attrs: Any) -> ir.Value:
        node = ir.node(kind, args, attrs, name=f"tree_bias/{name}")
        node.outputs[0].name = f"tree_bias/{name}_out"
        nodes.append(node)
        return node.outputs[0]

    np_dtype = dtype.numpy()
    one = const("one", np.array(1, np.int64))
    blocked = op("Sub", [one, tree], "Blocked")  # 1 where node i may not see node j
    lower = op("Trilu", [blocked, const("k", np.array(-1, np.int64))], "Lower", upper=0)
    as_float = op("Cast", [lower], "Cast", to=dtype)
    scaled = op("Mul", [as_float, const("min", np.array(np.finfo(np_dtype).min, np_dtype))], "Mul")
    square = op("Unsqueeze", [scaled, const("axis1", np.array([1], np.int64))], "Unsqueeze")
    steps = op("Shape", [tree], "Steps", start=2, end=3)  # [S]
    total64 = op("Cast", [total], "Total", to=ir.DataType.INT64)
    total_1 = op("Reshape", [total64, const("shape1", np.array([1], np.int64))], "Total1")
    past = op("Sub", [total_1, steps], "Past")  # [T - S]
    pads = op(
        "Concat",
        [const("pre", np.zeros(3, np.int64)), past, const("post", np.zeros(4, np.int64))],
        "Pads",
        axis=0,
    )
    zero = const("zero", np.array(0, np_dtype))
    bias = op("Pad", [square, pads, zero], "Bias")  # past columns: 0
    bias.name = "tree_bias/attention_bias"
    return bias, nodes
