"""The decoder graph onnxruntime-genai runs, when the artifact's own graph takes inputs genai does not feed.

onnxruntime-genai 0.18 feeds a decoder `input_ids`, `attention_mask` [B, T] (left padding),
optionally `position_ids`, and the KV cache; it reads `logits` [B, S, V] (all positions; it picks
the last itself) and the presents. Its own GroupQueryAttention models derive GQA's lengths from
the mask inside the graph (builders/base.py: make_attention_mask_reformatting_for_gqa):

    seqlens_k             = Cast<int32>(ReduceSum(attention_mask, axis 1) - 1)
    total_sequence_length = Cast<int32>(Shape(attention_mask)[1])

specport's runtime feeds those two numbers directly (passes/shared_kv.py) because it knows them
without building a mask each step. Rather than slow that loop down, this module writes a second,
weightless graph, `model.genai.onnx`, that shares `model.onnx.data` and replaces the inputs genai
does not feed with the same values computed in graph:

    seqlens_k, total_sequence_length  <- attention_mask (as genai's own models do)
    logits_index [B, S]               <- every position 0..S-1 (genai wants all logits)
    tree_mask [B, S, S]               <- lower-triangular ones (plain causal decoding)

and drops outputs genai never reads (`next_token`, the MTP branch's drafts) with the nodes only
they need, so genai does not pay for them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from specport.core.contract import TREE_MASK

logger = logging.getLogger(__name__)

GENAI_MODEL_NAME = "model.genai.onnx"
SEQLENS, TOTAL, LOGITS_INDEX, NEXT_TOKEN = (
    "seqlens_k",
    "total_sequence_length",
    "logits_index",
    "next_token",
)
MTP_OUTPUTS = ("mtp_accepted", "mtp_bonus", "mtp_drafts")  # passes/mtp.py BRANCH_OUTPUTS
GENAI_FEEDS = ("input_ids", "attention_mask", "position_ids")  # besides the KV cache
DERIVED_INPUTS = (SEQLENS, TOTAL, LOGITS_INDEX, TREE_MASK)  # what the genai graph computes
DROPPED_OUTPUTS = (NEXT_TOKEN, *MTP_OUTPUTS)


def needs_genai_graph(input_names: list[str], output_names: list[str]) -> bool:
    """True when genai cannot run the artifact's graph itself but can run a derived one."""
    return any(n in DERIVED_INPUTS for n in input_names) or any(
        n in DROPPED_OUTPUTS for n in output_names
    )


class _Builder:
    """Appends int64 helper nodes under `/genai/` to the front of a graph."""

    def __init__(self, graph: ir.Graph) -> None:
        self.graph = graph
        self.nodes: list[ir.Node] = []

    def const(self, name: str, values: int | list[int]) -> ir.Value:
        array = np.asarray(values, dtype=np.int64)
        value = ir.Value(name=f"/genai/{name}", const_value=ir.tensor(array, name=f"/genai/{name}"))
        value.type = ir.TensorType(ir.DataType.INT64)
        value.shape = ir.Shape(list(array.shape))
        self.graph.register_initializer(value)
        return value

    def op(self, op_type: str, inputs: list[ir.Value], name: str, **attrs: Any) -> ir.Value:
        node = ir.node(op_type, inputs, attrs or None, name=f"/genai/{name}")
        node.outputs[0].name = f"/genai/{name}/output_0"
        self.nodes.append(node)
        return node.outputs[0]

    def finish(self) -> None:
        first = next(iter(self.graph), None)
        if first is None:
            self.graph.extend(self.nodes)
        else:
            self.graph.insert_before(first, self.nodes)


def _replace_input(graph: ir.Graph, name: str, value: ir.Value) -> None:
    old = next(v for v in graph.inputs if v.name == name)
    ir.convenience.replace_all_uses_with(old, value)
    graph.inputs.remove(old)
    if old in graph.outputs:  # an input passed straight through (never in our graphs)
        graph.outputs[graph.outputs.index(old)] = value
    value.name = name  # keep the name the nodes' readers (and debuggers) know


