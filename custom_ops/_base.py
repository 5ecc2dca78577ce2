"""The `specport` op domain: a registry of custom ops and how to attach their functions.

Why a domain of our own: a fused graph should say *what* it computes (an RMSNorm, a grouped-query
attention with a KV cache) independently of *who* runs it. Each op carries an ONNX function body
made of standard ops, so a target-neutral artifact runs in any plain onnxruntime session (ORT
inlines model-local functions), and per-target lowerings (`custom_ops.lowering`) swap the op for
the provider's native kernel (com.microsoft contrib ops on CPU/CUDA, standard ops on CANN).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import onnx
import onnx_ir as ir
import onnxscript

logger = logging.getLogger(__name__)

DOMAIN = "specport"
VERSION = 1
OPSET = onnxscript.values.Opset(DOMAIN, VERSION)
STD_OPSET = 23


@dataclass(frozen=True)
class CustomOp:
    """One op of the domain.

    `function` is the onnxscript function (schema = its signature, body = standard ops);
    `reference` is the numpy truth used by tests; `lowerings` maps a target name to the name of
    the native op it becomes there (documentation; the rewrite itself lives in `lowering.py`).
    """

    name: str
    function: Any  # onnxscript.OnnxFunction
    reference: Callable[..., Any]
    lowerings: dict[str, str] = field(default_factory=dict)
    doc: str = ""

    def function_proto(self) -> onnx.FunctionProto:
        return self.function.to_function_proto()


REGISTRY: dict[str, CustomOp] = {}


def register(op: CustomOp) -> CustomOp:
    REGISTRY[op.name] = op
    return op


def used_ops(model: ir.Model) -> set[str]:
    """Names of `specport` ops used in the main graph."""
    return {n.op_type for n in model.graph.all_nodes() if n.domain == DOMAIN}


def attach_functions(model: ir.Model) -> list[str]:
    """Add the function body of every used `specport` op to `model.functions` (idempotent).

    Also declares the domain and opset 23 in the model's opset imports. Returns names attached.
    """
    attached = []
    for name in sorted(used_ops(model)):
        op = REGISTRY[name]
        key = (DOMAIN, name, "")
        if key in model.functions:
            continue
        fn = ir.serde.deserialize_function(op.function_proto())
        model.functions[key] = fn
        attached.append(name)
    if used_ops(model):
        model.opset_imports[DOMAIN] = VERSION
        model.opset_imports.setdefault("", STD_OPSET)
    return attached


def detach_functions(model: ir.Model) -> None:
    """Drop `specport` function bodies no longer referenced (after lowering)."""
    used = used_ops(model)
    for key in list(model.functions):
        if key[0] == DOMAIN and key[1] not in used:
            del model.functions[key]
    if not used and not any(k[0] == DOMAIN for k in model.functions):
        model.opset_imports.pop(DOMAIN, None)


Builder = Callable[[ir.tape.Tape, ir.Node, dict[str, Any]], list[ir.Value] | None]


def replace_specport_nodes(
    graph: ir.Graph,
    builder_for: Callable[[ir.Node], tuple[Builder | None, str | None]],
    opts: dict[str, Any],
    unknown_reason: str,
) -> dict[str, Any]:
    """Replace each specport node by what its builder makes; the one loop every lowering uses.

    ``builder_for(node)`` gives (builder, None), or (None, why) to keep the node as its
    function. A builder returning None (shapes or attributes it needs are unknown) keeps the
    node too, with ``unknown_reason``. Returns the report: counts lowered, and why each kept
    node was kept.
    """
    lowered: Counter[str] = Counter()
    kept: dict[str, str] = {}
    for node in list(graph):
        if node.domain != DOMAIN:
            continue
        builder, reason = builder_for(node)
        tape = ir.tape.Tape()
        new_outputs = builder(tape, node, opts) if builder else None
        if new_outputs is None:
            kept[node.name or node.op_type] = reason or unknown_reason
            continue
        ir.convenience.replace_nodes_and_values(
            graph, node, [node], tape.nodes, list(node.outputs), new_outputs
        )
        lowered[node.op_type] += 1
    return {"lowered": dict(lowered), "kept_as_function": kept}
