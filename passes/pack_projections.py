"""Pack sibling float projections (gate/up; q/k/v when GQA did not take them packed) into one MatMul.

MatMuls that read the same activation x [..., K] with constant float weights W_i [K, N_i]
become one MatMul over concat(W_i) [K, sum N_i] followed by a Split along the last axis.
A bias Add(MatMul, b_i) with a constant [N_i] bias is packed too (zeros for siblings without
one). Each output column is the same dot product as before, so the numbers do not change;
a decode step at batch 1 is launch-bound on CPU, and one larger GEMV costs less than two or
three small ones (onnxruntime-genai's builder makes the same choice for q/k/v).

q/k/v feeding GroupQueryAttention are normally packed already by `shared_kv(pack_qkv=True)`
into GQA's packed input (no Split); this pass then finds gate/up. Weight-only quantization
sees the packed MatMul as one site and emits one MatMulNBits, the same structure its own
sibling packing would have built. The packed weight is lazy (concatenated while saving), so
the pass holds no second copy of the weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from specport.passes.base import Pass

logger = logging.getLogger(__name__)

FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


@dataclass
class _Member:
    """One projection: MatMul(x, W) [+ Add(., bias)]; `out` is what its users read."""

    matmul: ir.Node
    weight: ir.Value  # initializer [K, N]
    n: int
    add: ir.Node | None
    bias: ir.Value | None  # initializer [N]
    out: ir.Value  # [..., N]


def _initializer(value: ir.Value | None) -> bool:
    return value is not None and value.const_value is not None and value.is_initializer()


def _bias(matmul: ir.Node, n: int) -> tuple[ir.Node | None, ir.Value | None]:
    """(Add, bias [N]) when the MatMul's only user adds a constant [N] bias, else (None, None)."""
    uses = list(matmul.outputs[0].uses())
    if len(uses) != 1 or matmul.outputs[0].is_graph_output():
        return None, None
    add = uses[0].node
    if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.inputs) != 2:
        return None, None
    other = add.inputs[1 - uses[0].idx]
    if not _initializer(other):
        return None, None
    assert other is not None and other.const_value is not None
    if list(other.const_value.shape.numpy()) != [n]:
        return None, None
    return add, other


def _member(node: ir.Node) -> tuple[tuple[int, ir.DataType, int], _Member] | None:
    """(group key, member) for MatMul(x, W) with W a 2-D float initializer only it reads."""
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
        return None
    x, w = node.inputs[0], node.inputs[1]
    if x is None or not _initializer(w):
        return None
    assert w is not None and w.const_value is not None
    shape = w.const_value.shape.numpy()
    dtype = w.const_value.dtype
    if len(shape) != 2 or dtype not in FLOATS or len(w.uses()) != 1 or w.is_graph_input():
        return None
    k, n = int(shape[0]), int(shape[1])
    add, bias = _bias(node, n)
    if bias is not None and bias.const_value is not None and bias.const_value.dtype != dtype:
        add, bias = None, None
    out = add.outputs[0] if add is not None else node.outputs[0]
    return (id(x), dtype, k), _Member(node, w, n, add, bias, out)


def _lazy_concat(name: str, dtype: ir.DataType, shape: list[int], parts: list[Any]) -> ir.Value:
    """An initializer whose data is concat(parts, last axis), computed only when saved."""

    def concat() -> ir.TensorProtocol:
        arrays = [p() if callable(p) else p.numpy() for p in parts]
        return ir.tensor(np.concatenate(arrays, axis=-1), name=name)

    lazy = ir.LazyTensor(concat, dtype=dtype, shape=ir.Shape(shape), name=name)
    value = ir.Value(name=name, const_value=lazy, shape=ir.Shape(shape))
    value.type = ir.TensorType(dtype)
    return value


def _unique(graph: ir.Graph, name: str) -> str:
    base, i = name, 0
    while name in graph.initializers:
        i += 1
        name = f"{base}_{i}"
    return name


