"""Static prefill and decode graphs for NPUs (the `qnn` target), sharing one weights file.

NPU compilers (Qualcomm's HtpPrepare, like OpenVINO-NPU and VitisAI) want every shape fixed.
From the artifact's `standard`-lowered graph (model.onnx, dynamic, verified against PyTorch)
this module derives two graphs of batch 1:

    prefill.onnx   S = chunk new tokens      decode.onnx   S = 1 new token
    inputs   input_ids [1, S], position_ids [1, S], attention_mask [1, M + S],
             past_key_values.{i}.key/value [1, Hkv, M, Dh]          (M = context length)
    outputs  logits [1, S, V], present.{i}.key/value [1, Hkv, S, Dh]  (the new slots only)

The host keeps one past buffer of M slots per layer; slot p holds position p, and
attention_mask's first M entries say which slots are filled, its last S which new tokens are
real (a short last prefill chunk is padded). Attention sees Concat(past, new) under the
bottom-right causal mask of custom_ops/lowering_standard.py, now folded to constants. Returning
only the new slots keeps the NPU from copying its whole cache out at every step.

Rotary cos/sin, computed in the dynamic graph from position ids (Cos of position * inv_freq:
at position 4000, fp16 - what the NPU runs float graphs in - has a step of 2 radians), become
two tables of M rows, evaluated once in float32 here, and a Gather.

Weight sharing: the graphs are written beside model.onnx with `onnx_ir.save` and no external
data argument, so every weight stays a reference into model.onnx.data (one file on disk, read
by all three; protobuf's 2 GB limit applies to none of them). Constants the folding creates
(masks, tables) are small and live in each graph.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from specport.core.errors import ExportError
from specport.exporter.qnn_context import compile_contexts

logger = logging.getLogger(__name__)

DEFAULT_CONTEXT = 1024
DEFAULT_CHUNK = 64
GRAPHS = {"prefill": "prefill.onnx", "decode": "decode.onnx"}
# ops that must not survive: a static graph computes no shape at run time
DYNAMIC_OPS = ("Shape", "Range", "Size", "ConstantOfShape", "NonZero")


@dataclass(frozen=True)
class StaticPlan:
    context: int  # M: past slots (the longest sequence the artifact runs)
    chunk: int  # S of the prefill graph

    def describe(self) -> dict[str, Any]:
        return {
            "context_length": self.context,
            "prefill_chunk": self.chunk,
            "past_length": self.context,
            "graphs": dict(GRAPHS),
        }


def plan(context: int | None, chunk: int | None, model_context: int) -> StaticPlan:
    """Check and default the static sizes (context: min(model's, 1024); chunk: 64)."""
    ctx = context or min(model_context or DEFAULT_CONTEXT, DEFAULT_CONTEXT)
    if model_context and ctx > model_context:
        raise ExportError(
            f"--context-length {ctx} is over the model's context ({model_context}); choose "
            f"{model_context} or less."
        )
    size = chunk or min(DEFAULT_CHUNK, ctx)
    if size > ctx or size < 1:
        raise ExportError(f"--prefill-chunk {size} must be between 1 and the context ({ctx}).")
    return StaticPlan(ctx, size)


def write_static_graphs(directory: Path, model_file: str, static: StaticPlan) -> dict[str, Any]:
    """Write prefill.onnx and decode.onnx beside `model_file` (weights shared); return a report."""
    report: dict[str, Any] = {}
    for name, seq in (("prefill", static.chunk), ("decode", 1)):
        model = ir.load(directory / model_file)
        report[name] = specialize(model, seq, static.context)
        ir.save(model, directory / GRAPHS[name])
    return report


def specialize(model: ir.Model, seq: int, past: int) -> dict[str, Any]:
    """Fix `model`'s shapes to batch 1, `seq` new tokens and `past` slots (in place)."""
    graph = model.graph
    inputs = {v.name: v for v in graph.inputs}
    for name in ("input_ids", "attention_mask"):
        if name not in inputs:
            raise ExportError(f"static graphs need a '{name}' input; this graph has none.")
    _fix_shapes(graph, seq, past)
    tables = _rotary_tables(model, past, seq)
    kv = _new_only_kv(graph)
    _fold(model)
    left = sorted({n.op_type for n in graph.all_nodes() if n.op_type in DYNAMIC_OPS})
    if left:
        raise ExportError(
            f"the static graph still computes shapes at run time ({', '.join(left)}): an NPU "
            "compiler refuses it. This is a bug in specport's static lowering."
        )
    return {"seq": seq, "past": past, "rotary_tables": tables, "attention_kv_new_only": kv}


def _fix_shapes(graph: ir.Graph, seq: int, past: int) -> None:
    for value in graph.inputs:
        name = value.name or ""
        if name in ("input_ids", "position_ids"):
            value.shape = ir.Shape([1, seq])
        elif name == "attention_mask":
            value.shape = ir.Shape([1, past + seq])
        elif name.startswith("past_key_values."):
            old = value.shape
            if old is None or old.rank() != 4 or not all(isinstance(d, int) for d in old[1::2]):
                raise ExportError(f"past input {name} has no [B, Hkv, P, Dh] shape: {old}")
            value.shape = ir.Shape([1, old[1], past, old[3]])
    for value in graph.outputs:
        value.shape = None  # inferred again from the fixed inputs
    for node in graph.all_nodes():
        for out in node.outputs:
            if not out.is_graph_output():
                out.shape = None


def _new_only_kv(graph: ir.Graph) -> int:
    """Attention(q, k, v, bias, past_k, past_v) -> (y, present_k, present_v) becomes
    Attention(q, Concat(past_k, k), Concat(past_v, v), bias) -> y, with k and v (the new slots)
    as the graph's present outputs."""
    count = 0
    for node in list(graph):
        if node.op_type != "Attention" or node.domain not in ("", "ai.onnx"):
            continue
        if len(node.inputs) < 6 or node.inputs[4] is None:
            continue
        q, k, v, bias, past_k, past_v = node.inputs[:6]
        tape = ir.tape.Tape()
        k_all = tape.op("Concat", [past_k, k], {"axis": 2})
        v_all = tape.op("Concat", [past_v, v], {"axis": 2})
        attrs = {a.name: a for a in node.attributes.values()}
        y = tape.op("Attention", [q, k_all, v_all, bias], attributes=attrs)
        new = [y, tape.op("Identity", [k]), tape.op("Identity", [v])]
        ir.convenience.replace_nodes_and_values(
            graph, node, [node], tape.nodes, list(node.outputs), new
        )
        for value in new:
            value.shape = None
        count += 1
    return count


def _rotary_tables(model: ir.Model, rows: int, seq: int) -> int:
    """Replace the cos/sin inputs of RotaryEmbedding nodes by Gather(table, position_ids)."""
    graph = model.graph
    position = next((v for v in graph.inputs if v.name == "position_ids"), None)
    targets: list[ir.Value] = []
    for node in graph:
        if node.op_type == "RotaryEmbedding" and node.domain in ("", "ai.onnx"):
            for value in node.inputs[1:3]:
                if value is not None and value not in targets and value.producer() is not None:
                    targets.append(value)
    if position is None or not targets:
        return 0
    positions = np.arange(rows, dtype=np.int64)[None, :]
    tables = _evaluate(model, position, positions, targets)
    for value, table in zip(targets, tables):
        if table.ndim != 3 or table.shape[:2] != (1, rows):
            raise ExportError(f"rotary input {value.name} is not [B, S, R/2]: {table.shape}")
        init = ir.Value(name=f"{value.name}_table", const_value=ir.tensor(table[0]))
        graph.register_initializer(init)
        node = ir.node("Gather", [init, position], {"axis": 0})
        graph.insert_before(value.producer(), node)  # type: ignore[arg-type]
        gathered = node.outputs[0]
        gathered.name = f"{value.name}_static"
        gathered.dtype = init.const_value.dtype  # type: ignore[union-attr]
        gathered.shape = ir.Shape([1, seq, table.shape[2]])
        value.replace_all_uses_with(gathered)
    return len(targets)


def _evaluate(
    model: ir.Model, source: ir.Value, feed: np.ndarray, targets: list[ir.Value]
) -> list[np.ndarray]:
    """Run the nodes between `source` (fed `feed`) and `targets` on onnxruntime's CPU."""
    import onnxruntime as ort

    needed: list[ir.Node] = []
    inits: dict[str, ir.Value] = {}
    stack = [t.producer() for t in targets]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        needed.append(node)
        for value in node.inputs:
            if value is None or value is source:
                continue
            if value.is_initializer():
                inits[value.name or ""] = value
            elif value.producer() is None:
                raise ExportError(
                    f"rotary cos/sin depend on input {value.name!r}, not only position_ids"
                )
            else:
                stack.append(value.producer())
    order = {id(n): i for i, n in enumerate(model.graph)}
    needed.sort(key=lambda n: order[id(n)])
    graph = onnx.helper.make_graph(
        [ir.serde.serialize_node(n) for n in needed],
        "rotary_tables",
        [onnx.helper.make_tensor_value_info(source.name or "", onnx.TensorProto.INT64, None)],
        [onnx.helper.make_tensor_value_info(t.name or "", _onnx_type(t), None) for t in targets],
        [
            onnx.numpy_helper.from_array(v.const_value.numpy(), name)  # type: ignore[union-attr]
            for name, v in inits.items()
        ],
    )
    proto = onnx.helper.make_model(graph, opset_imports=model_opsets(model))
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return [np.asarray(x) for x in session.run([t.name for t in targets], {source.name: feed})]


def _onnx_type(value: ir.Value) -> int:
    return int(value.dtype.value) if value.dtype is not None else onnx.TensorProto.FLOAT


def model_opsets(model: ir.Model) -> list[onnx.OperatorSetIdProto]:
    return [onnx.helper.make_opsetid(d, v) for d, v in model.opset_imports.items()]


def _fold(model: ir.Model) -> None:
    """Shape inference and constant folding: Shape/Range/mask arithmetic become constants.

    The size limits keep weights out of it: folding a weight would write a new copy of it
    into the graph file instead of sharing model.onnx.data."""
    from onnxscript import optimizer

    optimizer.optimize(
        model,
        num_iterations=3,
        onnx_shape_inference=True,
        input_size_limit=1 << 16,
        output_size_limit=1 << 22,
    )


def write_qnn_graphs(
    directory: Path,
    model_file: str,
    static: StaticPlan,
    soc: int | None,
    quant: str | None = None,
    bos_token_id: int | None = None,
) -> dict[str, Any]:
    """The qnn target's files: static graphs (QDQ with `quant`, exporter/qnn_quant.py), and
    with `soc` their EPContext models.

    Returns the manifest's `static` section (what runtime/static_session.py reads)."""
    section = static.describe()
    section["report"] = write_static_graphs(directory, model_file, static)
    if quant is not None:
        from specport.exporter.qnn_quant import quantize_static

        section["quant"] = quantize_static(directory, section, quant, bos_token_id)
    section["soc"] = soc
    if soc is not None:
        compiled = compile_contexts(directory, section["graphs"], soc)
        section["epcontext"] = compiled.pop("files")
        section["compile"] = compiled
    return section
