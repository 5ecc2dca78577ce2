"""Graph hygiene around the fusions: opset normalisation before, tidy-up after.

`NormalizePass` upgrades any model to opset 23 (TorchScript exports come at 14-17) so fusion
patterns and our function bodies see one opset, then runs onnxscript's optimizer (constant
folding, no-op removal) without inlining functions. `CleanupPass` removes what lowering leaves:
Transpose pairs that cancel, Reshape chains, dead nodes.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import (
    CommonSubexpressionEliminationPass,
    IdentityEliminationPass,
    RemoveUnusedNodesPass,
)
from onnxscript import optimizer, version_converter
from onnxscript.rewriter import RewriteRuleSet
from onnxscript.rewriter import pattern as orp
from onnxscript.rewriter.rules.common import _basic_rules as basic

from specport.custom_ops.lowering import unique_names
from specport.passes._shapes import infer_shapes
from specport.passes.base import Pass

logger = logging.getLogger(__name__)

OPSET = 23


REDUCE_OPS = ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2")


def _reduce_axes_to_input(model: ir.Model) -> int:
    """Opset 18 moved Reduce* `axes` from attribute to input; finish what the converter left."""
    moved = 0
    for node in list(model.graph.all_nodes()):
        if node.op_type in REDUCE_OPS and node.domain == "" and "axes" in node.attributes:
            axes = list(node.attributes.pop("axes").value)
            const = ir.node("Constant", [], {"value": ir.tensor(np.asarray(axes, np.int64))})
            assert node.graph is not None
            node.graph.insert_before(node, const)
            node.resize_inputs(2)
            node.replace_input_with(1, const.outputs[0])
            moved += 1
    return moved


def _shapes_missing(model: ir.Model) -> bool:
    """True when some node output has no shape or an unnamed unknown dim."""
    for node in model.graph:
        for out in node.outputs:
            if out.shape is None:
                return True
            if any(not isinstance(d, int) and getattr(d, "value", None) is None for d in out.shape):
                return True
    return False


IN_MEMORY_LIMIT = 1 << 30  # inference serializes the graph: weights held in memory are copied


def _needs_shapes(model: ir.Model) -> bool:
    """Shapes are worth inferring for decomposed attention / rotary (a Softmax or a Neg in the
    main graph) with shapes missing, when the copy inference makes is cheap (weights on disk
    stay references; at most 1 GiB held in memory)."""
    if not any(n.op_type in ("Softmax", "Neg") and n.domain == "" for n in model.graph):
        return False
    in_memory = sum(
        v.const_value.nbytes
        for v in model.graph.initializers.values()
        if v.const_value is not None and not isinstance(v.const_value, ir.ExternalTensor)
    )
    return in_memory <= IN_MEMORY_LIMIT and _shapes_missing(model)


class NormalizePass(Pass):
    name = "normalize"

    def rewrite(self, model: ir.Model) -> tuple[bool, dict[str, Any]]:
        before = model.opset_imports.get("", None)
        details: dict[str, Any] = {"opset_before": before}
        if before is not None and before < OPSET:
            version_converter.convert_version(model, target_version=OPSET)
            details["reduce_axes_moved"] = _reduce_axes_to_input(model)
        if _needs_shapes(model):  # TorchScript exports: head counts hide behind Shape math
            details.update(infer_shapes(model))
        optimizer.optimize(model, inline=False)
        details["opset_after"] = model.opset_imports.get("")
        return True, details


class Rotary3DFusion(orp.RewriteRuleClassBase):
    """Reshape->Transpose->RotaryEmbedding-23->Transpose->Reshape  =>  RotaryEmbedding-23 on the
    packed [B, S, H*Dh] tensor (num_heads attribute): what the GQA lowering leaves around RoPE.
    Saves two transposes of Q and K per layer.
    """

    def pattern(self, op, x, shape4, cos, sin, flat):
        t1 = op.Transpose(op.Reshape(x, shape4), perm=[0, 2, 1, 3])
        rot = op.RotaryEmbedding(t1, cos, sin, _allow_other_attributes=True, _outputs=["rot"])
        return op.Reshape(op.Transpose(rot, perm=[0, 2, 1, 3]), flat)

    def check(self, context, x, flat, rot, **_):
        r = orp.MatchResult()
        node = rot.producer()
        if node.attributes.get_int("interleaved", 0):
            return r.fail("interleaved")
        if flat.const_value is None or flat.const_value.numpy().tolist() != [0, 0, -1]:
            return r.fail("not a flatten of the heads", flat)
        if x.shape is None or x.shape.rank() != 3:
            return r.fail("input not 3-D", x)
        if rot.shape is None or rot.shape.rank() != 4 or not isinstance(rot.shape[1], int):
            return r.fail("head count unknown", rot)
        return r

    def rewrite(self, op, x, cos, sin, rot, **_):
        node = rot.producer()
        attrs = {"num_heads": int(rot.shape[1])}
        rdim = node.attributes.get_int("rotary_embedding_dim", 0)
        if rdim:
            attrs["rotary_embedding_dim"] = rdim
        return op.RotaryEmbedding(x, cos, sin, **attrs)


def _same_leading_symbols(out: ir.Value, x: ir.Value) -> bool:
    """`out` and `x` have the same known leading dims (named symbols or ints), as the dynamo
    exporter annotates them: its Conv1D target shape is built from input_ids' shape, not x's."""
    if out.shape is None or x.shape is None or out.shape.rank() != x.shape.rank():
        return False
    for a, b in zip(out.shape.dims[:-1], x.shape.dims[:-1]):
        if isinstance(a, int) or isinstance(b, int):
            if a != b:
                return False
        elif a.value is None or a.value != b.value:
            return False
    return True


def _leading_dims_of(shape: ir.Value, x: ir.Value) -> bool:
    """`shape` = Concat(Unsqueeze(Gather(Shape(x), 0)), ..., Unsqueeze(Gather(Shape(x), r-2)), N):
    x's leading dims and one constant."""
    cat = shape.producer()
    if cat is None or cat.op_type != "Concat" or x.shape is None:
        return False
    parts = list(cat.inputs)
    if len(parts) != x.shape.rank() or parts[-1] is None or parts[-1].const_value is None:
        return False
    for j, part in enumerate(parts[:-1]):
        unsq = part.producer() if part is not None else None
        u_in = unsq.inputs[0] if unsq is not None and unsq.op_type == "Unsqueeze" else None
        gather = u_in.producer() if u_in is not None else None
        g_in = gather.inputs[0] if gather is not None and gather.op_type == "Gather" else None
        src = g_in.producer() if g_in is not None else None
        idx = gather.inputs[1].const_value if gather is not None and gather.inputs[1] else None
        if src is None or src.op_type != "Shape" or src.inputs[0] is not x or src.attributes:
            return False
        if idx is None or int(idx.numpy().reshape(-1)[0]) != j:
            return False
    return True


