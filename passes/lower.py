"""Lower specport ops to a target (see custom_ops/lowering.py) as a pipeline pass."""

from __future__ import annotations

import logging
from typing import Any

import onnx_ir as ir

from specport.custom_ops.lowering import lower_model
from specport.passes.base import Pass

logger = logging.getLogger(__name__)


class LowerPass(Pass):
    name = "lower"

    def __init__(self, target: str, **options: Any) -> None:
        self.target = target
        self.options = options

    def rewrite(self, model: ir.Model) -> tuple[bool, dict[str, Any]]:
        report = lower_model(model, self.target, **self.options)
        changed = bool(report.get("lowered") or report.get("inlined") or self.target == "neutral")
        return changed, report
