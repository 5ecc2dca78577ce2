"""Switch a cpu/cuda-lowered graph to the `shared` KV layout (one preallocated buffer per layer).

concat layout (default): past [B, Hkv, P, Dh] in, present [B, Hkv, P+S, Dh] out; the runtime
feeds `attention_mask` [B, P+S] (left padding) and the graph derives GQA's lengths from it.

shared layout (this pass): past and present are the same [B, Hkv, T, Dh] buffer (T = max
length), bound to both by IO binding so GroupQueryAttention writes the new KV in place. The
graph takes two new inputs and drops `attention_mask`:
    seqlens_k              int32 [B]  valid cache length of each row after this step, minus 1
    total_sequence_length  int32 []   max over rows of (valid length after this step)
Rows are ragged and right-aligned at 0 (no left padding in the cache); a batched prompt is
right-padded and row b's last logit is at position len_b - 1. The graph feeds the kernel
query_seqlens = min(S, seqlens_k + 1) per row (S = the step's token count): that is what the
kernel assumes without it, but with it the kernel also takes several new tokens on a past at
batch > 1 (every row of such a step adds S tokens).

With `rotary_length=N` the pass also folds the rotary embedding into the attention op: when
q and k reach GroupQueryAttention through RotaryEmbedding ops whose cos/sin depend only on
`position_ids`, it evaluates those cos/sin for positions 0..N-1 into `cos_cache`/`sin_cache`
[N, Dh/2] and sets do_rotary=1. Right-aligned-at-0 rows put token j of row b at position
seqlens-derived p_b + j, which is what the kernel computes, so `position_ids` drops out of the
graph (fewer ops per decode step: no RotaryEmbedding, no per-step Cos/Sin). With
`pack_qkv=True` the q/k/v projections become one MatMul feeding GQA's packed input.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from specport.passes.base import Pass

logger = logging.getLogger(__name__)

SEQLENS = "seqlens_k"
TOTAL = "total_sequence_length"


def _gqa_nodes(model: ir.Model) -> list[ir.Node]:
    return [
        n for n in model.graph if n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft"
    ]


class SharedKVPass(Pass):
    name = "shared_kv"

    def __init__(
        self,
        max_length: int | None = None,
        rotary_length: int | None = None,
        pack_qkv: bool = False,
    ) -> None:
        self.max_length = max_length
        self.rotary_length = rotary_length
        self.pack_qkv = pack_qkv

    def precondition(self, model: ir.Model) -> str | None:
        int8_kv = [
            v.name
            for v in model.graph.inputs
            if v.name and v.name.startswith("past_key_values.") and v.dtype == ir.DataType.INT8
        ]
        if int8_kv:
            return (
                "the KV cache is already int8 (concat QuantizeLinear/DequantizeLinear): apply "
                "the shared layout to the float artifact, then quantize --kv-cache int8 that"
            )
        if not _gqa_nodes(model):
            return (
                "no com.microsoft GroupQueryAttention in the main graph (lower for cpu/cuda first)"
            )
        return None

    def rewrite(self, model: ir.Model) -> tuple[bool, dict[str, Any]]:
        graph = model.graph
        names = {v.name for v in graph.inputs}
        if SEQLENS in names:
            return False, {"note": "already shared layout"}
        seqlens = ir.Value(
            name=SEQLENS, type=ir.TensorType(ir.DataType.INT32), shape=ir.Shape(["batch"])
        )
        total = ir.Value(name=TOTAL, type=ir.TensorType(ir.DataType.INT32), shape=ir.Shape([]))
        graph.inputs.extend([seqlens, total])
        length = self.max_length if self.max_length else "max_length"
        layers = 0
        for node in _gqa_nodes(model):
            node.replace_input_with(5, seqlens)
            node.replace_input_with(6, total)
            if len(node.inputs) > 10:
                node.replace_input_with(10, None)  # no padding bias: rows are ragged
            for idx in (3, 4):
                past = node.inputs[idx]
                if past is not None and past.shape is not None and past.shape.rank() == 4:
                    past.shape = ir.Shape([past.shape[0], past.shape[1], length, past.shape[3]])
            for out in node.outputs[1:3]:
                if out.shape is not None and out.shape.rank() == 4:
                    out.shape = ir.Shape([out.shape[0], out.shape[1], length, out.shape[3]])
            layers += 1
        folded = _fold_rotary(model, self.rotary_length) if self.rotary_length else 0
        reshapes = sum(_skip_round_trip_reshapes(node) for node in _gqa_nodes(model))
        packed = 0
        if self.pack_qkv:
            RemoveUnusedNodesPass()(model)  # the unfolded rotary still reads q and k
            packed = sum(_pack_qkv(node) for node in _gqa_nodes(model))
        _feed_query_seqlens(model, seqlens)
        RemoveUnusedNodesPass()(model)
        dropped = []
        for v in list(graph.inputs):
            if v.name in ("attention_mask", "position_ids") and not v.uses():
                graph.inputs.remove(v)
                dropped.append(v.name)
        return True, {
            "layers": layers,
            "new_inputs": [SEQLENS, TOTAL],
            "dropped_inputs": dropped,
            "max_length": self.max_length,
            "rotary_folded_layers": folded,
            "round_trip_reshapes_removed": reshapes,
            "packed_qkv_layers": packed,
        }


def _feed_query_seqlens(model: ir.Model, seqlens: ir.Value) -> None:
    """query_seqlens = min(S, seqlens_k + 1) [B] into every GroupQueryAttention (input 16).

    Computed once, before the first attention, from that node's final query (after rotary
    folding and q/k/v packing, so the Shape keeps no replaced projection alive). A right-padded
    prompt row (no past) gets its own length, a row with a past gets S.
    """
    nodes = _gqa_nodes(model)
    query = nodes[0].inputs[0]
    assert query is not None
    tape = ir.tape.Tape()
    s64 = tape.op("Shape", [query], {"start": 1, "end": 2})
    s32 = tape.op("Cast", [s64], {"to": ir.DataType.INT32})
    one = tape.op("Constant", [], {"value": ir.tensor(np.array(1, np.int32))})
    qlens = tape.op("Min", [tape.op("Add", [seqlens, one]), s32])
    qlens.name = "query_seqlens"
    qlens.dtype = ir.DataType.INT32
    model.graph.insert_before(nodes[0], tape.nodes)
    for node in nodes:
        if len(node.inputs) < 17:
            node.resize_inputs(17)
        node.replace_input_with(16, qlens)


def _projection(value: ir.Value | None, node: ir.Node) -> tuple[ir.Value, ir.Value] | None:
    """(input, 2-D constant weight) when `value` = MatMul(input, weight) read only by `node`."""
    mm = value.producer() if value is not None else None
    if mm is None or mm.op_type != "MatMul" or mm.domain not in ("", "ai.onnx"):
        return None
    assert value is not None
    if len(value.uses()) != 1 or any(u.node is not node for u in value.uses()):
        return None
    x, w = mm.inputs[0], mm.inputs[1]
    if x is None or w is None or w.const_value is None or len(w.const_value.shape) != 2:
        return None
    return x, w


def _pack_qkv(node: ir.Node) -> int:
    """q, k, v = three MatMuls of one input -> one MatMul into GQA's packed-QKV input.

    One [D, (H + 2Hkv) Dh] product per step instead of three launches (what onnxruntime-genai
    builds). The packed weight is lazy: concatenated only while the model is saved, so export
    holds no second copy of the attention weights.
    """
    parts = [_projection(node.inputs[i], node) for i in range(3)]
    if any(p is None for p in parts):
        return 0
    xs = {id(p[0]) for p in parts if p is not None}
    weights = [p[1] for p in parts if p is not None]
    dtypes = {w.const_value.dtype for w in weights if w.const_value is not None}
    rows = {w.const_value.shape.numpy()[0] for w in weights if w.const_value is not None}
    if len(xs) != 1 or len(dtypes) != 1 or len(rows) != 1:
        return 0
    tensors = [w.const_value for w in weights]
    cols = sum(t.shape.numpy()[1] for t in tensors if t is not None)
    name = f"{node.name or 'attention'}/qkv_proj.weight"

    def concat() -> ir.TensorProtocol:
        return ir.tensor(
            np.concatenate([t.numpy() for t in tensors if t is not None], axis=1), name=name
        )

    dtype = next(iter(dtypes))
    lazy = ir.LazyTensor(concat, dtype=dtype, shape=ir.Shape([next(iter(rows)), cols]), name=name)
    packed_w = ir.Value(name=name, const_value=lazy, shape=ir.Shape(lazy.shape))
    packed_w.type = ir.TensorType(dtype)
    graph = node.graph
    assert graph is not None
    graph.register_initializer(packed_w)
    x = parts[0][0] if parts[0] is not None else None
    mm = ir.node("MatMul", [x, packed_w], name=f"{node.name or 'attention'}/qkv_proj")
    mm.outputs[0].name = f"{name[: -len('.weight')]}_out"
    mm.outputs[0].dtype = dtype
    graph.insert_before(node, mm)
    node.replace_input_with(0, mm.outputs[0])
    node.replace_input_with(1, None)
    node.replace_input_with(2, None)
    return 1


def _same_dims(a: ir.Value | None, b: ir.Value | None, rank: int) -> bool:
    if a is None or b is None or a.shape is None or b.shape is None:
        return False
    if a.shape.rank() != rank or b.shape.rank() != rank:
        return False
    return all(x == y for x, y in zip(a.shape, b.shape))


def _reshape_source(value: ir.Value | None, hops: int = 2) -> ir.Value | None:
    """The value `hops` Reshapes upstream of `value` (None if the chain is anything else)."""
    for _ in range(hops):
        node = value.producer() if value is not None else None
        if node is None or node.op_type != "Reshape" or node.domain not in ("", "ai.onnx"):
            return None
        value = node.inputs[0]
    return value


def _skip_round_trip_reshapes(node: ir.Node) -> int:
    """[B, S, H*D] -> [B, S, H, D] -> [B, S, H*D] around the attention op: use the 3-D value.

    A Reshape keeps element order, so two in a row that end where they started (same rank-3
    [batch, sequence, hidden] dims as the query) are the identity; each costs a kernel launch
    per step, which shows at small batch.
    """
    removed = 0
    query = node.inputs[0]
    value = node.inputs[2]
    source = _reshape_source(value)
    kv_heads = node.attributes.get("kv_num_heads")
    head_dim = _head_dim(node)
    hidden = kv_heads.value * head_dim if kv_heads is not None and head_dim else None
    if not (
        source is not None
        and query is not None
        and _same_dims(source, source, 3)
        and _same_dims(query, query, 3)
        and source.shape is not None
        and query.shape is not None
        and source.shape[0] == query.shape[0]
        and source.shape[1] == query.shape[1]
        and source.shape[2] == hidden
    ):
        source = None
    if source is not None:
        node.replace_input_with(2, source)
        removed += 1
    out = node.outputs[0]
    for use in list(out.uses()):
        first = use.node
        if first.op_type != "Reshape" or first.domain not in ("", "ai.onnx"):
            continue
        for use2 in list(first.outputs[0].uses()):
            second = use2.node
            if second.op_type != "Reshape" or second.domain not in ("", "ai.onnx"):
                continue
            final = second.outputs[0]
            outputs = node.graph.outputs if node.graph is not None else []
            if _same_dims(final, query, 3) and not any(final is o for o in outputs):
                final.replace_all_uses_with(out)
                removed += 1
    return removed


def _rotary_of(value: ir.Value | None) -> ir.Node | None:
    node = value.producer() if value is not None else None
    if node is None or node.op_type != "RotaryEmbedding" or node.domain not in ("", "ai.onnx"):
        return None
    attrs = {k: a.value for k, a in node.attributes.items()}
    if attrs.get("interleaved", 0) or (len(node.inputs) > 3 and node.inputs[3] is not None):
        return None  # interleaved or position-indexed caches: leave as is
    return node


def _fold_rotary(model: ir.Model, length: int) -> int:
    """Move q/k rotary into GroupQueryAttention (do_rotary=1, cos/sin caches [length, Dh/2])."""
    plans = []
    for node in _gqa_nodes(model):
        rq, rk = _rotary_of(node.inputs[0]), _rotary_of(node.inputs[1])
        if rq is None or rk is None or node.inputs[2] is None:
            continue
        if rq.inputs[1] is not rk.inputs[1] or rq.inputs[2] is not rk.inputs[2]:
            continue
        plans.append((node, rq, rk))
    if not plans:
        return 0
    cos_sin = {
        (id(rq.inputs[1]), id(rq.inputs[2])): (rq.inputs[1], rq.inputs[2]) for _, rq, _ in plans
    }
    if len(cos_sin) != 1:
        logger.info("rotary not folded: %d distinct cos/sin sources", len(cos_sin))
        return 0
    cos_v, sin_v = next(iter(cos_sin.values()))
    if cos_v is None or sin_v is None or not cos_v.name or not sin_v.name:
        return 0
    caches = _evaluate_cos_sin(model, cos_v, sin_v, length)
    if caches is None:
        return 0
    cos, sin = caches
    head_dim = _head_dim(plans[0][0])
    if head_dim is None or cos.shape[-1] * 2 != head_dim:
        logger.info("rotary not folded: partial rotary (cos %s, head dim %s)", cos.shape, head_dim)
        return 0
    graph = model.graph
    cos_c = ir.Value(name="cos_cache", const_value=ir.tensor(cos, name="cos_cache"))
    sin_c = ir.Value(name="sin_cache", const_value=ir.tensor(sin, name="sin_cache"))
    for v in (cos_c, sin_c):
        v.shape, v.type = ir.Shape(list(cos.shape)), ir.TensorType(ir.DataType.FLOAT)
        graph.register_initializer(v)
    for node, rq, rk in plans:
        node.replace_input_with(0, rq.inputs[0])
        node.replace_input_with(1, rk.inputs[0])
        while len(node.inputs) < 9:  # inputs 7/8 are optional: pad with empty slots
            node.resize_inputs(len(node.inputs) + 1)
        node.replace_input_with(7, cos_c)
        node.replace_input_with(8, sin_c)
        node.attributes["do_rotary"] = ir.AttrInt64("do_rotary", 1)
        node.attributes["rotary_interleaved"] = ir.AttrInt64("rotary_interleaved", 0)
    return len(plans)


def _head_dim(node: ir.Node) -> int | None:
    past = node.inputs[3]
    if past is None or past.shape is None or past.shape.rank() != 4:
        return None
    d = past.shape[3]
    return d if isinstance(d, int) else None


def _named_tensor(name: str, value: ir.Value) -> Any:
    assert value.const_value is not None
    proto = ir.serde.serialize_tensor(value.const_value)
    proto.name = name  # the tensor's own name may differ from the value's
    return proto


def _evaluate_cos_sin(
    model: ir.Model, cos_v: ir.Value, sin_v: ir.Value, length: int
) -> tuple[Any, Any] | None:
    """cos/sin [length, R/2] for positions 0..length-1, if they depend only on position_ids."""
    import onnx
    import onnxruntime as ort

    nodes: list[ir.Node] = []
    seen: set[int] = set()
    inits: dict[str, ir.Value] = {}
    stack = [cos_v, sin_v]
    while stack:
        v = stack.pop()
        if v.const_value is not None:
            inits[v.name or ""] = v
            continue
        producer = v.producer()
        if producer is None:
            if v.name != "position_ids":
                logger.info("rotary not folded: cos/sin depend on input %s", v.name)
                return None
            continue
        if id(producer) in seen:
            continue
        seen.add(id(producer))
        nodes.append(producer)
        stack.extend(i for i in producer.inputs if i is not None)
    order = {id(n): i for i, n in enumerate(model.graph)}
    nodes.sort(key=lambda n: order.get(id(n), 0))
    graph = onnx.helper.make_graph(
        [ir.serde.serialize_node(n) for n in nodes],
        "rotary_caches",
        [onnx.helper.make_tensor_value_info("position_ids", onnx.TensorProto.INT64, [1, None])],
        [
            onnx.helper.make_tensor_value_info(cos_v.name or "cos", onnx.TensorProto.FLOAT, None),
            onnx.helper.make_tensor_value_info(sin_v.name or "sin", onnx.TensorProto.FLOAT, None),
        ],
        initializer=[_named_tensor(name, v) for name, v in inits.items()],
    )
    proto = onnx.helper.make_model(
        graph,
        opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in model.opset_imports.items()],
    )
    proto.ir_version = 10
    try:
        sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        pos = np.arange(length, dtype=np.int64)[None]
        cos, sin = sess.run(None, {"position_ids": pos})
    except Exception as e:  # noqa: BLE001 - any failure means: keep the unfolded graph
        logger.info("rotary not folded: evaluating cos/sin failed: %s", e)
        return None
    if cos.ndim != 3 or cos.shape[:2] != (1, length) or sin.shape != cos.shape:
        return None
    return np.ascontiguousarray(cos[0], np.float32), np.ascontiguousarray(sin[0], np.float32)