def _attention_mask(graph: ir.Graph) -> ir.Value:
    existing = next((v for v in graph.inputs if v.name == "attention_mask"), None)
    if existing is not None:
        return existing
    mask = ir.Value(
        name="attention_mask",
        type=ir.TensorType(ir.DataType.INT64),
        shape=ir.Shape(["batch_size", "total_sequence_length"]),
    )
    graph.inputs.insert(1, mask)  # after input_ids, like genai's own models
    return mask


def genai_graph(model_path: Path) -> ir.Model:
    """The genai decoder graph derived from `model_path` (weights stay external references).

    The returned model's initializers still point at the artifact's data file, so saving it
    beside `model_path` writes only the graph (kilobytes).
    """
    import onnx

    proto = onnx.load(str(model_path), load_external_data=False)
    model = ir.from_proto(proto)
    graph = model.graph
    names = {v.name for v in graph.inputs}
    b = _Builder(graph)
    input_ids = next(v for v in graph.inputs if v.name == "input_ids")
    ishape = b.op("Shape", [input_ids], "input_ids/Shape")
    batch = b.op("Gather", [ishape, b.const("0", 0)], "batch/Gather", axis=0)
    seq = b.op("Gather", [ishape, b.const("1", 1)], "sequence/Gather", axis=0)
    batch_1 = b.op("Unsqueeze", [batch, b.const("axes0", [0])], "batch/Unsqueeze")
    new: dict[str, ir.Value] = {}
    if SEQLENS in names or TOTAL in names:
        mask = _attention_mask(graph)
        summed = b.op("ReduceSum", [mask, b.const("axes1", [1])], "seqlens/ReduceSum", keepdims=0)
        minus = b.op("Sub", [summed, b.const("one", 1)], "seqlens/Sub")
        new[SEQLENS] = b.op("Cast", [minus], "seqlens/Cast", to=int(ir.DataType.INT32))
        mshape = b.op("Shape", [mask], "total/Shape")
        total = b.op("Gather", [mshape, b.const("1b", 1)], "total/Gather", axis=0)
        new[TOTAL] = b.op("Cast", [total], "total/Cast", to=int(ir.DataType.INT32))
    if LOGITS_INDEX in names:  # [1, S] broadcast to [B, S]: every position
        positions = b.op("Range", [b.const("zero", 0), seq, b.const("step", 1)], "index/Range")
        row = b.op("Unsqueeze", [positions, b.const("axes0b", [0])], "index/Unsqueeze")
        shape = b.op("Concat", [batch_1, b.const("one_1", [1])], "index/Shape", axis=0)
        new[LOGITS_INDEX] = b.op("Expand", [row, shape], "index/Expand")
    if TREE_MASK in names:  # causal: new token i sees new tokens 0..i
        seq_1 = b.op("Unsqueeze", [seq, b.const("axes0c", [0])], "tree/Unsqueeze")
        square = b.op("Concat", [seq_1, seq_1], "tree/Square", axis=0)
        one = ir.tensor(np.ones(1, dtype=np.int64))
        ones = b.op("ConstantOfShape", [square], "tree/Ones", value=one)
        causal = b.op("Trilu", [ones], "tree/Trilu", upper=0)
        full = b.op("Concat", [batch_1, seq_1, seq_1], "tree/Shape", axis=0)
        new[TREE_MASK] = b.op("Expand", [causal, full], "tree/Expand")
    b.finish()
    for name, value in new.items():
        _replace_input(graph, name, value)
    kept = [v for v in graph.outputs if v.name not in DROPPED_OUTPUTS]
    graph.outputs.clear()
    graph.outputs.extend(kept)
    from onnx_ir.passes.common import RemoveUnusedFunctionsPass, RemoveUnusedNodesPass

    RemoveUnusedNodesPass()(model)
    RemoveUnusedFunctionsPass()(model)
    model.producer_name = "specport"
    return model


def write_genai_graph(model_path: Path, out_path: Path) -> None:
    """Write the genai graph of `model_path` to `out_path` (same directory: shared weights)."""
    import onnx

    if out_path.parent.resolve() != model_path.parent.resolve():
        raise ValueError("the genai graph must sit beside the model it shares weights with")
    proto = ir.to_proto(genai_graph(model_path))
    onnx.save(proto, str(out_path))
