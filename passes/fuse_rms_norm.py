"""Fuse RMS normalisation into specport.RMSNorm.

Matches two forms:
    standard  ai.onnx RMSNormalization-23(x, scale; axis=-1)   (torch dynamo export)
    decomposed x * (1 / sqrt(mean(x^2) + eps)) * w  with Pow/Mul, Div/Reciprocal variants
              (TorchScript export, older exporters)
Contract of the result: see custom_ops/rms_norm.py.

Also (same pass, since it is the same statistics): decomposed LayerNorm below opset 17
    (x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps) * w + b  ->  ai.onnx LayerNormalization
(TorchScript GPT-2 exports at opset 14, onnxruntime's gpt2 helper layout).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern as orp

from specport.custom_ops import DOMAIN
from specport.passes._rules import ReasonedRule, RuleFusionPass

logger = logging.getLogger(__name__)


def _scalar(value: ir.Value | None) -> float | None:
    if value is None or value.const_value is None:
        return None
    arr = value.const_value.numpy()
    return float(arr.reshape(-1)[0]) if arr.size == 1 else None


class StandardRMSNormFusion(ReasonedRule):
    def pattern(self, op, x, scale):
        return op.RMSNormalization(x, scale, _allow_other_attributes=True, _outputs=["y"])

    def check(self, context, x, scale, y, **_):
        node = y.producer()
        axis = node.attributes.get_int("axis", -1)
        rank = x.shape.rank() if x.shape is not None else None
        if axis != -1 and (rank is None or axis != rank - 1):
            return self.fail(f"axis={axis} is not the last axis", y)
        if scale.shape is not None and scale.shape.rank() != 1:
            return self.fail("scale is not 1-D", scale)
        return orp.MatchResult()

    def rewrite(self, op, x, scale, y, **_):
        eps = y.producer().attributes.get_float("epsilon", 1e-5)
        return op.RMSNorm(x, scale, epsilon=eps, _domain=DOMAIN)


class DecomposedRMSNormFusion(ReasonedRule):
    """x * rsqrt(mean(x*x) + eps) * w in its usual spellings."""

    def __init__(self, square: str, inv: str, axes_input: bool, **kw):
        tag = "" if axes_input else "_axes_attr"
        super().__init__(name=f"decomposed_rms_norm_{square}_{inv}{tag}", **kw)
        self._square, self._inv, self._axes_input = square, inv, axes_input

    def pattern(self, op, x, two, axes, eps, one, w):
        sq = op.Pow(x, two) if self._square == "pow" else op.Mul(x, x)
        if self._axes_input:
            ms = op.ReduceMean(sq, axes, _allow_other_attributes=True, _outputs=["mean"])
        else:  # opset < 18: axes is an attribute
            ms = op.ReduceMean(sq, _allow_other_attributes=True, _outputs=["mean"])
        root = op.Sqrt(op.Add(ms, eps))
        inv = op.Div(one, root) if self._inv == "div" else op.Reciprocal(root)
        return op.Mul(w, op.Mul(x, inv))

    def check(self, context, x, two, axes, eps, one, w, mean, **_):
        if self._square == "pow" and _scalar(two) != 2.0:
            return self.fail("exponent is not the constant 2", two)
        if self._inv == "div" and _scalar(one) != 1.0:
            return self.fail("numerator is not the constant 1", one)
        if _scalar(eps) is None:
            return self.fail("epsilon is not a constant scalar", eps)
        if mean.producer().attributes.get_int("keepdims", 1) != 1:
            return self.fail("ReduceMean without keepdims", mean)
        if self._axes_input:
            ax = axes.const_value.numpy().reshape(-1).tolist() if axes.const_value else None
        else:
            attr = mean.producer().attributes.get("axes")
            ax = list(attr.value) if attr is not None else None
        rank = x.shape.rank() if x.shape is not None else None
        if ax is None or len(ax) != 1 or not (ax[0] == -1 or (rank and ax[0] == rank - 1)):
            return self.fail(f"reduces over {ax}, not the last axis", mean)
        if w.const_value is None or w.const_value.numpy().ndim != 1:
            return self.fail("scale is not a 1-D initializer", w)
        return orp.MatchResult()

    def rewrite(self, op, x, eps, w, **_):
        return op.RMSNorm(x, w, epsilon=float(np.float32(_scalar(eps))), _domain=DOMAIN)


class DecomposedLayerNormFusion(ReasonedRule):
    """(x - mean) / sqrt(var + eps) * w + b over the last axis -> LayerNormalization.

    `with_eps=False`: the `+ eps` is gone (BERT's eps 1e-12 folded away by the TorchScript
    exporter), which is LayerNormalization with epsilon 0."""

    def __init__(self, name: str, commute: bool = False, with_eps: bool = True) -> None:
        super().__init__(name, commute)
        self.with_eps = with_eps

    def pattern(self, op, x, ax1, two, ax2, eps, w, b):
        d = op.Sub(x, op.ReduceMean(x, ax1, _outputs=["mean"]))
        var = op.ReduceMean(op.Pow(d, two), ax2, _outputs=["var"])
        std = op.Sqrt(op.Add(var, eps) if self.with_eps else var)
        return op.Add(op.Mul(op.Div(d, std), w), b)

    def check(self, context, x, ax1, two, ax2, w, b, mean, var, eps=None, **_):
        if _scalar(two) != 2.0:
            return self.fail("exponent is not the constant 2", two)
        if self.with_eps and _scalar(eps) is None:
            return self.fail("epsilon is not a constant scalar", eps)
        rank = x.shape.rank() if x.shape is not None else None
        for axes, red in ((ax1, mean), (ax2, var)):
            ax = axes.const_value.numpy().reshape(-1).tolist() if axes.const_value else None
            if ax is None or len(ax) != 1 or not (ax[0] == -1 or (rank and ax[0] == rank - 1)):
                return self.fail(f"reduces over {ax}, not the last axis", red)
            if red.producer().attributes.get_int("keepdims", 1) != 1:
                return self.fail("ReduceMean without keepdims", red)
        for name, t in (("scale", w), ("bias", b)):
            if t.const_value is None or t.const_value.numpy().ndim != 1:
                return self.fail(f"{name} is not a 1-D initializer", t)
        return orp.MatchResult()

    def rewrite(self, op, x, w, b, eps=None, **_):
        eps_f = float(np.float32(_scalar(eps))) if self.with_eps else 0.0
        return op.LayerNormalization(x, w, b, axis=-1, epsilon=eps_f)


class FuseRMSNormPass(RuleFusionPass):
    name = "fuse_rms_norm"
    anchors = ("RMSNormalization", "ReduceMean")

    def make_rules(self):
        rules: list[ReasonedRule] = [
            StandardRMSNormFusion(name="standard_rms_norm"),
            DecomposedLayerNormFusion(name="decomposed_layer_norm", commute=True),
            DecomposedLayerNormFusion("decomposed_layer_norm_no_eps", True, with_eps=False),
        ]
        for square in ("pow", "mul"):
            for inv in ("div", "reciprocal"):
                for axes_input in (True, False):
                    rules.append(DecomposedRMSNormFusion(square, inv, axes_input, commute=True))
        return rules
