"""Shared plumbing for rule-based fusion passes: apply onnxscript rules and collect reasons.

Why: `Pass.report` must say what matched and what did not. onnxscript's `RewriteRuleSet`
returns only a count, so our rule classes record every `check` rejection in `rejections`
(reason + value name) and `RuleFusionPass` copies them into the report.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import pattern as orp
from onnxscript.rewriter._rewrite_rule import RewriteRule, RewriteRuleClassBase, RewriteRuleSet

from specport.passes.base import Pass

logger = logging.getLogger(__name__)


class ReasonedRule(RewriteRuleClassBase):
    """A rule whose `fail(reason, value)` is remembered for the pass report."""

    def __init__(self, name: str | None = None, commute: bool = False) -> None:
        super().__init__(name)
        self.commute = commute
        self.rejections: list[dict[str, str]] = []

    def as_rule(self) -> RewriteRule:
        """A RewriteRule bound to this instance (so rejections land here)."""
        return RewriteRule(self.pattern, self.rewrite, self.check, name=self.name)

    def fail(self, reason: str, value: ir.Value | None = None) -> orp.MatchResult:
        self.rejections.append(
            {"rule": self.name, "reason": reason, "at": getattr(value, "name", "") or ""}
        )
        return orp.MatchResult().fail(reason, value)


class RuleFusionPass(Pass):
    """Apply a list of `ReasonedRule`s until nothing matches; report counts and rejections."""

    rules: list[ReasonedRule] = []
    anchors: tuple[str, ...] = ()  # op types that signal a candidate, for "seen but not fused"

    def make_rules(self) -> list[ReasonedRule]:
        raise NotImplementedError

    def rewrite(self, model: ir.Model) -> tuple[bool, dict[str, Any]]:
        rules = self.make_rules()
        seen = Counter(n.op_type for n in model.graph.all_nodes() if n.op_type in self.anchors)
        counts: dict[str, int] = {}
        for rule in rules:
            rule_set = RewriteRuleSet([rule.as_rule()], commute=rule.commute)
            counts[rule.name] = rule_set.apply_to_model(model)
        total = sum(counts.values())
        rejections: list[dict[str, str]] = []
        for rule in rules:
            uniq = {(r["reason"], r["at"]) for r in rule.rejections}
            rejections += [{"rule": rule.name, "reason": a, "at": b} for a, b in sorted(uniq)][:10]
        details: dict[str, Any] = {"matched": counts, "candidates": dict(seen)}
        if rejections:
            details["rejected"] = rejections
        if not total:
            details["note"] = "nothing fused: " + (
                "no candidate ops" if not seen else "see 'rejected'"
            )
        return total > 0, details
