"""Expose the target's hidden states at three depths as one extra output, for an EAGLE draft head.

Contract after the pass (inputs, logits and presents unchanged; one output appended):

* ``eagle_features`` float [B, S, 3H] (shared layout: [B, K, 3H], the positions
  ``logits_index`` selects, like ``logits``): for every such position, the concatenation of

  - the normalised input of a low layer's attention (``layers.{low}.input_layernorm``),
  - the same for a middle layer,
  - the final norm's output (the LM head's input),

  computed in the same run as the logits: the values exist already, the pass only adds a
  Concat over them (and on the shared layout one GatherND with the logits' index).

On the shared layout a prefill step selects its last position, so a draft head sees the
prompt's features only from its last token on; it is trained that way (``eagle_train``).

The layer inputs are found by the order of the norm nodes (fused graphs:
``SkipSimplifiedLayerNormalization``, ``RMSNormalization``) or by the norm weight their node
reads (``layers.{i}.input_layernorm`` in the initializer name: unfused graphs); the final norm's output is the LM-head MatMul's
input, or, on a shared-layout graph whose ``logits_index`` gathers positions before the head,
that gather's data input (all S positions, so a prefill step yields the prompt's features).
Normalised states are used rather than the raw residual stream: their scale is the same at
every depth, which the head's input projection likes.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np
import onnx_ir as ir

from specport.core.contract import EAGLE_FEATURES
from specport.core.errors import PassError
from specport.passes.base import Pass
from specport.passes.mtp import find_lm_head_input
from specport.passes.select_logits import LOGITS_INDEX

logger = logging.getLogger(__name__)

_GATHERS = {"GatherND", "Gather", "GatherElements"}


def feature_layers(num_layers: int) -> list[int]:
    """The low and middle layers whose inputs are taken (EAGLE-3 takes layer 2 and the middle
    one; the top feature is the final norm's output)."""
    return [min(2, num_layers - 1), num_layers // 2]


_NORMS = {
    "RMSNormalization",
    "SimplifiedLayerNormalization",
    "SkipSimplifiedLayerNormalization",
    "LayerNormalization",
    "SkipLayerNormalization",
}


def layer_input(model: ir.Model, layer: int, num_layers: int) -> ir.Value:
    """The normalised input [B, S, H] of ``layer``'s attention (its input norm's output).

    On a graph with norm ops, the norms come in graph order, the same number per layer, then
    the final one: layer i's input norm is the first of its group (equal norm weights may
    share one initializer, so names are not enough). Otherwise (unfused graphs) the node that
    reads the ``layers.{i}.input_layernorm.weight`` initializer."""
    norms = [n for n in model.graph if n.op_type in _NORMS]
    if num_layers > 0 and len(norms) > num_layers and (len(norms) - 1) % num_layers == 0:
        return norms[layer * ((len(norms) - 1) // num_layers)].outputs[0]
    pattern = re.compile(rf"(^|\.)layers\.{layer}\.input_layernorm\.weight$")
    for node in model.graph:
        for value in node.inputs:
            if value is not None and value.name and pattern.search(value.name):
                return node.outputs[0]
    raise PassError(
        f"cannot find layer {layer}'s input norm (no node reads an initializer named "
        f"'...layers.{layer}.input_layernorm.weight'); the EAGLE features need the exported "
        "decoder's weight names."
    )


def final_hidden(model: ir.Model, logits_name: str = "logits") -> ir.Value:
    """The final norm's output [B, S, H] at every fed position (before a position selection)."""
    value = find_lm_head_input(model, logits_name)
    node = value.producer()
    if node is not None and node.op_type in _GATHERS and node.inputs[0] is not None:
        return node.inputs[0]  # shared layout: positions selected before the LM head
    return value


class ExposeEagleFeaturesPass(Pass):
    """Add ``eagle_features`` [B, S, 3H] (low layer, middle layer, final norm) as an output."""

    name = "expose_eagle_features"

    def __init__(self, num_layers: int, logits_name: str = "logits") -> None:
        self.num_layers = int(num_layers)
        self.logits_name = logits_name

    def precondition(self, model: ir.Model) -> str | None:
        if any(v.name == EAGLE_FEATURES for v in model.graph.outputs):
            return f"graph already has an {EAGLE_FEATURES!r} output"
        if self.logits_name not in {v.name for v in model.graph.outputs}:
            return f"graph has no {self.logits_name!r} output"
        return None

    def rewrite(self, model: ir.Model) -> tuple[bool, dict[str, Any]]:
        layers = feature_layers(self.num_layers)
        parts = [layer_input(model, i, self.num_layers) for i in layers] + [
            final_hidden(model, self.logits_name)
        ]
        graph = model.graph
        node = ir.node("Concat", parts, attributes={"axis": -1}, name=f"/{EAGLE_FEATURES}/Concat")
        graph.append(node)
        out = node.outputs[0]
        index = next((v for v in graph.inputs if v.name == LOGITS_INDEX), None)
        if index is not None:
            out.name = f"/{EAGLE_FEATURES}/all"
            out = _gather_positions(graph, out, index)
        out.name = EAGLE_FEATURES
        out.type = parts[-1].type or ir.TensorType(ir.DataType.FLOAT)
        out.shape = ir.Shape(["batch", "sequence_length", "eagle_feature_dim"])
        graph.outputs.append(out)
        return True, {
            "output": EAGLE_FEATURES,
            "layers": [*layers, "final_norm"],
            "from": [str(v.name) for v in parts],
            "positions": "logits_index" if index is not None else "all fed",
        }


def _gather_positions(graph: ir.Graph, values: ir.Value, index: ir.Value) -> ir.Value:
    """values [B, S, F] at index [B, K] -> [B, K, F] (the positions the LM head sees)."""
    axes = ir.Value(name=f"/{EAGLE_FEATURES}/axes", const_value=ir.tensor(np.array([-1], np.int64)))
    axes.shape, axes.type = ir.Shape([1]), ir.TensorType(ir.DataType.INT64)
    graph.register_initializer(axes)
    idx = ir.node("Unsqueeze", [index, axes], name=f"/{EAGLE_FEATURES}/index")
    idx.outputs[0].name = f"/{EAGLE_FEATURES}/index3"
    gather = ir.node(
        "GatherND", [values, idx.outputs[0]], {"batch_dims": 1}, name=f"/{EAGLE_FEATURES}/gather"
    )
    graph.append(idx)
    graph.append(gather)
    return gather.outputs[0]
