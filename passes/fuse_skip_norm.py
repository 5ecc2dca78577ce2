"""Fuse the residual Add into the following norm: specport.SkipRMSNorm / specport.SkipLayerNorm.

    s = a + b;  y = RMSNorm(s)                 -> y, s = SkipRMSNorm(a, b, w)
    s = a + b;  y = LayerNormalization(s, g, b) -> y, s = SkipLayerNorm(a, b, g, beta)  (GPT-2)
Both addends must have the same shape [B, S, D] (a bias-broadcast Add is not a residual).
Run after fuse_rms_norm.
"""

from __future__ import annotations

import logging

import onnx_ir as ir
from onnxscript.rewriter import pattern as orp

from specport.custom_ops import DOMAIN
from specport.passes._rules import ReasonedRule, RuleFusionPass

logger = logging.getLogger(__name__)


def _same_shape(a: ir.Value, b: ir.Value) -> bool:
    """Residual addends: equal known shapes; with shapes unknown, two computed activations
    (a constant addend is a bias, not a residual)."""
    if a.const_value is not None or b.const_value is not None:
        return False
    if a.shape is None or b.shape is None:
        return True
    if a.shape.rank() != b.shape.rank() or a.shape.rank() < 2:
        return False
    # Symbolic dims from different exporters rarely share names: compare static dims only.
    pairs = zip(a.shape.dims, b.shape.dims)
    return all(x == y for x, y in pairs if isinstance(x, int) and isinstance(y, int))


class SkipRMSNormFusion(ReasonedRule):
    def pattern(self, op, a, b, w):
        s = op.Add(a, b, _outputs=["s"])
        y = op.RMSNorm(s, w, _domain=DOMAIN, _allow_other_attributes=True, _outputs=["y"])
        return y, s

    def check(self, context, a, b, s, y, **_):
        if not _same_shape(a, b):
            return self.fail("addends differ in rank or static dims (not a residual add)", s)
        return orp.MatchResult()

    def rewrite(self, op, a, b, w, y, **_):
        eps = y.producer().attributes.get_float("epsilon", 1e-6)
        return op.SkipRMSNorm(a, b, w, epsilon=eps, _domain=DOMAIN, _outputs=2)


class SkipLayerNormFusion(ReasonedRule):
    def pattern(self, op, a, b, g, beta):
        s = op.Add(a, b, _outputs=["s"])
        y = op.LayerNormalization(s, g, beta, _allow_other_attributes=True, _outputs=["y"])
        return y, s

    def check(self, context, a, b, s, y, **_):
        node = y.producer()
        if len(node.outputs) > 1 and any(o.uses() for o in node.outputs[1:]):
            return self.fail("LayerNormalization mean/inv_std outputs are used", y)
        if node.attributes.get_int("axis", -1) not in (-1, (a.shape.rank() - 1) if a.shape else -1):
            return self.fail("LayerNormalization not over the last axis", y)
        if not _same_shape(a, b):
            return self.fail("addends differ in rank or static dims (not a residual add)", s)
        return orp.MatchResult()

    def rewrite(self, op, a, b, g, beta, y, **_):
        eps = y.producer().attributes.get_float("epsilon", 1e-5)
        return op.SkipLayerNorm(a, b, g, beta, epsilon=eps, _domain=DOMAIN, _outputs=2)


class FuseSkipNormPass(RuleFusionPass):
    name = "fuse_skip_norm"
    anchors = ("RMSNorm", "LayerNormalization")

    def make_rules(self):
        return [
            SkipRMSNormFusion(name="skip_rms_norm", commute=False),
            SkipLayerNormFusion(name="skip_layer_norm", commute=False),
        ]
