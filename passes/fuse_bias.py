"""Fold a projection's bias Add into the onnxruntime kernel that consumes it (cpu/cuda only).

    Gelu(x + b, approximate="tanh")           -> com.microsoft.FastGelu(x, b)
    Gelu(x + b)  (erf)                        -> com.microsoft.BiasGelu(x, b)
    SkipLayerNormalization(x + b, skip, g, beta) -> SkipLayerNormalization(x, skip, g, beta, b)
    SkipSimplifiedLayerNormalization(x + b, skip, g) -> ...(x, skip, g, b)
x: [B, S, D] (any rank >= 1, last dim D); b: a constant [D]. The residual Add is symmetric, so a
bias on the `skip` side is moved to the bias slot as well. Conditions: b is a 1-D initializer
or constant whose length equals x's static last dim (from x's shape or its MatMul weight), x is
not itself a constant, and
x + b has no other use (the rewriter refuses a match whose intermediate value escapes).

Why: GPT-2-style models carry a bias on every projection. onnxruntime's own optimizer
(`onnxruntime.transformers.optimizer`) writes these fused ops into the saved graph; doing the
same keeps the artifact's op counts comparable and saves one elementwise pass per projection
on runtimes that do not re-fuse at session creation (ORT_DISABLE_ALL, other EPs).
Runs after `lower` and `cleanup` (cleanup turns TorchScript's Gemm into MatMul + Add).
"""

from __future__ import annotations

import logging

import onnx_ir as ir
from onnxscript.rewriter import pattern as orp

from specport.passes._rules import ReasonedRule, RuleFusionPass

logger = logging.getLogger(__name__)

MS = "com.microsoft"


def _last_dim(x: ir.Value) -> int | None:
    """x's static last dim, from its shape or else from the MatMul weight that produced it."""
    if x.shape is not None and x.shape.rank() and isinstance(x.shape[-1], int):
        return x.shape[-1]
    node = x.producer()
    if node is not None and node.op_type == "MatMul" and node.domain in ("", "ai.onnx"):
        w = node.inputs[1]
        if w is not None and w.shape is not None and w.shape.rank() >= 2:
            d = w.shape[-1]
            return d if isinstance(d, int) else None
    return None


def _bias_reason(x: ir.Value, b: ir.Value) -> str | None:
    """None when `b` is a constant per-channel bias for activation `x`, else why not."""
    if b.const_value is None:
        return "addend is not a constant (a residual, not a bias)"
    if x.const_value is not None:
        return "both addends are constants"
    shape = b.const_value.shape
    if len(shape) != 1:
        return f"bias is not 1-D (shape {list(shape)})"
    d = _last_dim(x)
    if d is None:  # a length-1 bias would broadcast in Add but not in the fused kernels
        return "last dim of the biased activation unknown"
    if d != shape[0]:
        return f"bias length {shape[0]} != last dim {d}"
    return None


class BiasGeluFusion(ReasonedRule):
    """Gelu(x + b) -> FastGelu(x, b) (tanh) or BiasGelu(x, b) (erf)."""

    def pattern(self, op, x, b):
        return op.Gelu(op.Add(x, b), _allow_other_attributes=True, _outputs=["y"])

    def check(self, context, x, b, y, **_):
        reason = _bias_reason(x, b)
        return self.fail(reason, b) if reason else orp.MatchResult()

    def rewrite(self, op, x, b, y, **_):
        approx = y.producer().attributes.get_string("approximate", "none")
        if approx == "tanh":
            return op.FastGelu(x, b, _domain=MS)
        return op.BiasGelu(x, b, _domain=MS)


class SkipNormBiasFusion(ReasonedRule):
    """A Skip(Simplified)LayerNormalization with no bias yet and a bias Add on one addend.

    `bias_slot`: the bias input's index (4 after gamma, beta; 3 for the simplified form).
    `skip_side`: the Add feeds the `skip` input instead of `input` (the sum is symmetric).
    """

    def __init__(self, op_type: str, bias_slot: int, skip_side: bool, name: str) -> None:
        super().__init__(name, commute=True)
        self.op_type = op_type
        self.bias_slot = bias_slot
        self.skip_side = skip_side

    def pattern(self, op, x, b, other):
        biased = op.Add(x, b)
        a, c = (other, biased) if self.skip_side else (biased, other)
        return getattr(op, self.op_type)(
            a,
            c,
            _domain=MS,
            _allow_other_inputs=True,
            _allow_other_attributes=True,
            _outputs=["y", "mean", "inv_std", "sum"],
        )

    def check(self, context, x, b, y, **_):
        inputs = y.producer().inputs
        if len(inputs) > self.bias_slot and inputs[self.bias_slot] is not None:
            return self.fail(f"{self.op_type} already has a bias", y)
        reason = _bias_reason(x, b)
        return self.fail(reason, b) if reason else orp.MatchResult()

    def rewrite(self, op, x, b, other, y, **_):
        node = y.producer()
        params = list(node.inputs[2 : self.bias_slot])
        params += [None] * (self.bias_slot - 2 - len(params))  # absent beta stays absent
        return getattr(op, self.op_type)(
            x, other, *params, b, **_attrs(node), _domain=MS, _outputs=4
        )


def _attrs(node: ir.Node) -> dict[str, float]:
    eps = node.attributes.get("epsilon")
    return {} if eps is None else {"epsilon": eps.as_float()}


class FuseBiasPass(RuleFusionPass):
    name = "fuse_bias"
    anchors = ("Gelu", "SkipLayerNormalization", "SkipSimplifiedLayerNormalization")

    def make_rules(self):
        return [
            BiasGeluFusion(name="bias_gelu", commute=True),
            SkipNormBiasFusion("SkipLayerNormalization", 4, False, "skip_ln_bias"),
            SkipNormBiasFusion("SkipLayerNormalization", 4, True, "skip_ln_bias_skip"),
            SkipNormBiasFusion("SkipSimplifiedLayerNormalization", 3, False, "skip_rms_bias"),
            SkipNormBiasFusion("SkipSimplifiedLayerNormalization", 3, True, "skip_rms_bias_skip"),
        ]

    def rewrite(self, model: ir.Model):
        modified, details = super().rewrite(model)
        if modified:
            model.opset_imports.setdefault(MS, 1)
        return modified, details
