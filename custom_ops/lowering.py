"""Lower `specport` ops to a target's native ops.

Targets:
    neutral    keep specport ops; attach their function bodies (runs in any ORT).
    cpu, cuda  com.microsoft contrib ops (SkipSimplifiedLayerNormalization,
               GroupQueryAttention), ai.onnx RMSNormalization-23 and RotaryEmbedding-23.
               `rms_norm="contrib"` picks ORT's SimplifiedLayerNormalization instead (no
               measurable difference; it is registered in the ai.onnx domain, so
               `onnx.checker` rejects such a graph - hence not the default). SkipLayerNorm
               becomes Add + LayerNormalization on cpu (faster, see `_skip_layer_norm`) and
               com.microsoft SkipLayerNormalization on cuda (`skip_layer_norm` overrides).
    cann       inline the function bodies (standard ops only), then `cann.check_ops`.
    standard   ai.onnx ops only (opset 23: RMSNormalization, RotaryEmbedding; attention as
               MatMul/Softmax, or Attention-23 with `decompose=()`): runs in any onnxruntime
               provider and in OpenVINO (custom_ops/lowering_standard.py).
    qnn        the standard lowering with Attention-23 (QNN's HTP accepts it) and a mask value
               fp16 and uint16 activations can hold;
               exporter/static_graphs.py derives the static prefill/decode graphs from it.
    torch_npu  not a graph rewrite: see `torch_npu.kernel_table`.

Caveat (not verified on a GPU here): onnxruntime's CUDA GroupQueryAttention kernel is registered
for float16/bfloat16 only; a float32 graph lowered for `cuda` runs that node on the CPU EP.

Each lowering keeps value names of graph outputs (present.{i}.key stays present.{i}.key), so the
graph's I/O contract does not change.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import InlinePass, NameFixPass, RemoveUnusedOpsetsPass

from specport.core.errors import PassError
from specport.custom_ops._base import (
    DOMAIN,
    Builder,
    attach_functions,
    detach_functions,
    replace_specport_nodes,
)
from specport.custom_ops.cann import check_ops
from specport.custom_ops.lowering_standard import lower_standard

logger = logging.getLogger(__name__)

MS = "com.microsoft"
TARGETS = ("neutral", "cpu", "cuda", "cann", "standard", "qnn")
# ai.onnx-only targets: no specport or com.microsoft op survives their lowering
STANDARD_TARGETS = ("standard", "qnn")
# `standard` writes attention as MatMul/Softmax by default: OpenVINO 2026.4 reads Attention-23
# but fails on grouped heads ("Incompatible MatMul batch dimension"), and onnxruntime-openvino
# 1.24's front end refuses the op. `decompose=()` keeps the Attention-23 node (qnn does).
STANDARD_DECOMPOSE = ("GroupQueryAttention",)


def _const(tape: ir.tape.Tape, value: Any, dtype: Any = np.int64) -> ir.Value:
    return tape.op("Constant", [], {"value": ir.tensor(np.asarray(value, dtype=dtype))})


def _attr(node: ir.Node, name: str, default: Any) -> Any:
    a = node.attributes.get(name)
    return default if a is None else a.value


def _rms_norm(tape, node, opts):
    eps = _attr(node, "epsilon", 1e-6)
    x, scale = node.inputs
    if opts.get("rms_norm", "standard") == "standard":
        return [tape.op("RMSNormalization", [x, scale], {"epsilon": eps, "axis": -1})]
    attrs = {"epsilon": eps, "axis": -1, "stash_type": 1}
    # ORT registers this contrib kernel in the ai.onnx domain (historical accident).
    return [tape.op("SimplifiedLayerNormalization", [x, scale], attrs)]


def _skip_rms_norm(tape, node, opts):
    eps = _attr(node, "epsilon", 1e-6)
    outs = tape.op_multi_out(
        "SkipSimplifiedLayerNormalization",
        list(node.inputs),
        {"epsilon": eps},
        num_outputs=4,
        domain=MS,
    )
    return [outs[0], outs[3]]


def _skip_layer_norm(tape, node, opts):
    """Add + ai.onnx LayerNormalization on cpu (default), the contrib SkipLayerNormalization
    with `skip_layer_norm="contrib"` (the cuda default). Measured (ORT 1.32, CPU, fp32,
    1 thread, D=512, per norm): the contrib kernel takes 175 us at S=64 where Add +
    LayerNormalization take 33 us, and 4.2 against 2.3 us at S=1.
    """
    eps = _attr(node, "epsilon", 1e-5)
    default = "standard" if opts.get("target") == "cpu" else "contrib"
    if opts.get("skip_layer_norm", default) == "standard":
        x, skip, gamma, beta = node.inputs
        total = tape.op("Add", [x, skip])
        y = tape.op("LayerNormalization", [total, gamma, beta], {"epsilon": eps, "axis": -1})
        return [y, total]
    outs = tape.op_multi_out(
        "SkipLayerNormalization", list(node.inputs), {"epsilon": eps}, num_outputs=4, domain=MS
    )
    return [outs[0], outs[3]]


def _rotary(tape, node, opts):
    x, cos, sin = node.inputs
    half = cos.shape[-1] if cos.shape is not None and cos.shape.rank() else None
    head = x.shape[-1] if x.shape is not None and x.shape.rank() == 4 else None
    if not isinstance(half, int) or not isinstance(head, int):
        return None  # shapes unknown: keep the function body (still correct)
    attrs = {} if 2 * half == head else {"rotary_embedding_dim": 2 * half}
    return [tape.op("RotaryEmbedding", [x, cos, sin], attrs)]


def _gqa(tape, node, opts):
    """specport.GroupQueryAttention (BNSH) -> com.microsoft.GroupQueryAttention (BSD).

    The native node gets `query_seqlens` (S for every row, onnxruntime >= 1.32): without it,
    the CPU kernel refuses batch > 1 with several new tokens on top of a past ("batch_size must
    be 1 when sequence_length > 1 and past context is given"), which batched speculative
    verification does; with it, every shape runs on the fused kernel.
    """
    h = _attr(node, "num_heads", 0)
    hkv = _attr(node, "kv_num_heads", 0)
    if not h or not hkv:
        return None
    lengths = _gqa_lengths(tape, node)
    packed = [_to_bsd(tape, x) for x in node.inputs[:3]]
    out3, pk, pv = _gqa_native(tape, node, lengths, packed)
    return [_to_bnsh(tape, out3, h), pk, pv]


def _to_bsd(tape, x):
    """[B, N, S, D] -> [B, S, N*D]."""
    return tape.op(
        "Reshape", [tape.op("Transpose", [x], {"perm": [0, 2, 1, 3]}), _const(tape, [0, 0, -1])]
    )


def _to_bnsh(tape, x, heads: int):
    """[B, S, N*D] -> [B, N, S, D]."""
    x4 = tape.op("Reshape", [x, _const(tape, [0, 0, heads, -1])])
    return tape.op("Transpose", [x4], {"perm": [0, 2, 1, 3]})


def _gqa_lengths(tape, node):
    """seqlens_k = T-1 for every row, total_sequence_length = T (T = mask width) and
    query_seqlens = S = T - P for every row: the cache is contiguous [0, T) per row; left
    padding is masked through attention_bias [B, 1, S, T]. Shapes come from the mask and the
    past only (not Q), so RoPE can stay packed [B, S, H*Dh] and CSE shares them across layers.
    """
    past_k, mask = node.inputs[3], node.inputs[5]
    total64 = tape.op("Shape", [mask], {"start": 1, "end": 2})  # [1]
    batch = tape.op("Shape", [mask], {"start": 0, "end": 1})  # [1]
    total32 = tape.op("Cast", [total64], {"to": ir.DataType.INT32})
    total_scalar = tape.op("Squeeze", [total32])
    seqlens = tape.op("Expand", [tape.op("Sub", [total32, _const(tape, [1], np.int32)]), batch])
    real = tape.op("Equal", [mask, _const(tape, 1)])
    bias = tape.op(
        "Where", [real, _const(tape, 0.0, np.float32), _const(tape, -3.4e38, np.float32)]
    )
    bias = tape.op("Unsqueeze", [bias, _const(tape, [1, 2])])  # [B, 1, 1, T]
    # ORT wants dim 2 == S exactly (no broadcast), so expand per call.
    qlen = tape.op("Sub", [total64, tape.op("Shape", [past_k], {"start": 2, "end": 3})])
    bias_shape = tape.op("Concat", [batch, _const(tape, [1]), qlen, total64], {"axis": 0})
    bias = tape.op("Expand", [bias, bias_shape])  # [B, 1, S, T]
    qlen32 = tape.op("Cast", [qlen], {"to": ir.DataType.INT32})
    query_seqlens = tape.op("Expand", [qlen32, batch])  # [B]
    return seqlens, total_scalar, bias, query_seqlens


def _gqa_native(tape, node, lengths, packed):
    """com.microsoft.GroupQueryAttention on packed [B, S, N*D] tensors; output [B, S, H*Dv]."""
    past_k, past_v = node.inputs[3], node.inputs[4]
    seqlens, total_scalar, bias, query_seqlens = lengths
    q3, k3, v3 = packed
    scale = _attr(node, "scale", 0.0)
    window = _attr(node, "sliding_window", 0)
    attrs: dict[str, Any] = {
        "num_heads": _attr(node, "num_heads", 0),
        "kv_num_heads": _attr(node, "kv_num_heads", 0),
    }
    if scale:
        attrs["scale"] = float(scale)
    if window and window > 0:
        attrs["local_window_size"] = int(window)  # matches HF q-k < window (tested)
    softcap = _attr(node, "softcap", 0.0)
    if softcap:
        attrs["softcap"] = float(softcap)  # cap * tanh(scores / cap) before the mask (tested)
    outs = tape.op_multi_out(
        "GroupQueryAttention",
        [q3, k3, v3, past_k, past_v, seqlens, total_scalar, None, None, None, bias]
        + [None] * 5
        + [query_seqlens],
        attrs,
        num_outputs=3,
        domain=MS,
    )
    return list(outs)


NATIVE: dict[str, Builder] = {
    "RMSNorm": _rms_norm,
    "SkipRMSNorm": _skip_rms_norm,
    "SkipLayerNorm": _skip_layer_norm,
    "RotaryEmbedding": _rotary,
    "GroupQueryAttention": _gqa,
}


def _lower_native(model: ir.Model, opts: dict[str, Any]) -> dict[str, Any]:
    graph = model.graph
    report = replace_specport_nodes(
        graph,
        lambda node: (NATIVE.get(node.op_type), None),
        opts,
        "needed static shapes/attributes are unknown",
    )
    if any(n.domain == MS for n in graph.all_nodes()):
        model.opset_imports[MS] = 1
    return report


def unique_names(model: ir.Model) -> int:
    """Give every value in the main graph and its subgraphs a distinct name (ONNX SSA rule).

    onnx_ir's name fixer works per graph; subgraphs (If/Loop branches of an input model) can
    reuse counters like `val_3`, so walk all graphs and rename the later duplicates.
    """
    seen: set[str] = {v.name for v in model.graph.inputs if v.name}
    seen |= {name for name in model.graph.initializers}
    renamed = 0

    def walk(graph: ir.Graph) -> None:
        nonlocal renamed
        for node in graph:
            for out in node.outputs:
                if out.name in seen or not out.name:
                    base = out.name or "v"
                    i = 0
                    while f"{base}_{i}" in seen:
                        i += 1
                    if not out.is_graph_output() or graph is not model.graph:
                        out.name = f"{base}_{i}"
                        renamed += 1
                seen.add(out.name or "")
            for attr in node.attributes.values():
                if attr.type == ir.AttributeType.GRAPH:
                    walk(attr.value)

    walk(model.graph)
    return renamed


def lower_model(model: ir.Model, target: str, **opts: Any) -> dict[str, Any]:
    """Lower specport ops in `model` (in place) for `target`; returns a report dict."""
    if target not in TARGETS:
        raise PassError(f"unknown target {target!r}: choose one of {', '.join(TARGETS)}")
    report: dict[str, Any] = {"target": target}
    if target in ("cpu", "cuda"):
        report.update(_lower_native(model, {"target": target, **opts}))
    if target in STANDARD_TARGETS:
        defaults: dict[str, Any] = (
            {"mask_value": -1e4} if target == "qnn" else {"decompose": STANDARD_DECOMPOSE}
        )
        report.update(lower_standard(model, {**defaults, **opts}))
    if target in STANDARD_TARGETS or target == "cann":
        attach_functions(model)
        before = Counter(n.op_type for n in model.graph if n.domain == DOMAIN)
        InlinePass()(model)
        report["inlined"] = dict(before)
    if target == "cann":
        report["cann"] = check_ops(model)
    attach_functions(model)  # what is left (neutral, or kept) needs its body
    detach_functions(model)
    RemoveUnusedOpsetsPass()(model)
    NameFixPass()(model)
    unique_names(model)
    return report
