"""Run the target's pass pipeline on a traced graph and describe the KV layout it leaves.

The concat layout runs the pipeline as asked; the shared layout also switches attention to
onnxruntime's in-place GroupQueryAttention and selects logits, and refuses a partial fusion
(a graph with some layers unfused cannot run in place).
"""

from __future__ import annotations

import logging
from typing import Any

import onnx_ir as ir

from specport.artifact import manifest as art
from specport.core.contract import TREE_MASK
from specport.core.errors import ExportError
from specport.passes.io_contract import fused_io_contract, kv_layout_fields
from specport.passes.pipelines import pipeline_for
from specport.passes.select_logits import LOGITS_INDEX, NEXT_TOKEN, RUNTIME_IO

logger = logging.getLogger(__name__)


def apply_passes(
    model: ir.Model,
    target: str,
    fuse: bool,
    passes: list[str] | None,
    config: dict[str, Any],
    kv_shapes: list[tuple[int, int, int]],
    kv_layout: str = "concat",
    max_length: int | None = None,
    tree_mask: bool = False,
) -> tuple[list[dict[str, Any]], art.KVLayout, str, dict[str, Any]]:
    """Run the target's pipeline. Returns (pass reports, manifest KVLayout, target, extra).

    `extra` is `{"runtime": ...}` for a shared layout (the names the runtime binds), else {}.
    """
    layout = art.KVLayout(
        layout="concat",
        inputs=[
            [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
            for i in range(len(kv_shapes))
        ],
        outputs=[[f"present.{i}.key", f"present.{i}.value"] for i in range(len(kv_shapes))],
        num_heads=[h for h, _, _ in kv_shapes],
        key_dim=[k for _, k, _ in kv_shapes],
        value_dim=[v for _, _, v in kv_shapes],
    )
    if kv_layout == "shared":
        return apply_shared(model, target, passes, kv_shapes, max_length, tree_mask)
    if not fuse and not passes:
        return [], layout, "neutral", {}
    pipeline = pipeline_for(target, passes)
    result = pipeline(model)
    return result.report.get("passes", []), layout, target, {}


def apply_shared(
    model: ir.Model,
    target: str,
    passes: list[str] | None,
    kv_shapes: list[tuple[int, int, int]],
    max_length: int | None,
    tree_mask: bool = False,
) -> tuple[list[dict[str, Any]], art.KVLayout, str, dict[str, Any]]:
    """Fuse, lower, switch to the shared layout and select logits; refuse a partial fusion.

    The graph keeps its buffer length symbolic (the runtime allocates what a generation needs);
    `max_length` is the artifact's limit, recorded in the manifest.
    """

    pipeline = pipeline_for(
        target,
        passes,
        kv_layout="shared",
        select_logits=True,
        rotary_length=max_length,
        pack_qkv=True,
        tree_mask=tree_mask,
    )
    result = pipeline(model)
    contract = fused_io_contract(model)
    fused = contract["attention"].get("com.microsoft.GroupQueryAttention", 0)
    if contract["layout"] != "shared" or fused != len(kv_shapes):
        other = {k: v for k, v in contract["attention"].items() if "GroupQuery" not in k}
        raise ExportError(
            f"--kv-layout shared needs every layer's attention fused to GroupQueryAttention; "
            f"{fused} of {len(kv_shapes)} layers fused (other attention ops: {other or 'none'}). "
            "Use --kv-layout concat for this model (or keep fuse_attention in --passes)."
        )
    if tree_mask and TREE_MASK not in contract["graph_inputs"]:
        why = next(
            (p.get("skipped") for p in result.report.get("passes", []) if p["name"] == "tree_bias"),
            None,
        )
        raise ExportError(
            f"--tree-mask could not reach the fused attention ({why or 'tree_bias did not run'}); "
            "use --kv-layout concat with --tree-mask for this model."
        )
    fields = kv_layout_fields(contract)
    fields["max_length"] = max_length
    past = next(v for v in model.graph.inputs if v.name == contract["inputs"][0][0])
    if past.dtype is not None:  # numpy's name ("float32"), which the runtime allocates with
        fields["dtype"] = past.dtype.numpy().name
    graph_in = {v.name for v in model.graph.inputs}
    graph_out = {v.name for v in model.graph.outputs}
    runtime = dict(RUNTIME_IO)
    if LOGITS_INDEX not in graph_in:
        runtime.pop("logits_index_input")
    if NEXT_TOKEN not in graph_out:
        runtime.pop("next_token_output")
    runtime["position_ids"] = "position_ids" in graph_in
    runtime["feeds"] = contract["feeds"]
    runtime["multi_token_on_past"] = contract["multi_token_on_past"]
    return (
        result.report.get("passes", []),
        art.KVLayout(**fields),
        target,
        {"runtime": runtime},
    )
