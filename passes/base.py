"""The pass contract: a small object with a name, a precondition, a rewrite and a report.

Passes work on onnx_ir models in place (like `onnx_ir.passes.InPlacePass`) and return a
`PassResult` whose `report` is plain JSON data: it is copied verbatim into the artifact
manifest, so a reader of `specport.json` can see what each pass matched, what it refused and
why, and the op counts before and after.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx_ir as ir

logger = logging.getLogger(__name__)


def op_counts(model: ir.Model) -> dict[str, int]:
    """Op-type histogram of the main graph and every function (domain-qualified when not ai.onnx)."""
    counts: collections.Counter[str] = collections.Counter()
    graphs: list[Any] = [model.graph, *model.functions.values()]
    for graph in graphs:
        for node in ir.traversal.RecursiveGraphIterator(graph):
            key = (
                node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
            )
            counts[key] += 1
    return dict(sorted(counts.items()))


@dataclass
class PassResult:
    """What a pass did. `report` must be JSON-serialisable."""

    model: ir.Model
    modified: bool
    report: dict[str, Any] = field(default_factory=dict)


class Pass:
    """Base class. Subclasses set `name` and implement `rewrite`; may override `precondition`.

    `__call__` records op counts before/after and wall time around `rewrite`, so every pass
    reports the same basics without repeating the code.
    """

    name: str = "pass"
    activity: str = ""  # what a progress line says while it runs ("quantizing weights")

    def precondition(self, model: ir.Model) -> str | None:
        """Return None when the pass can run, else the reason it cannot (put in the report)."""
        return None

    def rewrite(self, model: ir.Model) -> tuple[bool, dict[str, Any]]:
        """Rewrite `model` in place; return (modified, details for the report)."""
        raise NotImplementedError

    def __call__(self, model: ir.Model) -> PassResult:
        reason = self.precondition(model)
        if reason is not None:
            logger.info("pass %s skipped: %s", self.name, reason)
            return PassResult(model, False, {"name": self.name, "skipped": reason})
        before = op_counts(model)
        t0 = time.perf_counter()
        modified, details = self.rewrite(model)
        elapsed = time.perf_counter() - t0
        after = op_counts(model)
        report = {
            "name": self.name,
            "modified": modified,
            **details,
            "ops_before": before,
            "ops_after": after,
            "seconds": round(elapsed, 3),
        }
        logger.info("pass %s: modified=%s %s", self.name, modified, details)
        return PassResult(model, modified, report)


class Pipeline:
    """An ordered list of passes; the reports are collected in order for the manifest."""

    def __init__(self, passes: Sequence[Pass], name: str = "pipeline") -> None:
        self.passes = list(passes)
        self.name = name

    def __call__(self, model: ir.Model) -> PassResult:
        reports: list[dict[str, Any]] = []
        modified = False
        for p in self.passes:
            result = p(model)
            model = result.model
            modified |= result.modified
            reports.append(result.report)
        return PassResult(model, modified, {"name": self.name, "passes": reports})

    def names(self) -> list[str]:
        return [p.name for p in self.passes]


def reports_of(results: Iterable[PassResult]) -> list[dict[str, Any]]:
    return [r.report for r in results]
