"""Lower `specport` ops to `ai.onnx` ops only: the `standard` and `qnn` targets.

    RMSNorm            -> RMSNormalization-23
    SkipRMSNorm        -> Add + RMSNormalization-23          (outputs: normed, sum)
    SkipLayerNorm      -> Add + LayerNormalization
    RotaryEmbedding    -> RotaryEmbedding-23                 (4-D input, cos/sin [B, S, R/2])
    GroupQueryAttention-> Attention-23 with an explicit float mask [B, 1, S, T] (qnn), or the
                          same attention from MatMul/Softmax (`standard`'s default, see
                          custom_ops/lowering.py: OpenVINO cannot run grouped Attention-23)

Why an explicit mask and not `is_causal`: Attention-23 aligns its causal triangle to the top
left, which is wrong as soon as there is a past (query i sits at slot P+i). The mask below is
the custom op's own rule (bottom-right causal, sliding window, left padding from
`attention_mask`), built once per window size and shared by every layer.

Why past/present (`kv="concat"`) and not opset-24 `TensorScatter`: the concat contract is the
one every specport runtime path already drives, and onnxruntime's CPU and OpenVINO providers
run Attention-23's past inputs; an in-place TensorScatter cache would need a new KV layout in
the runtime for no gain on the providers this target is for (their KV copies are not the
bottleneck at the sizes they run). The `qnn` target starts from this graph too:
exporter/static_graphs.py fixes its shapes and turns each Attention's past/present into a
Concat and new-only outputs for the prefill and decode graphs.

The mask value is `mask_value` (finite, so a fully masked row - a left-pad query - gives a
uniform softmax, not NaN): float32's lowest for `standard`; -1e4 for `qnn`, which runs fp16 on
the NPU (float32's lowest is -inf there) and whose uint16 activation quantizer needs a range that
keeps the scores' resolution.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from specport.custom_ops._base import Builder, replace_specport_nodes

FLOAT_LOWEST = -3.4028234663852886e38


def _const(tape: ir.tape.Tape, value: Any, dtype: Any = np.int64) -> ir.Value:
    return tape.op("Constant", [], {"value": ir.tensor(np.asarray(value, dtype=dtype))})


def _attr(node: ir.Node, name: str, default: Any) -> Any:
    a = node.attributes.get(name)
    return default if a is None else a.value


def rms_norm(tape: ir.tape.Tape, node: ir.Node, opts: dict[str, Any]) -> list[ir.Value]:
    x, scale = node.inputs
    eps = _attr(node, "epsilon", 1e-6)
    return [tape.op("RMSNormalization", [x, scale], {"epsilon": eps, "axis": -1})]


def skip_rms_norm(tape: ir.tape.Tape, node: ir.Node, opts: dict[str, Any]) -> list[ir.Value]:
    x, skip, gamma, *bias = node.inputs
    total = tape.op("Add", [x, skip])
    if bias and bias[0] is not None:
        total = tape.op("Add", [total, bias[0]])
    eps = _attr(node, "epsilon", 1e-6)
    y = tape.op("RMSNormalization", [total, gamma], {"epsilon": eps, "axis": -1})
    return [y, total]


def skip_layer_norm(tape: ir.tape.Tape, node: ir.Node, opts: dict[str, Any]) -> list[ir.Value]:
    x, skip, gamma, beta, *bias = node.inputs
    total = tape.op("Add", [x, skip])
    if bias and bias[0] is not None:
        total = tape.op("Add", [total, bias[0]])
    eps = _attr(node, "epsilon", 1e-5)
    y = tape.op("LayerNormalization", [total, gamma, beta], {"epsilon": eps, "axis": -1})
    return [y, total]


def rotary(tape: ir.tape.Tape, node: ir.Node, opts: dict[str, Any]) -> list[ir.Value] | None:
    x, cos, sin = node.inputs
    if x is None or cos is None:
        return None
    half = cos.shape[-1] if cos.shape is not None and cos.shape.rank() else None
    head = x.shape[-1] if x.shape is not None and x.shape.rank() == 4 else None
    if not isinstance(half, int) or not isinstance(head, int):
        return None  # shapes unknown: the function body is inlined instead (still standard)
    attrs = {} if 2 * half == head else {"rotary_embedding_dim": 2 * half}
    return [tape.op("RotaryEmbedding", [x, cos, sin], attrs)]


def _dim(tape: ir.tape.Tape, x: ir.Value, axis: int) -> ir.Value:
    """Shape(x)[axis] as a 1-D tensor (Gather, not Shape's start/end: OpenVINO's partitioner
    handles the plain form)."""
    return tape.op("Gather", [tape.op("Shape", [x]), _const(tape, [axis])], {"axis": 0})


def attention_bias(
    tape: ir.tape.Tape, query: ir.Value, mask: ir.Value, window: int, value: float
) -> ir.Value:
    """Float bias [B, 1, S, T]: 0 where query i (slot T-S+i) may see key j, `value` elsewhere."""
    qshape = _dim(tape, query, 2)  # [1] = S
    total = _dim(tape, mask, 1)  # [1] = T
    t0 = tape.op("Squeeze", [total])
    s0 = tape.op("Squeeze", [qshape])
    one = _const(tape, 1)
    qpos = tape.op("Unsqueeze", [tape.op("Range", [tape.op("Sub", [t0, s0]), t0, one]), one])
    kpos = tape.op("Unsqueeze", [tape.op("Range", [_const(tape, 0), t0, one]), _const(tape, 0)])
    dist = tape.op("Sub", [qpos, kpos])  # [S, T]
    allowed = tape.op("GreaterOrEqual", [dist, _const(tape, 0)])
    if window and window > 0:
        allowed = tape.op("And", [allowed, tape.op("Less", [dist, _const(tape, window)])])
    real = tape.op("Equal", [mask, tape.op("CastLike", [one, mask])])
    real = tape.op("Unsqueeze", [real, _const(tape, [1, 2])])  # [B, 1, 1, T]
    allowed = tape.op("And", [allowed, real])  # [B, 1, S, T]
    zero = _const(tape, 0.0, np.float32)
    neg = _const(tape, value, np.float32)
    bias = tape.op("Where", [allowed, zero, neg])
    return tape.op("CastLike", [bias, query])


def attention(tape: ir.tape.Tape, node: ir.Node, opts: dict[str, Any]) -> list[ir.Value]:
    """specport.GroupQueryAttention (BNSH) -> ai.onnx Attention-23 (4-D, GQA by head counts)."""
    q, k, v, past_k, past_v, mask = node.inputs[:6]
    assert q is not None and mask is not None  # the custom op's schema requires both
    bias = _shared_bias(tape, node, opts, q, mask)
    attrs: dict[str, Any] = {}
    scale = _attr(node, "scale", 0.0)
    if scale:
        attrs["scale"] = float(scale)
    softcap = _attr(node, "softcap", 0.0)
    if softcap:
        attrs["softcap"] = float(softcap)
    outs = tape.op_multi_out("Attention", [q, k, v, bias, past_k, past_v], attrs, num_outputs=3)
    return [outs[0], outs[1], outs[2]]


def attention_decomposed(
    tape: ir.tape.Tape, node: ir.Node, opts: dict[str, Any]
) -> list[ir.Value] | None:
    """The same attention from MatMul/Softmax, for runtimes without Attention-23 (OpenVINO's
    ONNX front end refuses it). Grouped heads without repeating K/V: Q [B, H, S, Dh] is read
    as [B, Hkv, g*S, Dh] (query heads of one KV head are contiguous), and the scores as
    [B, Hkv, g, S, T] when the shared bias [B, 1, 1, S, T] is added."""
    q, k, v, past_k, past_v, mask = node.inputs[:6]
    h, hkv = int(_attr(node, "num_heads", 0)), int(_attr(node, "kv_num_heads", 0))
    dh = q.shape[-1] if q is not None and q.shape is not None and q.shape.rank() == 4 else None
    dv = v.shape[-1] if v is not None and v.shape is not None and v.shape.rank() == 4 else None
    if not h or not hkv or not isinstance(dh, int) or not isinstance(dv, int) or mask is None:
        return None  # the function body (also standard ops) is inlined instead
    assert q is not None
    g = h // hkv
    bias = _shared_bias(tape, node, opts, q, mask)
    present_k = tape.op("Concat", [past_k, k], {"axis": 2})
    present_v = tape.op("Concat", [past_v, v], {"axis": 2})
    q4 = tape.op("Reshape", [q, _const(tape, [0, hkv, -1, dh])])  # [B, Hkv, g*S, Dh]
    scores = tape.op("MatMul", [q4, tape.op("Transpose", [present_k], {"perm": [0, 1, 3, 2]})])
    scale = _attr(node, "scale", 0.0) or 1.0 / float(np.sqrt(dh))
    scores = tape.op("Mul", [scores, tape.op("CastLike", [_const(tape, scale, np.float32), q])])
    softcap = _attr(node, "softcap", 0.0)
    if softcap:
        cap = tape.op("CastLike", [_const(tape, softcap, np.float32), q])
        scores = tape.op("Mul", [tape.op("Tanh", [tape.op("Div", [scores, cap])]), cap])
    total = _dim(tape, scores, 3)  # [T]
    shape5 = tape.op("Concat", [_const(tape, [0, hkv, g, -1]), total], {"axis": 0})
    scores5 = tape.op("Reshape", [scores, shape5])  # [B, Hkv, g, S, T]
    scores5 = tape.op("Add", [scores5, tape.op("Unsqueeze", [bias, _const(tape, [1])])])
    probs5 = tape.op("Softmax", [scores5], {"axis": -1})
    shape4 = tape.op("Concat", [_const(tape, [0, hkv, -1]), total], {"axis": 0})
    probs = tape.op("Reshape", [probs5, shape4])  # [B, Hkv, g*S, T]
    out = tape.op("MatMul", [probs, present_v])  # [B, Hkv, g*S, Dv]
    y = tape.op("Reshape", [out, _const(tape, [0, h, -1, dv])])
    return [y, present_k, present_v]


def _shared_bias(
    tape: ir.tape.Tape, node: ir.Node, opts: dict[str, Any], q: ir.Value, mask: ir.Value
) -> ir.Value:
    window = int(_attr(node, "sliding_window", 0) or 0)
    cache: dict[Any, ir.Value] = opts.setdefault("_bias", {})
    key = (id(mask), window)
    if key not in cache:  # one bias per window size, shared by every layer
        value = float(opts.get("mask_value", FLOAT_LOWEST))
        cache[key] = attention_bias(tape, q, mask, window, value)
    return cache[key]


BUILDERS = {
    "RMSNorm": rms_norm,
    "SkipRMSNorm": skip_rms_norm,
    "SkipLayerNorm": skip_layer_norm,
    "RotaryEmbedding": rotary,
    "GroupQueryAttention": attention,
}


def lower_standard(model: ir.Model, opts: dict[str, Any]) -> dict[str, Any]:
    """Replace specport ops by ai.onnx ops in place; returns counts (what stays is inlined)."""
    decompose = opts.get("decompose", ())

    def builder_for(node: ir.Node) -> tuple[Builder | None, str | None]:
        if node.op_type not in decompose:
            return BUILDERS.get(node.op_type), None
        if node.op_type == "GroupQueryAttention":
            return attention_decomposed, None
        return None, "decomposed on request: function body inlined"

    return replace_specport_nodes(
        model.graph, builder_for, dict(opts), "static shapes unknown: function body inlined"
    )