class Conv1DMatMulFusion(orp.RewriteRuleClassBase):
    """GPT-2's Conv1D as TorchScript writes it: Reshape(Gemm(Reshape(x, [-1, D]), W, b),
    Concat(x.shape[:-1], N)) -> Add(MatMul(x, W), b). Drops the per-projection shape arithmetic
    (a Shape/Gather/Unsqueeze/Concat chain each), which dominates small decode steps. Dynamo's
    spelling builds the target shape from input_ids' dims instead: accepted when the annotated
    leading dims equal x's.
    """

    def pattern(self, op, x, flat, w, shape):
        y = op.Gemm(
            op.Reshape(x, flat),
            w,
            _allow_other_inputs=True,
            _allow_other_attributes=True,
            _outputs=["g"],
        )
        return op.Reshape(y, shape, _outputs=["out"])

    def check(self, context, x, flat, w, shape, g, out, **_):
        r = orp.MatchResult()
        attrs = g.producer().attributes
        if attrs.get_int("transA", 0) or attrs.get_int("transB", 0):
            return r.fail("transposed Gemm")
        if attrs.get_float("alpha", 1.0) != 1.0 or attrs.get_float("beta", 1.0) != 1.0:
            return r.fail("scaled Gemm")
        d = x.shape[-1] if x.shape is not None else None
        if flat.const_value is None or flat.const_value.numpy().tolist() != [-1, d]:
            return r.fail("not a flatten to [-1, D]", flat)
        b = g.producer().inputs[2] if len(g.producer().inputs) > 2 else None
        if b is not None and (b.shape is None or b.shape.rank() != 1):
            return r.fail("bias not 1-D", b)
        if w.shape is None or w.shape.rank() != 2:
            return r.fail("weight not 2-D", w)
        if not (_leading_dims_of(shape, x) or _same_leading_symbols(out, x)):
            return r.fail("output shape is not x's leading dims + N", shape)
        return r

    def rewrite(self, op, x, w, g, **_):
        inputs = g.producer().inputs
        y = op.MatMul(x, w)
        return op.Add(y, inputs[2]) if len(inputs) > 2 and inputs[2] is not None else y


class CleanupPass(Pass):
    name = "cleanup"

    def rewrite(self, model: ir.Model) -> tuple[bool, dict[str, Any]]:
        rules = RewriteRuleSet(
            [
                basic.transpose_transpose_rule,
                basic.reshape_reshape_rule,
                basic.no_op_transpose_rule,
                basic.unsqueeze_unsqueeze_rule,
                Rotary3DFusion().rule(),
                Conv1DMatMulFusion().rule(),
            ]
        )
        count = rules.apply_to_model(model)
        # Each lowered attention derives the same seqlens/bias from the mask: share them.
        CommonSubexpressionEliminationPass()(model)
        IdentityEliminationPass()(model)
        RemoveUnusedNodesPass()(model)
        unique_names(model)  # rewriter names can collide with If-branch names
        return count > 0, {"rewrites": count}
