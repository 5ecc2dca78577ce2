"""A copy of an artifact whose short attention runs give a KV head's query heads to the
kernel as rows of one head: what `benchmarks/attention_layouts.py`'s grouped layout costs in a
whole decode step. A measuring tool, not a pass specport applies: measured, it does not pay.

onnxruntime's CPU GroupQueryAttention computes every (row, query head) pair as its own pair of
single-row GEMMs, packing the cached keys each time: with SmolLM2's 9 query heads on 3 KV heads
a decode step packs each cached head three times. Given the 3 query heads that share a KV head
as 3 rows of one head, the kernel packs it once and runs 3-row GEMMs. The rewrite, per
attention node, for runs of at most `max_tokens` tokens:
- rotary moves out of the kernel (com.microsoft RotaryEmbedding at each token's position,
  `seqlens_k + 1 - query_seqlens + s`, as the kernel computes it), because a grouped row's
  position is its token's, not its row's;
- the query [B, S, H*D] becomes [B, S*G, Hkv*D], token-major (row t*G + g is query head
  h*G + g of token t); keys and values get S*(G-1) zero rows after the S real ones, so the
  real keys land at the token positions and the zero rows in slots past the valid length
  (overwritten later, as rejected drafts are);
- `query_seqlens`, `seqlens_k` and `total_sequence_length` count the grouped rows, and an
  attention bias [B, 1, S*G, T] hides from row t*G + g every position past its token's;
- the output is put back in the exported order.
Longer runs (prefill chunks) and runs where some row's buffer cannot hold the S*G rows take
the exported node unchanged: an `If` chooses per run, so prefill costs nothing more.

Measured on SmolLM2-135M fp32 (docs/benchmarks/2026-12-06-grouped-rows.md): the same tokens,
but the kernel is no faster once the cache comes from memory (the 2x of a layer rerun on
cache-resident data was the cache), and the If with its rotary and reshapes costs about
40 us per layer, so a batch-1 step is slower. Usage:

    python -m benchmarks.grouped_rows_graph ARTIFACT --out OUT [--max-tokens 16]
    specport bench ARTIFACT --peer specport:OUT --prompt-len 512 --batch 1 8
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from specport.artifact.manifest import read_manifest, write_manifest
from specport.core.errors import SpecportError
from specport.passes.base import Pass
from specport.passes.pad_attention_rows import _gqa_nodes, _input
from specport.passes.shared_kv import SEQLENS

logger = logging.getLogger(__name__)

_Q, _K, _V, _PAST_K, _PAST_V, _SEQLENS, _TOTAL, _COS, _SIN = range(9)
_BIAS, _QUERY_SEQLENS = 10, 16
GROUPED = "specport.grouped_rows"  # metadata of a rewritten node: the pass runs once
DEFAULT_MAX_TOKENS = 16  # the longest run grouped: decode steps and verify runs of 15 drafts
_KNOWN_ATTRIBUTES = {
    "num_heads",
    "kv_num_heads",
    "scale",
    "do_rotary",
    "rotary_interleaved",
    "softcap",
    "local_window_size",
}


def _attr(node: ir.Node, name: str, default: Any) -> Any:
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def _refusal(node: ir.Node) -> str | None:
    """Why this node cannot be grouped, or None."""
    heads, kv_heads = _attr(node, "num_heads", 0), _attr(node, "kv_num_heads", 0)
    if not kv_heads or heads <= kv_heads or heads % kv_heads:
        return f"{heads} query heads on {kv_heads} KV heads: nothing to group"
    if _attr(node, "local_window_size", -1) != -1:
        return "sliding-window attention"
    unknown = set(node.attributes) - _KNOWN_ATTRIBUTES
    if unknown:
        return f"attributes {sorted(unknown)}"
    for i in (_SEQLENS, _TOTAL, _PAST_K, _PAST_V):
        if _input(node, i) is None:
            return "no seqlens_k, total_sequence_length or past KV input"
    if _input(node, _BIAS) is not None or any(
        _input(node, i) is not None for i in range(9, len(node.inputs)) if i != _QUERY_SEQLENS
    ):
        return "an attention bias or position input already given"
    if _attr(node, "do_rotary", 0) and (_input(node, _COS) is None or _input(node, _SIN) is None):
        return "rotary without cos/sin caches"
    return None


class GroupQueryRowsPass(Pass):
    """Give short attention runs a KV head's query heads as rows (see the module doc)."""

    name = "group_query_rows"

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.max_tokens = max_tokens

    def precondition(self, model: ir.Model) -> str | None:
        nodes = _gqa_nodes(model)
        if not nodes:
            return "no com.microsoft GroupQueryAttention in the main graph"
        if SEQLENS not in {v.name for v in model.graph.inputs}:
            return "not the shared KV layout (no seqlens_k input)"
        if all(GROUPED in n.metadata_props for n in nodes):
            return "attention rows already grouped"
        if any("specport.padded_rows" in n.metadata_props for n in nodes):
            return "attention rows padded (--exact-speculation); group before padding"
        return None

    def rewrite(self, model: ir.Model) -> tuple[bool, dict[str, Any]]:
        graph = model.graph
        refused: dict[str, str] = {}
        runs: dict[tuple[int, ...], _Run] = {}
        grouped = 0
        for node in [n for n in _gqa_nodes(model) if GROUPED not in n.metadata_props]:
            reason = _refusal(node)
            if reason is not None:
                refused[node.name or "?"] = reason
                continue
            group = _attr(node, "num_heads", 0) // _attr(node, "kv_num_heads", 1)
            key = (group, *(id(_input(node, i)) for i in (_SEQLENS, _TOTAL, _QUERY_SEQLENS)))
            tape = ir.tape.Tape()
            if key not in runs:  # once per run and group size, before the first attention
                runs[key] = _Run.build(tape, node, group, self.max_tokens)
            _name_values(tape.nodes, f"{node.name}/grouped_rows/run")
            graph.insert_before(node, tape.nodes)
            _branch(graph, node, runs[key])
            grouped += 1
        if refused:
            logger.info("group_query_rows left %d attention node(s) as exported", len(refused))
        return bool(grouped), {
            "layers": grouped,
            "max_tokens": self.max_tokens,
            "refused": dict(list(refused.items())[:5]),
        }


