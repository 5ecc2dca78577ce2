"""Make decode cheap: only selected positions reach the LM head, and greedy argmax runs in graph.

A prefill step over S tokens needs one row of logits per sequence (its last real token), yet the
traced graph multiplies all S hidden states by the [D, V] LM head and ships [B, S, V] floats out.
This pass adds

    logits_index  int64 [B, K]   positions (0..S-1) of each row whose logits leave the graph
    next_token    int64 [B, K]   ArgMax over the vocabulary of those logits (greedy, in graph)

and gathers the final hidden states [B, S, D] -> [B, K, D] *before* the LM head MatMul, so the
head runs on K positions only; `logits` becomes [B, K, V]. The names match what the runtime binds
(`runtime/kv/iobinding.py`, manifest `extra.runtime`, see `RUNTIME_IO`).
"""

from __future__ import annotations

import logging
from typing import Any

import onnx_ir as ir

from specport.passes.base import Pass

logger = logging.getLogger(__name__)

LOGITS_INDEX = "logits_index"
NEXT_TOKEN = "next_token"
# Ops allowed between the LM head MatMul and the `logits` output (softcapping, scaling):
# all act per position, so gathering before the MatMul commutes with them.
_POINTWISE = {"Mul", "Div", "Add", "Sub", "Tanh", "Cast", "Identity"}

# What the runtime reads from manifest `extra.runtime` for a graph this pass (and shared_kv) made.
RUNTIME_IO: dict[str, Any] = {
    "padding": "right",
    "seqlens_input": "seqlens_k",
    "total_length_input": "total_sequence_length",
    "logits_index_input": LOGITS_INDEX,
    "next_token_output": NEXT_TOKEN,
}


def _lm_head(model: ir.Model) -> tuple[ir.Value, ir.Node] | None:
    """(logits output, the MatMul producing it through pointwise ops), or None."""
    logits = next((v for v in model.graph.outputs if v.name == "logits"), None)
    if logits is None:
        return None
    node = logits.producer()
    while node is not None and node.op_type in _POINTWISE and node.domain in ("", "ai.onnx"):
        # follow the input that carries the [B, S, V] activations (not a constant scale)
        node = next(
            (
                i.producer()
                for i in node.inputs
                if i is not None and i.producer() is not None and i.const_value is None
            ),
            None,
        )
    if node is None or node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
        return None
    return logits, node


def _const_i64(graph: ir.Graph, name: str, values: list[int]) -> ir.Value:
    import numpy as np

    value = ir.Value(
        name=name, const_value=ir.tensor(np.asarray(values, dtype=np.int64), name=name)
    )
    value.shape = ir.Shape([len(values)])
    value.type = ir.TensorType(ir.DataType.INT64)
    graph.register_initializer(value)
    return value


class SelectLogitsPass(Pass):
    name = "select_logits"

    def precondition(self, model: ir.Model) -> str | None:
        if any(v.name == LOGITS_INDEX for v in model.graph.inputs):
            return None  # rewrite reports "already"
        if _lm_head(model) is None:
            return "no `logits` output produced by an LM head MatMul (through pointwise ops)"
        return None

    def rewrite(self, model: ir.Model) -> tuple[bool, dict[str, Any]]:
        graph = model.graph
        if any(v.name == LOGITS_INDEX for v in graph.inputs):
            return False, {"note": "already selects logits"}
        found = _lm_head(model)
        assert found is not None  # precondition
        logits, matmul = found
        hidden = matmul.inputs[0]
        assert hidden is not None
        index = ir.Value(
            name=LOGITS_INDEX,
            type=ir.TensorType(ir.DataType.INT64),
            shape=ir.Shape(["batch", "kept"]),
        )
        graph.inputs.append(index)
        axes = _const_i64(graph, "select_logits/axes", [-1])
        unsq = ir.node("Unsqueeze", [index, axes], name="select_logits/unsqueeze")
        # [B, S, D] gathered by [B, K, 1] with one batch dim -> [B, K, D]
        gather = ir.node(
            "GatherND", [hidden, unsq.outputs[0]], {"batch_dims": 1}, name="select_logits/gather"
        )
        gather.outputs[0].name = "select_logits/hidden_kept"
        graph.insert_before(matmul, [unsq, gather])
        matmul.replace_input_with(0, gather.outputs[0])
        vocab = logits.shape[-1] if logits.shape is not None and logits.shape.rank() == 3 else None
        logits.shape = ir.Shape(["batch", "kept", vocab if vocab is not None else "vocab"])
        argmax = ir.node(
            "ArgMax", [logits], {"axis": -1, "keepdims": 0}, name="select_logits/argmax"
        )
        out = argmax.outputs[0]
        out.name = NEXT_TOKEN
        out.type = ir.TensorType(ir.DataType.INT64)
        out.shape = ir.Shape(["batch", "kept"])
        graph.append(argmax)
        graph.outputs.append(out)  # after the presents: outputs[1:1+2L] stay the KV
        return True, {"new_inputs": [LOGITS_INDEX], "new_outputs": [NEXT_TOKEN]}
