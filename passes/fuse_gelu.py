"""Fuse GELU into ai.onnx Gelu-20: the tanh approximation (GPT-2's `gelu_new`) and the exact
erf form (BERT's `gelu`).

    0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))  ->  Gelu(x, approximate="tanh")
    x * (1 + erf(x / sqrt(2))) * 0.5                          ->  Gelu(x)

A standard op (opset 20), so no custom op is needed: onnxruntime's CPU/CUDA kernels run it. Not
in the CANN pipeline (the CANN EP has no Gelu kernel; the decomposed form maps to its kernels).
SwiGLU (silu(gate) * up) is left as is: onnxruntime has no standalone SwiGLU kernel outside MoE.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from onnxscript.rewriter import pattern as orp

from specport.passes._rules import ReasonedRule, RuleFusionPass
from specport.passes.fuse_rms_norm import _scalar

logger = logging.getLogger(__name__)

_C = math.sqrt(2.0 / math.pi)


class TanhGeluFusion(ReasonedRule):
    def pattern(self, op, x, half, three, k, c, one):
        inner = op.Mul(op.Add(x, op.Mul(op.Pow(x, three), k)), c)
        return op.Mul(op.Mul(x, half), op.Add(op.Tanh(inner), one))

    def check(self, context, half, three, k, c, one, **_):
        expect = {"0.5": (half, 0.5), "3": (three, 3.0), "0.044715": (k, 0.044715)}
        expect.update({"sqrt(2/pi)": (c, _C), "1": (one, 1.0)})
        return _check_constants(self, expect)

    def rewrite(self, op, x, **_):
        return op.Gelu(x, approximate="tanh")


class ErfGeluFusion(ReasonedRule):
    """BERT's exact GELU as TorchScript exports it: x * (1 + erf(x / sqrt(2))) * 0.5."""

    def pattern(self, op, x, root2, one, half):
        return op.Mul(op.Mul(x, op.Add(op.Erf(op.Div(x, root2)), one)), half)

    def check(self, context, root2, one, half, **_):
        expect = {"sqrt(2)": (root2, math.sqrt(2.0)), "1": (one, 1.0), "0.5": (half, 0.5)}
        return _check_constants(self, expect)

    def rewrite(self, op, x, **_):
        return op.Gelu(x)


class FuseGeluPass(RuleFusionPass):
    name = "fuse_gelu"
    anchors = ("Tanh", "Erf")

    def make_rules(self):
        return [
            TanhGeluFusion(name="tanh_gelu", commute=True),
            ErfGeluFusion(name="erf_gelu", commute=True),
        ]


def _check_constants(rule: ReasonedRule, expect: dict[str, tuple[Any, float]]) -> Any:
    """Each named constant of a GELU pattern equals its value (to 1e-5, relative), or the
    rule fails naming the first that does not."""
    for label, (value, want) in expect.items():
        got = _scalar(value)
        if got is None or abs(got - want) > 1e-5 * max(1.0, abs(want)):
            return rule.fail(f"constant {label} is {got}", value)
    return orp.MatchResult()