@dataclasses.dataclass
class _Run:
    """The values every grouped layer of one run shares (computed once, before the first)."""

    steps: ir.Value  # [1] int64: S, the run's tokens
    rows: ir.Value  # [1] int64: S * G, the grouped rows
    positions: ir.Value  # [B, S] int64: each token's rotary position
    qlens: ir.Value  # [B] int32: valid grouped rows
    seqlens: ir.Value  # [B] int32: seqlens_k counted in grouped rows
    total: ir.Value  # int32: total_sequence_length counted in grouped rows
    hidden: ir.Value  # [B, 1, S * G, T] bool: what each grouped row may not see
    use: ir.Value  # bool: group this run (short, and every buffer has room)

    @staticmethod
    def build(tape: ir.tape.Tape, node: ir.Node, group: int, max_tokens: int) -> _Run:
        query, seqlens, total = node.inputs[_Q], node.inputs[_SEQLENS], node.inputs[_TOTAL]
        past = node.inputs[_PAST_K]
        assert query is not None and seqlens is not None and total is not None and past
        steps = tape.op("Shape", [query], {"start": 1, "end": 2})  # [1] int64: S
        steps32 = tape.op("Cast", [steps], {"to": ir.DataType.INT32})
        one = _const(tape, np.int32(1))
        qlens = _input(node, _QUERY_SEQLENS)
        if qlens is None:  # the kernel's own default
            qlens = tape.op("Min", [tape.op("Add", [seqlens, one]), steps32])
        cached = tape.op("Sub", [tape.op("Add", [seqlens, one]), qlens])  # [B] int32
        # rotary positions [B, S] int64: the kernel's own, seqlens + 1 - query_seqlens + s
        arange = tape.op(
            "Range",
            [_const(tape, np.int64(0)), tape.op("Squeeze", [steps]), _const(tape, np.int64(1))],
        )
        cached64 = tape.op("Cast", [cached], {"to": ir.DataType.INT64})
        positions = tape.op(
            "Add", [tape.op("Unsqueeze", [cached64, _const(tape, np.array([1], np.int64))]), arange]
        )
        # grouped lengths: every valid token becomes `group` valid rows
        g32 = _const(tape, np.int32(group))
        rows32 = tape.op("Mul", [steps32, g32])  # [1]: S * G
        qlens2 = tape.op("Mul", [qlens, g32])
        seqlens2 = tape.op(
            "Add", [seqlens, tape.op("Mul", [qlens, _const(tape, np.int32(group - 1))])]
        )
        total2 = tape.op("Add", [total, tape.op("Squeeze", [tape.op("Sub", [rows32, steps32])])])
        # the run is grouped when it is short and every row's buffer holds its S * G rows
        cap = tape.op(
            "Cast", [tape.op("Shape", [past], {"start": 2, "end": 3})], {"to": ir.DataType.INT32}
        )
        fits = tape.op("LessOrEqual", [tape.op("Add", [cached, rows32]), cap])  # [B]
        all_fit = tape.op(
            "Cast",
            [
                tape.op(
                    "ReduceMin",
                    [tape.op("Cast", [fits], {"to": ir.DataType.INT32})],
                    {"keepdims": 0},
                )
            ],
            {"to": ir.DataType.BOOL},
        )
        short = tape.op(
            "LessOrEqual", [tape.op("Squeeze", [steps]), _const(tape, np.int64(max_tokens))]
        )
        use = tape.op("And", [short, all_fit])
        # bias [B, 1, S*G, T']: row r sees positions <= cached + r // G
        rows64 = tape.op("Cast", [rows32], {"to": ir.DataType.INT64})
        row_token = tape.op(
            "Div",
            [
                tape.op(
                    "Range",
                    [
                        _const(tape, np.int64(0)),
                        tape.op("Squeeze", [rows64]),
                        _const(tape, np.int64(1)),
                    ],
                ),
                _const(tape, np.int64(group)),
            ],
        )  # [S*G]
        limit = tape.op(
            "Add",
            [
                tape.op("Unsqueeze", [cached64, _const(tape, np.array([1, 2, 3], np.int64))]),
                tape.op("Reshape", [row_token, _const(tape, np.array([1, 1, -1, 1], np.int64))]),
            ],
        )  # [B, 1, S*G, 1]
        columns = tape.op(
            "Range",
            [
                _const(tape, np.int64(0)),
                tape.op("Cast", [total2], {"to": ir.DataType.INT64}),
                _const(tape, np.int64(1)),
            ],
        )
        hidden = tape.op("Greater", [columns, limit])  # [B, 1, S*G, T']
        for v, name in ((seqlens2, "seqlens_k"), (qlens2, "query_seqlens"), (total2, "total")):
            v.name = f"{node.name}/grouped_rows/{name}"
        return _Run(
            steps=steps,
            rows=rows64,
            positions=positions,
            qlens=qlens2,
            seqlens=seqlens2,
            total=total2,
            hidden=hidden,
            use=use,
        )