def _pack(graph: ir.Graph, group: list[_Member]) -> None:
    """Replace `group` (same x, dtype and K) by MatMul(x, concat W) [+ Add] + Split."""
    first = group[0].matmul
    x = first.inputs[0]
    w0 = group[0].weight.const_value
    assert x is not None and w0 is not None
    dtype, k = w0.dtype, int(w0.shape.numpy()[0])
    total = sum(m.n for m in group)
    base = first.name or group[0].weight.name or "projection"
    w_name = _unique(graph, f"{base}.packed{len(group)}.weight")
    weight = _lazy_concat(w_name, dtype, [k, total], [m.weight.const_value for m in group])
    graph.register_initializer(weight)
    mm = ir.node("MatMul", [x, weight], name=f"{base}/PackedMatMul")
    mm.outputs[0].name = f"{base}/packed_out"
    mm.outputs[0].dtype = dtype
    nodes = [mm]
    packed = mm.outputs[0]
    if any(m.bias is not None for m in group):
        np_dtype = dtype.numpy()
        parts: list[Any] = [
            m.bias.const_value if m.bias is not None else (lambda n=m.n: np.zeros(n, np_dtype))
            for m in group
        ]
        b_name = _unique(graph, f"{base}.packed{len(group)}.bias")
        bias = _lazy_concat(b_name, dtype, [total], parts)
        graph.register_initializer(bias)
        add = ir.node("Add", [packed, bias], name=f"{base}/PackedAdd")
        add.outputs[0].name = f"{base}/packed_biased"
        add.outputs[0].dtype = dtype
        nodes.append(add)
        packed = add.outputs[0]
    sizes_name = _unique(graph, f"{base}.packed{len(group)}.split")
    sizes = ir.Value(
        name=sizes_name,
        const_value=ir.tensor(np.array([m.n for m in group], np.int64), name=sizes_name),
        shape=ir.Shape([len(group)]),
        type=ir.TensorType(ir.DataType.INT64),
    )
    graph.register_initializer(sizes)
    split = ir.node(
        "Split", [packed, sizes], {"axis": -1}, num_outputs=len(group), name=f"{base}/PackedSplit"
    )
    nodes.append(split)
    graph.insert_before(first, nodes)
    for m, out in zip(group, split.outputs):
        old = m.out
        out.shape, out.type, name = old.shape, old.type, old.name
        ir.convenience.replace_all_uses_with(old, out, replace_graph_outputs=True)
        old.name, out.name = f"{name}_unpacked", name
        for node in (m.add, m.matmul):
            if node is not None:
                graph.remove(node, safe=True)


class PackProjectionsPass(Pass):
    """Sibling MatMuls with constant float weights on one input -> one MatMul + Split."""

    name = "pack_projections"

    def __init__(self, min_group: int = 2) -> None:
        self.min_group = min_group

    def precondition(self, model: ir.Model) -> str | None:
        if not any(_member(n) for n in model.graph):
            return "no MatMul with a constant 2-D float weight initializer"
        return None

    def rewrite(self, model: ir.Model) -> tuple[bool, dict[str, Any]]:
        graph = model.graph
        groups: dict[tuple[int, ir.DataType, int], list[_Member]] = {}
        matched = 0
        for node in graph:
            found = _member(node)
            if found is not None:
                groups.setdefault(found[0], []).append(found[1])
                matched += 1
        packed = [g for g in groups.values() if len(g) >= self.min_group]
        for group in packed:
            _pack(graph, group)
        if packed:
            RemoveUnusedNodesPass()(model)
        sizes: dict[str, int] = {}
        for group in packed:
            key = "+".join(str(m.n) for m in group)
            sizes[key] = sizes.get(key, 0) + 1
        details = {
            "matched": matched,
            "changed": len(packed),
            "packed_matmuls": sum(len(g) for g in packed),
            "biased_groups": sum(any(m.bias is not None for m in g) for g in packed),
            "group_widths": sizes,
        }
        return bool(packed), details
