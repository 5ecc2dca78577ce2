"""Switch a cpu/cuda-lowered graph to the `shared` KV layout (one preallocated buffer per layer).

concat layout (default): past [B, Hkv, P, Dh] in, present [B, Hkv, P+S, Dh] out; the runtime
feeds `attention_mask` [B, P+S] (left padding) and the graph derives GQA's lengths from it.

shared layout (this pass): past and present are the same [B, Hkv, T, Dh] buffer (T = max
length), bound to both by IO binding so GroupQueryAttention writes the new KV in place. The
graph takes two new inputs and drops `attention_mask`:
    seqlens_k              int32 [B]  valid cache length of each row after this step, minus 1
    total_sequence_length  int32 []   max over rows of (valid length after this step)
Rows are ragged and right-aligned at 0 (no left padding in the cache); a batched prompt is
right-padded and row b's last logit is at position len_b - 1. ORT's kernel does not take
several new tokens on a past with batch > 1, so multi-token steps on a past need batch 1.
"""

from __future__ import annotations

import logging
from typing import Any

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

    def __init__(self, max_length: int | None = None) -> None:
        self.max_length = max_length

    def precondition(self, model: ir.Model) -> str | None:
        if not _gqa_nodes(model):
            if any(n.op_type == "If" for n in model.graph):
                return "GroupQueryAttention sits in an If fallback: lower with gqa_fallback='none'"
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
        RemoveUnusedNodesPass()(model)
        dropped = []
        for v in list(graph.inputs):
            if v.name == "attention_mask" and not v.uses():
                graph.inputs.remove(v)
                dropped.append(v.name)
        return True, {
            "layers": layers,
            "new_inputs": [SEQLENS, TOTAL],
            "dropped_inputs": dropped,
            "max_length": self.max_length,
        }