def _branch(graph: ir.Graph, node: ir.Node, run: _Run) -> None:
    """Replace `node` by If(run.use, grouped attention, the node as exported)."""
    heads, kv_heads = _attr(node, "num_heads", 0), _attr(node, "kv_num_heads", 0)
    group = heads // kv_heads
    q, k, v = (_input(node, i) for i in (_Q, _K, _V))
    past_k, past_v = node.inputs[_PAST_K], node.inputs[_PAST_V]
    out, present_k, present_v = node.outputs[:3]
    dtype = out.dtype or (q.dtype if q is not None else None) or ir.DataType.FLOAT
    name = node.name or "attention"

    t = ir.tape.Tape()
    dim = _head_size(past_k)
    if k is None:  # packed [B, S, (H + 2 Hkv) D]
        q, k, v = t.op_multi_out(
            "Split",
            [q, _const(t, np.array([heads * dim, kv_heads * dim, kv_heads * dim], np.int64))],
            {"axis": 2},
            num_outputs=3,
        )
    if _attr(node, "do_rotary", 0):
        cos, sin = node.inputs[_COS], node.inputs[_SIN]
        rotary_dim = 2 * int(cos.shape[1]) if cos is not None and cos.shape is not None else dim
        rot = {"interleaved": _attr(node, "rotary_interleaved", 0)}
        if rotary_dim != dim:
            rot["rotary_embedding_dim"] = rotary_dim
        q = t.op(
            "RotaryEmbedding",
            [q, run.positions, cos, sin],
            {**rot, "num_heads": heads},
            domain="com.microsoft",
        )
        k = t.op(
            "RotaryEmbedding",
            [k, run.positions, cos, sin],
            {**rot, "num_heads": kv_heads},
            domain="com.microsoft",
        )
    # query [B, S, Hkv, G, D] -> [B, S, G, Hkv, D] -> [B, S*G, Hkv*D]
    q5 = t.op("Reshape", [q, _const(t, np.array([0, 0, kv_heads, group, dim], np.int64))])
    q_rows = t.op(
        "Reshape",
        [
            t.op("Transpose", [q5], {"perm": [0, 1, 3, 2, 4]}),
            _const(t, np.array([0, -1, kv_heads * dim], np.int64)),
        ],
    )
    extra = t.op("Sub", [run.rows, run.steps])
    pads = t.op(
        "Concat",
        [_const(t, np.array([0, 0, 0, 0], np.int64)), extra, _const(t, np.array([0], np.int64))],
        {"axis": 0},
    )
    k_rows, v_rows = t.op("Pad", [k, pads]), t.op("Pad", [v, pads])
    zero, low = (
        _const(t, np.zeros((), _np(dtype))),
        _const(t, np.array(np.finfo(_np(dtype)).min, _np(dtype))),
    )
    bias = t.op("Where", [run.hidden, low, zero])
    attributes = {"num_heads": kv_heads, "kv_num_heads": kv_heads, "do_rotary": 0}
    for a in ("scale", "softcap"):
        if a in node.attributes:
            attributes[a] = node.attributes[a].value
    inputs: list[ir.Value | None] = [q_rows, k_rows, v_rows, past_k, past_v, run.seqlens, run.total]
    inputs += (
        [None] * (_BIAS - len(inputs))
        + [bias]
        + [None] * (_QUERY_SEQLENS - _BIAS - 1)
        + [run.qlens]
    )
    o_rows, pk, pv = t.op_multi_out(
        "GroupQueryAttention", inputs, attributes, domain="com.microsoft", num_outputs=3
    )
    # output [B, S*G, Hkv*D] -> [B, S, G, Hkv, D] -> [B, S, Hkv, G, D] -> [B, S, H*D]
    o5 = t.op("Reshape", [o_rows, _const(t, np.array([0, -1, group, kv_heads, dim], np.int64))])
    o = t.op(
        "Reshape",
        [
            t.op("Transpose", [o5], {"perm": [0, 1, 3, 2, 4]}),
            _const(t, np.array([0, 0, heads * dim], np.int64)),
        ],
    )
    for value, suffix in ((o, "out"), (pk, "present_key"), (pv, "present_value")):
        value.name = f"{name}/grouped_rows/{suffix}"
    _name_values(t.nodes, f"{name}/grouped_rows")
    grouped = ir.Graph([], [o, pk, pv], nodes=t.nodes, name=f"{name}_grouped")

    # the If takes the node's place (and its output names); the node moves into the other
    # branch with fresh output names
    choose = ir.Node(
        "",
        "If",
        [run.use],
        attributes=[ir.AttrGraph("then_branch", grouped)],
        num_outputs=3,
        name=f"{name}/grouped_rows",
    )
    choose.metadata_props[GROUPED] = "1"
    graph.insert_before(node, choose)
    for old, new, suffix in zip(
        (out, present_k, present_v), choose.outputs, ("out", "present_key", "present_value")
    ):
        kept_name = old.name
        new.type, new.shape = old.type, old.shape
        ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
        old.name, new.name = f"{name}/exported/{suffix}", kept_name
    graph.remove(node)
    node.metadata_props[GROUPED] = "1"
    exported = ir.Graph([], list(node.outputs[:3]), nodes=[node], name=f"{name}_exported")
    choose.attributes["else_branch"] = ir.AttrGraph("else_branch", exported)


