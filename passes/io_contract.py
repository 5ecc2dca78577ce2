"""Describe a (fused) graph's KV-cache contract for the artifact manifest (`KVLayout`).

`fused_io_contract(model)` reads the graph, not the pipeline that made it, so it is right for
any input: unfused exports, concat-fused graphs and shared-layout graphs alike.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import onnx_ir as ir

from specport.passes.shared_kv import SEQLENS, TOTAL

logger = logging.getLogger(__name__)

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")


def _dim(v: ir.Value, axis: int) -> int | str | None:
    if v.shape is None or v.shape.rank() <= abs(axis):
        return None
    d = v.shape[axis]
    return d if isinstance(d, int) else (str(d.value) if d.value is not None else None)


def _attention_ops(model: ir.Model) -> dict[str, int]:
    found: dict[str, int] = {}
    for node in model.graph.all_nodes():
        if node.op_type in ("GroupQueryAttention", "Attention", "MultiHeadAttention", "Softmax"):
            key = (
                node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
            )
            found[key] = found.get(key, 0) + 1
    return found


def fused_io_contract(model: ir.Model) -> dict[str, Any]:
    """Layout, tensor names, per-layer KV dims, and what the runtime must feed.

    The keys of `KVLayout` (layout, inputs, outputs, num_heads, key_dim, value_dim, dtype,
    max_length) are top-level so `KVLayout(**kv_layout_fields(contract))` works; the rest
    (`feeds`, `padding`, `attention`, ...) is guidance for the runtime and goes to `extra`.
    """
    inputs = {v.name: v for v in model.graph.inputs}
    layers: dict[int, dict[str, ir.Value]] = {}
    for name, v in inputs.items():
        m = _PAST.match(name or "")
        if m:
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = v
    order = sorted(layers)
    shared = SEQLENS in inputs
    keys = [layers[i]["key"] for i in order]
    values = [layers[i]["value"] for i in order]
    max_len = _dim(keys[0], 2) if (shared and keys) else None
    dtype = keys[0].dtype.numpy().name if keys and keys[0].dtype is not None else "float32"
    contract: dict[str, Any] = {
        "layout": "shared" if shared else "concat",
        "inputs": [[f"past_key_values.{i}.key", f"past_key_values.{i}.value"] for i in order],
        "outputs": [[f"present.{i}.key", f"present.{i}.value"] for i in order],
        "num_heads": [_dim(k, 1) for k in keys],
        "key_dim": [_dim(k, 3) for k in keys],
        "value_dim": [_dim(v, 3) for v in values],
        "dtype": dtype,
        "max_length": max_len if isinstance(max_len, int) else None,
        "attention": _attention_ops(model),
        "graph_inputs": list(inputs),
    }
    if shared:
        contract["feeds"] = {
            SEQLENS: "int32 [B]: valid cache length of each row after this step, minus 1",
            TOTAL: "int32 []: max over rows of the valid cache length after this step",
        }
        contract["padding"] = "ragged rows, right-padded prompts; no attention_mask"
        contract["bind_past_as_present"] = True
        contract["multi_token_on_past"] = "any batch (every row of the step adds S tokens)"
    else:
        contract["feeds"] = {"attention_mask": "int64 [B, P+S], 1 = real token, 0 = left pad"}
        contract["padding"] = "left padding through attention_mask"
        contract["bind_past_as_present"] = False
        contract["multi_token_on_past"] = "any batch"
    return contract


KV_FIELDS = (
    "layout",
    "inputs",
    "outputs",
    "num_heads",
    "key_dim",
    "value_dim",
    "dtype",
    "max_length",
)


def kv_layout_fields(contract: dict[str, Any]) -> dict[str, Any]:
    """The subset of `fused_io_contract` that `specport.artifact.manifest.KVLayout` takes."""
    return {k: contract[k] for k in KV_FIELDS}
