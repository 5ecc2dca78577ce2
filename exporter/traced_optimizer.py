"""What torch's `ONNXProgram.optimize()` does to a freshly traced graph, in linear time.

torch's exporter optimizes with onnxscript: `optimizer.optimize_ir` (constant folding, the
default rewrite rules, dead-code and duplicate removal), then the opset-23 fusions
(RMSNormalization, RotaryEmbedding, GQA). One default rule, `SlicesSplit`, has a two-node
pattern, and onnxscript matches those by indexing every node of the graph for each node it
tries: quadratic in the graph's size. On SmolLM2-135M (30 layers, ~10k nodes) that rule alone
cost 77 s of a 193 s export (cProfile: 39 M node visits in the matcher), and an 8B model's
trace pays more. It never rewrites a torch export: its pattern is a 4-input `Slice`, and
torch writes every `Slice` with its 5th (`steps`) input.

So the same passes run here with the default rules less that one. If a later onnxscript moves
the pieces this relies on, `optimize_traced` falls back to exactly what torch runs.
"""

from __future__ import annotations

import logging
from typing import Any

import onnx_ir as ir

logger = logging.getLogger(__name__)

QUADRATIC_RULES = frozenset({"SlicesSplit"})


def optimize_traced(model: ir.Model) -> None:
    """Optimize `model` in place as `ONNXProgram.optimize()` would, without the quadratic rule."""
    from onnxscript.rewriter import onnx_fusions

    passes = _linear_passes()
    if passes is None:
        from onnxscript import optimizer

        optimizer.optimize_ir(model)
    else:
        passes(model)
    onnx_fusions.fuse(model)


def _linear_passes() -> Any:
    """onnxscript's `optimize_ir` pass list (inlining on, its defaults) with the default rewrite
    rules less `QUADRATIC_RULES`; None when this onnxscript does not have those pieces."""
    try:
        import onnx_ir.passes.common as common
        from onnxscript import rewriter
        from onnxscript.optimizer import _constant_folding as folding

        rules = [r for r in rewriter._DEFAULT_REWRITE_RULES if r.name not in QUADRATIC_RULES]
        fold = folding.FoldConstantsPass(
            shape_inference=True,
            input_size_limit=folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
            output_size_limit=folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
            should_fold=lambda node: None,
        )
        loop = ir.passes.PassManager(
            [
                fold,
                rewriter.RewritePass(rules),
                common.RemoveUnusedNodesPass(),
                common.RemoveUnusedFunctionsPass(),
                common.RemoveUnusedOpsetsPass(),
            ],
            steps=2,
            early_stop=True,
        )
        return ir.passes.Sequential(
            common.InlinePass(),
            loop,
            common.RemoveUnusedNodesPass(),
            common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
            common.LiftSubgraphInitializersToMainGraphPass(),
            common.DeduplicateInitializersPass(),
            common.CommonSubexpressionEliminationPass(),
            common.OutputFixPass(),
            common.NameFixPass(),
        )
    except (ImportError, AttributeError, TypeError) as e:
        logger.debug("onnxscript's optimizer pieces moved (%s): running optimize_ir as is", e)
        return None
