"""Give every GroupQueryAttention at least two valid query rows, so a token's attention is
computed the same way in a one-token step and in a multi-token verify run.

Greedy speculative decoding keeps plain greedy's tokens only if the verify run over 1 + K
tokens computes every position bit for bit as the one-token steps do. onnxruntime's CPU
GroupQueryAttention does not: a run with one query row takes GEMM's single-row path, a run
with several rows the general one, and the two round differently (measured with
benchmarks/row_invariance.py: up to 6e-7 on SmolLM2's shapes; with int8 activations the next
MatMul's quantizer turns that into a different rounding step, and greedy picks another token
at a near-tie). Runs of two or more rows agree with each other bit for bit, whatever the
row's place in the run and whatever the run's length (the causal softmax covers exactly the
row's own positions; the masked tail adds exact zeros).

So this pass appends one dummy row to every attention run (zeros for its query, key and
value), made valid through the kernel's `query_seqlens` input (one more valid row) and
`seqlens_k` (one more cached position). Its output row is sliced away. It writes its key and
value one position past the row's length: on the shared layout that slot is beyond the valid
length (overwritten by the next step, as rejected drafts are); onnxruntime wants the whole
padded chunk to fit in every row's buffer, so a run where some row has no slot to spare goes
unpadded (then a one-token step at the very end of a full buffer takes the one-row path). On
the concat layout the present grows by one column, sliced off again. A row the step leaves
idle (query_seqlens 0) stays idle.

Cost: each decode step attends two rows instead of one (the two-row GEMM path packs the
cached keys), plus a Pad and a Slice per layer: SmolLM2 W8A8 decodes at 1.15-1.18x the CPU per
token, so `quantize` applies it only with `--exact-speculation`.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import onnx_ir as ir

from specport.passes.base import Pass
from specport.passes.shared_kv import SEQLENS

logger = logging.getLogger(__name__)

_Q, _K, _V, _PAST_K, _SEQLENS, _TOTAL = 0, 1, 2, 3, 5, 6
_POS, _BIAS, _QUERY_SEQLENS = 9, 10, 16
PADDED = "specport.padded_rows"  # metadata of a rewritten node: the pass runs once


def _gqa_nodes(model: ir.Model) -> list[ir.Node]:
    return [
        n for n in model.graph if n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft"
    ]


def _input(node: ir.Node, i: int) -> ir.Value | None:
    return node.inputs[i] if len(node.inputs) > i else None


class PadAttentionRowsPass(Pass):
    """Append a valid dummy query row to every GroupQueryAttention run (see the module doc)."""

    name = "pad_attention_rows"

    def precondition(self, model: ir.Model) -> str | None:
        nodes = _gqa_nodes(model)
        if not nodes:
            return "no com.microsoft GroupQueryAttention in the main graph"
        if all(PADDED in n.metadata_props for n in nodes):
            return "attention rows already padded"
        missing = [
            n.name for n in nodes if _input(n, _SEQLENS) is None or _input(n, _TOTAL) is None
        ]
        return (
            f"attention without seqlens_k/total_sequence_length: {missing[:3]}" if missing else None
        )

    def rewrite(self, model: ir.Model) -> tuple[bool, dict[str, Any]]:
        graph = model.graph
        shared = SEQLENS in {v.name for v in graph.inputs}
        nodes = [n for n in _gqa_nodes(model) if PADDED not in n.metadata_props]
        cache: dict[tuple[int, ...], tuple[ir.Value, ...]] = {}
        for node in nodes:
            tape = ir.tape.Tape()
            key = tuple(id(_input(node, i)) for i in (_SEQLENS, _TOTAL, _QUERY_SEQLENS))
            if key not in cache:  # once per run, before the first attention
                cache[key] = _lengths(tape, node, shared)
            steps, seqlens, total, qlens, extra_total, step_total, rows, row_pads = cache[key]
            for i in (_Q, _K, _V):
                x = _input(node, i)
                if x is not None:  # [B, S, N] -> [B, S + rows, N], the new row zeros
                    node.replace_input_with(i, _padded(tape, x, row_pads))
            pos = _input(node, _POS)
            if pos is not None:  # rotary positions [B, S]: the dummy repeats the last
                pads = tape.op("Concat", [_i64(tape, [0, 0, 0]), rows], {"axis": 0})
                node.replace_input_with(_POS, tape.op("Pad", [pos, pads], {"mode": "edge"}))
            bias = _input(node, _BIAS)
            if bias is not None:  # [B|1, H|1, S, T] -> [.., S + rows, T + extra]: the dummy's
                zeros = _i64(tape, [0, 0, 0, 0, 0, 0])  # row and column are never read
                pads = tape.op("Concat", [zeros, rows, extra_total], {"axis": 0})
                node.replace_input_with(_BIAS, tape.op("Pad", [bias, pads]))
            if len(node.inputs) <= _QUERY_SEQLENS:
                node.resize_inputs(_QUERY_SEQLENS + 1)
            node.replace_input_with(_SEQLENS, seqlens)
            node.replace_input_with(_TOTAL, total)
            node.replace_input_with(_QUERY_SEQLENS, qlens)
            graph.insert_before(node, tape.nodes)
            _slice_after(graph, node, node.outputs[0], steps, axis=1)
            if not shared:  # concat: present is total + 1 long; the next past is total long
                widths = ir.tape.Tape()
                total64 = widths.op("Cast", [step_total], {"to": ir.DataType.INT64})
                width = widths.op("Reshape", [total64, _i64(widths, [1])])
                graph.insert_after(node, widths.nodes)
                for out in node.outputs[1:3]:
                    if out.uses() or out.is_graph_output():
                        _slice_after(graph, widths.nodes[-1], out, width, axis=2)
            node.metadata_props[PADDED] = "1"
        return bool(nodes), {"layers": len(nodes), "layout": "shared" if shared else "concat"}


def _lengths(tape: ir.tape.Tape, node: ir.Node, shared: bool) -> tuple[ir.Value, ...]:
    """(S [1] int64, seqlens_k', total', query_seqlens', extra columns [1] int64, the step's
    total, dummy rows [1] int64: 1 or 0, and the Pad amounts [6] of a [B, S, N] input), once
    per run for every layer.

    The kernel requires every row's cached tokens plus the whole chunk (padding included) to
    fit in its buffer, so on the shared layout the run gets its dummy row only when every row
    has a slot to spare; a row that takes tokens this step then gets one more valid row and
    cached position.
    """
    query, seqlens, total = node.inputs[_Q], node.inputs[_SEQLENS], node.inputs[_TOTAL]
    assert query is not None and seqlens is not None and total is not None
    steps = tape.op("Shape", [query], {"start": 1, "end": 2})  # [S] int64
    steps32 = tape.op("Cast", [steps], {"to": ir.DataType.INT32})
    one = _i32(tape, 1)
    qlens = _input(node, _QUERY_SEQLENS)
    if qlens is None:  # the kernel's own default
        qlens = tape.op("Min", [tape.op("Add", [seqlens, one]), steps32])
    busy = tape.op("Greater", [qlens, _i32(tape, 0)])
    if shared:
        past = node.inputs[_PAST_K]
        assert past is not None
        cap64 = tape.op("Shape", [past], {"start": 2, "end": 3})
        cap = tape.op("Cast", [cap64], {"to": ir.DataType.INT32})  # [1]
        cached = tape.op("Sub", [tape.op("Add", [seqlens, one]), qlens])  # [B]
        need = tape.op("Add", [tape.op("Add", [cached, steps32]), one])
        fits = tape.op("Cast", [tape.op("LessOrEqual", [need, cap])], {"to": ir.DataType.INT64})
        rows = tape.op("ReduceMin", [fits, _i64(tape, [0])], {"keepdims": 1})  # [1]
        rows32 = tape.op("Cast", [rows], {"to": ir.DataType.INT32})
        gets = tape.op("And", [busy, tape.op("Cast", [rows32], {"to": ir.DataType.BOOL})])
        total2 = tape.op(
            "Min",
            [tape.op("Add", [total, tape.op("Squeeze", [rows32])]), tape.op("Squeeze", [cap])],
        )
    else:
        gets = busy
        rows = _i64(tape, [1])
        total2 = tape.op("Add", [total, one])
    add = tape.op("Cast", [gets], {"to": ir.DataType.INT32})
    seqlens2 = tape.op("Add", [seqlens, add])
    qlens2 = tape.op("Add", [qlens, add])
    extra = tape.op("Reshape", [tape.op("Sub", [total2, total]), _i64(tape, [1])])
    extra64 = tape.op("Cast", [extra], {"to": ir.DataType.INT64})
    row_pads = tape.op("Concat", [_i64(tape, [0, 0, 0, 0]), rows, _i64(tape, [0])], {"axis": 0})
    for v, name in ((seqlens2, "seqlens_k"), (qlens2, "query_seqlens"), (total2, "total")):
        v.name = f"{node.name}/padded_rows/{name}"
    return steps, seqlens2, total2, qlens2, extra64, total, rows, row_pads


def _padded(tape: ir.tape.Tape, x: ir.Value, pads: ir.Value) -> ir.Value:
    out = tape.op("Pad", [x, pads])
    if x.dtype is not None:
        out.dtype = x.dtype
    return out


def _slice_after(
    graph: ir.Graph, after: ir.Node, value: ir.Value, stop: ir.Value, axis: int
) -> None:
    """Route every use of `value` (graph outputs included, keeping the name) through
    value[..., :stop] along `axis`."""
    tape = ir.tape.Tape()
    sliced = tape.op("Slice", [value, _i64(tape, [0]), stop, _i64(tape, [axis])])
    if value.type is not None and value.dtype is not None:
        sliced.type, sliced.shape = value.type, value.shape
    name = value.name
    ir.convenience.replace_all_uses_with(value, sliced, replace_graph_outputs=True)
    sliced_node = sliced.producer()
    assert sliced_node is not None
    sliced_node.replace_input_with(0, value)  # replace_all_uses_with rerouted our own input
    graph.insert_after(after, tape.nodes)
    value.name, sliced.name = f"{name}/padded", name
    value.shape = None


def _i64(tape: ir.tape.Tape, v: Any) -> ir.Value:
    return tape.op("Constant", [], {"value": ir.tensor(np.array(v, np.int64))})


def _i32(tape: ir.tape.Tape, v: Any) -> ir.Value:
    return tape.op("Constant", [], {"value": ir.tensor(np.array(v, np.int32))})