def _name_values(nodes: Any, prefix: str) -> None:
    """Name every unnamed value: the branches are serialized with the main graph, and names
    must be unique across both (single static assignment)."""
    for i, node in enumerate(nodes):
        for j, value in enumerate(node.outputs):
            if not value.name:
                value.name = f"{prefix}/{node.op_type}_{i}_{j}"


def _head_size(past: ir.Value) -> int:
    """D of the past KV input [B, Hkv, L, D] (static in every export)."""
    if past.shape is None or len(past.shape) != 4 or not isinstance(past.shape[3], int):
        raise ValueError(f"past KV input {past.name} without a static head size")
    return int(past.shape[3])


def _np(dtype: ir.DataType) -> Any:
    return dtype.numpy()


def _const(tape: ir.tape.Tape, value: Any) -> ir.Value:
    return tape.op("Constant", [], {"value": ir.tensor(np.asarray(value))})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path, help="a shared-KV-layout artifact")
    parser.add_argument("--out", type=Path, required=True, help="a new folder for the copy")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    args = parser.parse_args()
    if args.out.exists():
        parser.error(f"{args.out} exists; name a new folder")
    try:
        manifest = read_manifest(args.artifact)
    except SpecportError as e:
        parser.error(str(e))
    model = ir.load(args.artifact / "model.onnx")
    result = GroupQueryRowsPass(args.max_tokens)(model)
    if not result.modified:
        parser.error(f"nothing grouped: {result.report.get('skipped') or result.report}")
    shutil.copytree(
        args.artifact, args.out, ignore=shutil.ignore_patterns("model.onnx", "model.onnx.data")
    )
    ir.save(model, args.out / "model.onnx", external_data="model.onnx.data")
    write_manifest(args.out, manifest)
    report = {k: v for k, v in result.report.items() if not k.startswith("ops_")}
    print(f"{args.out}: {report}")


if __name__ == "__main__":
    main()
