"""Fuse rotary embeddings into specport.RotaryEmbedding.

Contract of the result (custom_ops/rotary_embedding.py): RotaryEmbedding(x [B, H, S, Dh],
cos [B, S, R/2], sin [B, S, R/2]) -> [B, H, S, Dh], half-split ("neox") layout.

Matches two spellings:
    standard    ai.onnx RotaryEmbedding-23, 4-D input, cos/sin [B, S, R/2] (torch dynamo export
                of Llama-family RoPE, full or partial)
    rotate_half x * Unsqueeze(cos, 1) + Concat(-x[..., h:], x[..., :h]) * Unsqueeze(sin, 1)
                with cos/sin [B, S, Dh] built as Cos/Sin(Concat(f, f)) (TorchScript exports:
                Optimum's Llama, Qwen2, Phi-3); the fused node takes cos[..., :Dh/2].
Interleaved (GPT-J) layout, the 3-D packed form, partial rotary in the decomposed spelling and
cos/sin whose halves are not provably equal are left alone and reported.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern as orp

from specport.custom_ops import DOMAIN
from specport.passes._rules import ReasonedRule, RuleFusionPass
from specport.passes._shapes import eval_const, static_dim

logger = logging.getLogger(__name__)

INT_MAX = 2**62  # Slice ends at or beyond this read "to the end"


class StandardRotaryFusion(ReasonedRule):
    def pattern(self, op, x, cos, sin):
        return op.RotaryEmbedding(x, cos, sin, _allow_other_attributes=True, _outputs=["y"])

    def check(self, context, x, cos, sin, y, **_):
        node = y.producer()
        if len(node.inputs) > 3 and node.inputs[3] is not None:
            return self.fail("position_ids input (cos/sin caches) form not supported", y)
        if node.attributes.get_int("interleaved", 0):
            return self.fail("interleaved rotary layout not supported", y)
        if x.shape is None or x.shape.rank() != 4:
            return self.fail("input is not 4-D [B, H, S, Dh]", x)
        if cos.shape is not None and cos.shape.rank() != 3:
            return self.fail("cos is not 3-D [B, S, R/2]", cos)
        rdim = node.attributes.get_int("rotary_embedding_dim", 0)
        half = cos.shape[-1] if cos.shape is not None else None
        if rdim and isinstance(half, int) and rdim != 2 * half:
            return self.fail(f"rotary_embedding_dim {rdim} != 2 * cos width {half}", cos)
        return orp.MatchResult()

    def rewrite(self, op, x, cos, sin, **_):
        return op.RotaryEmbedding(x, cos, sin, _domain=DOMAIN)


def _ints(v: ir.Value | None) -> list[int] | None:
    arr = eval_const(v)
    return None if arr is None else [int(a) for a in arr.reshape(-1)]


def _duplicated_halves(v: ir.Value | None) -> bool:
    """cos/sin = Cos/Sin(Concat(f, f, axis=-1)), possibly scaled by a constant: both halves of
    the last axis are equal, so the first half carries everything."""
    node = v.producer() if v is not None else None
    while node is not None and node.op_type in ("Mul", "Cast", "Identity") and node.domain == "":
        if node.op_type == "Mul" and not any(
            i is not None and i.const_value is not None for i in node.inputs
        ):
            return False
        v = next(i for i in node.inputs if i is not None and i.const_value is None)
        node = v.producer()
    if node is None or node.op_type not in ("Cos", "Sin"):
        return False
    cat = node.inputs[0].producer() if node.inputs[0] is not None else None
    if cat is None or cat.op_type != "Concat" or len(cat.inputs) != 2:
        return False
    return cat.inputs[0] is cat.inputs[1] and cat.attributes.get_int("axis", 0) in (-1, 2)


def _unsqueezed(v: ir.Value | None) -> tuple[ir.Value, ir.Value] | None:
    node = v.producer() if v is not None else None
    if node is None or node.op_type != "Unsqueeze" or node.domain != "" or len(node.inputs) < 2:
        return None
    return node.inputs[0], node.inputs[1]  # type: ignore[return-value]


class RotateHalfFusion(ReasonedRule):
    """HF's apply_rotary_pos_emb: q * cos + rotate_half(q) * sin, as TorchScript writes it."""

    def pattern(self, op, x, c4, s4, s1, e1, a1, s2, e2, a2):
        # c4/s4 = Unsqueeze(cos/sin, 1) are shared by the Q and K rotations: inputs, not matched
        x1 = op.Slice(x, s1, e1, a1, _allow_other_inputs=True)
        x2 = op.Slice(x, s2, e2, a2, _allow_other_inputs=True)
        rot = op.Concat(op.Neg(x2), x1, _outputs=["rot"])
        return op.Add(op.Mul(x, c4), op.Mul(rot, s4))

    def check(self, context, x, c4, s4, s1, e1, a1, s2, e2, a2, rot, **_):
        unsq = [_unsqueezed(c4), _unsqueezed(s4)]
        if unsq[0] is None or unsq[1] is None:
            return self.fail("cos/sin are not Unsqueeze(cos, 1) / Unsqueeze(sin, 1)", c4)
        (cos, ax_c), (sin, ax_s) = unsq  # type: ignore[misc]
        dh = static_dim(x, -1)
        if x.shape is None or x.shape.rank() != 4 or dh is None:
            return self.fail("input is not 4-D [B, H, S, Dh] with a known head dim", x)
        if rot.producer().attributes.get_int("axis", 0) not in (-1, 3):
            return self.fail("rotate_half does not concatenate on the last axis", rot)
        vals = {k: _ints(v) for k, v in dict(s1=s1, e1=e1, a1=a1, s2=s2, e2=e2).items()}
        vals.update(a2=_ints(a2), c=_ints(ax_c), s=_ints(ax_s))
        if any(v is None or len(v) != 1 for v in vals.values()):
            return self.fail("slice bounds / axes are not constants (or computable)", x)
        v = {k: val[0] for k, val in vals.items()}  # type: ignore[index]
        half = dh // 2
        if v["a1"] not in (3, -1) or v["a2"] not in (3, -1):
            return self.fail("slices are not on the head-dim axis", x)
        if (v["s1"], v["e1"], v["s2"]) != (0, half, half) or v["e2"] < dh:
            return self.fail(f"slices are not [:{half}] and [{half}:] (partial rotary)", x)
        if v["c"] not in (1, -3) or v["s"] not in (1, -3):
            return self.fail("cos/sin are not unsqueezed on the head axis", cos)
        for name, t in (("cos", cos), ("sin", sin)):
            if t.shape is None or t.shape.rank() != 3 or static_dim(t, -1) != dh:
                return self.fail(f"{name} is not [B, S, Dh]", t)
            if not _duplicated_halves(t):
                return self.fail(f"{name} halves are not provably equal (Cos/Sin(Concat(f, f)))", t)
        return orp.MatchResult()

    def rewrite(self, op, x, c4, s4, **_):
        dh = static_dim(x, -1)
        assert dh is not None
        cos, sin = c4.producer().inputs[0], s4.producer().inputs[0]
        start = op.Constant(value=ir.tensor(np.asarray([0], np.int64)))
        end = op.Constant(value=ir.tensor(np.asarray([dh // 2], np.int64)))
        axis = op.Constant(value=ir.tensor(np.asarray([-1], np.int64)))
        cos_h = op.Slice(cos, start, end, axis)
        sin_h = op.Slice(sin, start, end, axis)
        return op.RotaryEmbedding(x, cos_h, sin_h, _domain=DOMAIN)


def _annotate(model: ir.Model) -> None:
    """Give the half-width cos/sin made by RotateHalfFusion a shape (lowering reads R/2)."""
    for node in model.graph:
        if node.domain != DOMAIN or node.op_type != "RotaryEmbedding":
            continue
        x = node.inputs[0]
        dh = static_dim(x, -1)
        for v in node.inputs[1:3]:
            src = v.producer() if v is not None else None
            if v is None or v.shape is not None or src is None or src.op_type != "Slice":
                continue
            full = src.inputs[0]
            if full is not None and full.shape is not None and dh:
                v.shape = ir.Shape([*list(full.shape.dims)[:-1], dh // 2])
                v.type = full.type
        out = node.outputs[0]
        if out.shape is None and x is not None:
            out.shape, out.type = x.shape, x.type


class FuseRotaryPass(RuleFusionPass):
    name = "fuse_rotary"
    anchors = ("RotaryEmbedding", "Neg")

    def make_rules(self):
        return [
            StandardRotaryFusion(name="standard_rotary"),
            RotateHalfFusion(name="rotate_half_rotary", commute=True),
        ]

    def rewrite(self, model):
        modified, details = super().rewrite(model)
        if modified:
            _annotate(model)
        return modified, details
