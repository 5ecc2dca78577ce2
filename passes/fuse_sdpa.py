"""Fuse decomposed scaled-dot-product attention into one ai.onnx Attention-23 node.

Contract of the result (4-D form of Attention-23):
    y [B, H, S, Dv] = Attention(q [B, H, S, Dh], k [B, Hk, T, Dh], v [B, Hk, T, Dv],
                                bias [.., S, T] (optional, additive); scale)
    H % Hk == 0; bias broadcasts to [B, H, S, T].

Matches what TorchScript exporters write for attention (Optimum, onnxruntime's gpt2 helper,
`torch.onnx.export(dynamo=False)` of HF eager or sdpa attention), starting at each Softmax:

    s  = MatMul(q * c1, Transpose(k, perm=[0,1,3,2]) * c2)        c1, c2 optional scalars
    s  = s * c3 | s / c3                                          optional, before any mask
    s  = s + bias | Where(keep, s, fill) | Where(masked, fill, s)  any number of mask terms
    p  = Softmax(s, axis=-1) [-> Where(IsNaN(p), 0, p)]           optional NaN guard
    y  = MatMul(p, v)

scale = c1 * c2 * c3 (or / c3); the scalars may be computed from Shape(q)[-1] at run time
(see _shapes.eval_scalar). `Where(keep, s, fill)` becomes the additive term
`Where(keep, 0, lowest)` and DistilBERT's `Where(masked, fill, s)` becomes
`Where(masked, lowest, 0)`, for any fill <= -1e4: the lowest float instead of -inf keeps a fully
masked row (a left-pad query) uniform instead of NaN (the NaN guard's job in the unfused graph);
such a row is the only place the fused output may differ from the input.
fuse_attention then turns an Attention-23 over a concatenated KV cache into GroupQueryAttention.

Megatron's causal mask `s * m - c * (1 - m)` (0/1 constant m, c >= 1e4) is the same as
`Where(m, s, -c)` and is taken as that. The additive mask is broadcast to [.., S, T] (a padding
mask [B, 1, 1, T] is not enough for onnxruntime's CPU kernel).

Not matched, with the reason in the report: softmax over another axis, a scale that is not a
constant (or computable from static dims), a scale applied after the mask, probabilities used
elsewhere, Q/K/V that are not 4-D with known head counts, Hk not dividing H.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import onnx_ir as ir

from specport.passes._shapes import eval_scalar, static_dim

logger = logging.getLogger(__name__)


class Miss(str):
    """Why a Softmax is not fused attention; `matched` says how far the pattern got."""

    matched: str

    def __new__(cls, reason: str, matched: str = "") -> Miss:
        obj = super().__new__(cls, reason)
        obj.matched = matched
        return obj


MATMUL_DEPTH = 8  # Mul/Div/Add/Where steps allowed between the score MatMul and the Softmax


def _prod(v: ir.Value | None, *ops: str) -> ir.Node | None:
    node = v.producer() if v is not None else None
    if node is None or node.domain not in ("", "ai.onnx") or node.op_type not in ops:
        return None
    return node


def _reaches_matmul(v: ir.Value | None, depth: int = MATMUL_DEPTH) -> bool:
    """True when `v` is (a scaled/masked form of) a MatMul output: the score side of an Add."""
    while depth > 0 and v is not None:
        node = _prod(v, "MatMul", "Mul", "Div", "Add", "Where", "Sub")
        if node is None:
            return False
        if node.op_type == "MatMul":
            return True
        if node.op_type == "Where":  # Where(keep, s, fill) or Where(masked, fill, s)
            v = node.inputs[2] if eval_scalar(node.inputs[1]) is not None else node.inputs[1]
        elif node.op_type == "Add":
            return any(_reaches_matmul(x, depth - 1) for x in node.inputs)
        else:
            v = node.inputs[0]
        depth -= 1
    return False


def _peel_scale(v: ir.Value | None) -> tuple[ir.Value | None, float, str | None]:
    """x * c / x / c chains with scalar c -> (x, product of factors, failure)."""
    scale = 1.0
    while True:
        node = _prod(v, "Mul", "Div")
        if node is None:
            return v, scale, None
        a, b = node.inputs
        cb = eval_scalar(b)
        ca = eval_scalar(a) if node.op_type == "Mul" else None
        if cb is None and ca is None:
            return v, scale, None  # not a scalar factor: let the caller decide
        if cb is not None:
            scale = scale * cb if node.op_type == "Mul" else scale / cb
            v = a
        else:
            scale *= float(ca)  # type: ignore[arg-type]
            v = b


def _zero_one(m: ir.Value | None, depth: int = 8) -> bool:
    """True when `m` is provably 0/1: a constant with only 0s and 1s, through Slice, Cast,
    Reshape, Unsqueeze, Squeeze, Expand (Megatron's `ltor` causal-mask buffer)."""
    for _ in range(depth):
        if m is None:
            return False
        if m.const_value is not None:
            return bool(np.isin(m.const_value.numpy(), (0, 1)).all())
        node = _prod(m, "Slice", "Cast", "Reshape", "Unsqueeze", "Squeeze", "Expand")
        if node is None:
            return False
        m = node.inputs[0]
    return False


def _multiplicative_mask(node: ir.Node) -> tuple[ir.Value, ir.Value] | None:
    """Megatron's causal mask `s * m - c * (1 - m)` with 0/1 `m` and c >= 1e4, which equals
    `Where(m, s, -c)`: Sub(Mul(s, m), Mul(Sub(1, m), c)) in either operand order.
    Returns (s, m), or None when `node` is not that."""
    keep, drop = _prod(node.inputs[0], "Mul"), _prod(node.inputs[1], "Mul")
    if node.op_type != "Sub" or keep is None or drop is None:
        return None
    a, b = keep.inputs
    if _reaches_matmul(a) == _reaches_matmul(b):
        return None
    scores, m = (a, b) if _reaches_matmul(a) else (b, a)
    for inverse, c in ((drop.inputs[0], drop.inputs[1]), (drop.inputs[1], drop.inputs[0])):
        sub, fill = _prod(inverse, "Sub"), eval_scalar(c)
        if (
            sub is not None
            and fill is not None
            and fill >= 1e4
            and sub.inputs[1] is m
            and eval_scalar(sub.inputs[0]) == 1.0
            and _zero_one(m)
        ):
            return scores, m  # type: ignore[return-value]
    return None


def _same_dim(a: ir.Value, i: int, b: ir.Value, j: int) -> bool:
    da, db = a.shape[i], b.shape[j]  # type: ignore[index]
    if isinstance(da, int) or isinstance(db, int):
        return da == db
    return da.value is not None and da.value == db.value


def _shape_parts(v: ir.Value | None, k: ir.Value, rank: int = 4) -> list[int | str] | None:
    """A Reshape target written as Concat(constants, slices of Shape(k)): its entries, each an
    int or `k<axis>` (axis of k's shape), or None when it is not built that way."""
    node = _prod(v, "Concat")
    pieces = node.inputs if node is not None else [v]
    out: list[int | str] = []
    for piece in pieces:
        if piece is None:
            return None
        if piece.const_value is not None:
            out += [int(x) for x in piece.const_value.numpy().reshape(-1)]
            continue
        shape = _prod(piece, "Shape")
        start, end = 0, rank
        sl = _prod(piece, "Slice")
        if sl is not None:  # Slice(Shape(k), starts, ends[, axes=[0][, steps=[1]]])
            shape = _prod(sl.inputs[0], "Shape")
            consts = [eval_scalar(x) if x is not None else None for x in sl.inputs[1:]]
            if shape is None or any(c is None for c in consts[:2]) or consts[3:4] not in ([], [1]):
                return None
            start, end = int(consts[0]), int(consts[1])  # type: ignore[arg-type]
        if shape is None or shape.inputs[0] is not k:
            return None
        lo = shape.attributes.get_int("start", 0)
        hi = shape.attributes.get_int("end", rank)
        axes = list(range(rank))[lo:hi][start:end]
        out += [f"k{a}" for a in axes]
    return out


def _unflattened_k(kt: ir.Value | None) -> ir.Value | None:
    """torch's SDPA decomposition below opset 23 transposes K as 3-D:
    Reshape(Transpose(Reshape(k [B, H, T, D] -> [B*H, T, D]), perm=[0, 2, 1]) -> [B, H, D, T]).
    Returns k when the shapes prove that this is K^T, else None."""
    outer = _prod(kt, "Reshape")
    tr = _prod(outer.inputs[0], "Transpose") if outer is not None else None
    inner = _prod(tr.inputs[0], "Reshape") if tr is not None else None
    if outer is None or tr is None or inner is None or kt is None:
        return None
    k, flat = inner.inputs[0], inner.outputs[0]
    if list(tr.attributes.get_ints("perm", [])) != [0, 2, 1] or k is None:
        return None
    shapes = (k.shape, flat.shape, kt.shape)
    if any(sh is None for sh in shapes) or [sh.rank() for sh in shapes] != [4, 3, 4]:  # type: ignore[union-attr]
        return None
    h, d = static_dim(k, 1), static_dim(k, 3)
    if h is None or d is None:
        return None
    by_shapes = (
        static_dim(flat, 2) == d  # [X, T, D]: the last axis is untouched
        and _same_dim(flat, 1, k, 2)  # ... and the middle one is T
        and static_dim(kt, 1) == h  # back to [B, H, D, T]
        and static_dim(kt, 2) == d
        and _same_dim(kt, 3, k, 2)
    )
    # the same read from the Reshape targets, built from Shape(k) (dynamo exports whose
    # annotations name T differently on each side)
    inner_t, outer_t = _shape_parts(inner.inputs[1], k), _shape_parts(outer.inputs[1], k)
    by_targets = inner_t in ([-1, "k2", "k3"], [-1, "k2", d]) and outer_t in (
        ["k0", "k1", "k3", "k2"],
        ["k0", h, d, "k2"],
        ["k0", "k1", d, "k2"],
    )
    return k if by_shapes or by_targets else None


def _is_zero(v: ir.Value | None) -> bool:
    c = eval_scalar(v)
    return c == 0.0


def _prob_consumer(p: ir.Value) -> tuple[ir.Node | None, list[ir.Node], str | None]:
    """The MatMul(p, v) that consumes the probabilities, through an optional NaN guard."""
    guard: list[ir.Node] = []
    uses = [u.node for u in p.uses()]
    if len(uses) == 2 and {n.op_type for n in uses} == {"IsNaN", "Where"}:
        isnan = next(n for n in uses if n.op_type == "IsNaN")
        where = next(n for n in uses if n.op_type == "Where")
        if (
            where.inputs[0] is isnan.outputs[0]
            and where.inputs[2] is p
            and _is_zero(where.inputs[1])
            and len(isnan.outputs[0].uses()) == 1
        ):
            guard = [isnan, where]
            p = where.outputs[0]
            uses = [u.node for u in p.uses()]
    if p.is_graph_output() or len(uses) != 1:
        return None, guard, "attention probabilities are used elsewhere"
    mm = uses[0]
    if mm.op_type != "MatMul" or mm.domain not in ("", "ai.onnx") or mm.inputs[0] is not p:
        return None, guard, f"probabilities feed {mm.op_type}, not MatMul(p, V)"
    return mm, guard, None


def match_sdpa(softmax: ir.Node) -> dict[str, Any] | str:
    """The parts of one decomposed attention ending at `softmax`, or why it is not one (a
    `Miss`: the reason, and what had matched before it, for `specport optimize -v`)."""
    seen: list[str] = ["Softmax"]

    def miss(reason: str) -> Miss:
        return Miss(reason, " -> ".join(seen))

    x = softmax.inputs[0]
    axis = softmax.attributes.get_int("axis", -1)
    if axis not in (-1, 3):  # scores are [B, H, S, T] (checked through Q below)
        return miss(f"Softmax over axis {axis}, not the key axis")
    mm, _, why = _prob_consumer(softmax.outputs[0])
    if mm is None:
        return miss(why or "no MatMul(p, V)")
    seen.append("MatMul(p, V)")
    terms: list[tuple[str, ir.Value, ir.Value | None]] = []  # (kind, value, fill)
    scale = 1.0
    scaled = False  # walking back from the Softmax: a scale seen before a mask scales the mask
    v = x
    while True:
        node = _prod(v, "Add", "Where", "Mul", "Div", "MatMul", "Sub")
        if node is None:
            src = v.producer() if v is not None else None
            what = src.op_type if src is not None else "a graph input"
            return miss(f"scores come from {what}, not MatMul(Q, K^T)")
        if node.op_type == "MatMul":
            seen.append(f"{len(terms)} mask term(s), scale x{scale:.3g}, scores MatMul")
            break
        if node.op_type in ("Add", "Where", "Sub") and scaled:
            return miss("scores are scaled after the mask is added")
        if node.op_type == "Sub":
            megatron = _multiplicative_mask(node)
            if megatron is None:
                return miss("Sub before the Softmax is not a 0/1 mask (s * m - c * (1 - m))")
            terms.append(("mask01", megatron[1], None))
            v = megatron[0]
            continue
        if node.op_type == "Add":
            a, b = node.inputs
            sa, sb = _reaches_matmul(a), _reaches_matmul(b)
            if sa == sb:
                return miss("cannot tell scores from mask in an Add before the Softmax")
            terms.append(("add", b if sa else a, None))  # type: ignore[arg-type]
            v = a if sa else b
        elif node.op_type == "Where":
            cond, a, b = node.inputs
            fill_b, fill_a = eval_scalar(b), eval_scalar(a)
            if fill_b is not None and fill_b <= -1e4:  # Where(keep, s, fill)
                terms.append(("where", cond, b))  # type: ignore[arg-type]
                v = a
            elif fill_a is not None and fill_a <= -1e4:  # Where(masked, fill, s): DistilBERT
                terms.append(("where_masked", cond, a))  # type: ignore[arg-type]
                v = b
            else:
                return miss("Where before the Softmax does not fill with a large negative constant")
        else:
            inner, factor, _ = _peel_scale(node.outputs[0])
            if inner is node.outputs[0]:
                return miss(f"{node.op_type} before the Softmax is not by a constant scalar")
            scale *= factor
            scaled = True
            v = inner
    q_side, k_side = node.inputs
    q, cq, _ = _peel_scale(q_side)
    kt, ck, _ = _peel_scale(k_side)
    k_3d = _unflattened_k(kt)
    tr = _prod(kt, "Transpose")
    k: ir.Value | None
    if k_3d is not None:
        k, ck2, perm = k_3d, 1.0, [0, 1, 3, 2]
    elif tr is None:
        return miss("K^T is not a Transpose of K")
    else:
        perm = list(tr.attributes.get_ints("perm", []))
        if perm not in ([0, 1, 3, 2], [0, 2, 3, 1]):
            return miss(
                f"K is transposed with perm {perm}, not [0, 1, 3, 2] (or [0, 2, 3, 1] from BSHD)"
            )
        k, ck2, _ = _peel_scale(tr.inputs[0])
    seen.append("K^T of K")
    k_axes = (1, 3) if perm == [0, 1, 3, 2] else (2, 3)  # where K's heads / head dim sit
    value = mm.inputs[1]
    for name, t in (("Q", q), ("K", k), ("V", value)):
        if t is None or t.shape is None or t.shape.rank() != 4:
            return miss(f"{name} is not 4-D [B, H, S, D] (shape unknown or packed)")
    h, hk, hv = static_dim(q, 1), static_dim(k, k_axes[0]), static_dim(value, 1)
    if not h or not hk or hk != hv or h % hk:
        return miss(f"head counts unknown or incompatible (H={h}, Hk={hk}, Hv={hv})")
    dq, dk = static_dim(q, 3), static_dim(k, k_axes[1])
    if dq is not None and dk is not None and dq != dk:
        return miss(f"Q head dim {dq} != K head dim {dk}")
    return {
        "q": q,
        "k": k,
        "k_bshd": perm == [0, 2, 3, 1],  # K given as [B, S, Hk, Dh]: transpose it to BHSD
        "v": value,
        "terms": terms,
        "scale": scale * cq * ck * ck2,
        "softmax": softmax,
        "matmul": mm,
    }


def _bias(tape: ir.tape.Tape, terms: list[tuple[str, ir.Value, ir.Value | None]]):
    lowest = float(np.finfo(np.float32).min)
    total: ir.Value | None = None
    for kind, value, _fill in terms:
        if kind == "mask01":  # 1 keeps the score, 0 masks it
            value = tape.op("Cast", [value], {"to": ir.DataType.BOOL})
            kind = "where"
        if kind in ("where", "where_masked"):
            zero = tape.op("Constant", [], {"value": ir.tensor(np.asarray(0.0, np.float32))})
            low = tape.op("Constant", [], {"value": ir.tensor(np.asarray(lowest, np.float32))})
            pair = [zero, low] if kind == "where" else [low, zero]
            term = tape.op("Where", [value, *pair])
        else:
            term = value
            where = _prod(value, "Where")
            fill = eval_scalar(where.inputs[2]) if where is not None else None
            if where is not None and fill is not None and np.isneginf(fill):
                # Where(c, 0, -inf): same mask with a finite fill (no NaN rows).
                low = tape.op("Constant", [], {"value": ir.tensor(np.asarray(lowest, np.float32))})
                term = tape.op("Where", [where.inputs[0], where.inputs[1], low])
        total = term if total is None else tape.op("Add", [total, term])
    return total


def _rows_per_query(tape: ir.tape.Tape, bias: ir.Value, q: ir.Value) -> ir.Value:
    """Broadcast the mask's query axis to S: onnxruntime's CPU Attention-23 wants a mask
    [.., S, T], while a padding-only mask (BERT-style blocks) is [B, 1, 1, T]."""
    ones = tape.op("Constant", [], {"value": ir.tensor(np.asarray([1, 1], np.int64))})
    one = tape.op("Constant", [], {"value": ir.tensor(np.asarray([1], np.int64))})
    rows = tape.op("Shape", [q], {"start": 2, "end": 3})
    shape = tape.op("Concat", [ones, rows, one], {"axis": 0})
    return tape.op("Expand", [bias, shape])


def fuse_sdpa(model: ir.Model) -> dict[str, Any]:
    """Rewrite every matching Softmax attention in the main graph; report fused and refused."""
    graph = model.graph
    fused: list[dict[str, Any]] = []
    rejected: list[dict[str, str]] = []
    for softmax in [n for n in graph if n.op_type == "Softmax" and n.domain in ("", "ai.onnx")]:
        m = match_sdpa(softmax)
        if isinstance(m, str):
            rejected.append(
                {"node": softmax.name or "", "reason": str(m), "matched": getattr(m, "matched", "")}
            )
            continue
        mm: ir.Node = m["matmul"]
        tape = ir.tape.Tape()
        bias = _bias(tape, m["terms"])
        if bias is not None:
            bias = _rows_per_query(tape, bias, m["q"])
        k = tape.op("Transpose", [m["k"]], {"perm": [0, 2, 1, 3]}) if m["k_bshd"] else m["k"]
        attn = ir.node(
            "Attention",
            [m["q"], k, m["v"], *([bias] if bias is not None else [])],
            attributes={"scale": float(m["scale"])},
            name=f"{softmax.name or 'attention'}_sdpa",
        )
        for n in [*tape.nodes, attn]:
            graph.insert_before(mm, n)
        out = attn.outputs[0]
        old = mm.outputs[0]
        out.type, out.shape = old.type, old.shape
        ir.convenience.replace_all_uses_with(old, out, replace_graph_outputs=True)
        name = old.name
        old.name = f"{name}__unfused"
        out.name = name
        fused.append({"node": attn.name or "", "scale": round(float(m["scale"]), 6)})
    if fused:
        from onnx_ir.passes.common import RemoveUnusedNodesPass

        RemoveUnusedNodesPass()(model)
    return {"fused": fused, "rejected": rejected}
