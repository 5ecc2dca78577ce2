"""Insert the MTP branch into an exported decoder graph: verify and draft in one session run.

Contract after the pass (inputs unchanged, outputs appended after the presents):

* ``mtp_accepted`` int64 [B]: greedy accepted prefix length of the drafts in ``input_ids``
  (position 0 is the last accepted token, positions 1..S-1 the drafts);
* ``mtp_bonus`` int64 [B]: the target's argmax at the accepted position (the next token);
* ``mtp_drafts`` int64 [B, K]: the K chained MTP heads' drafts that follow the bonus token.

The branch (``specport.exporter.mtp_heads.MTPBranch`` exported on its own) has three inputs,
``mtp_hidden`` [B, S, H], ``mtp_logits`` [B, S, V] and ``mtp_input_ids`` [B, S]. The pass
connects them to the main graph: the hidden state is the first input of the LM-head MatMul
(or Gemm) that produces ``logits``, found by walking back from the output, so it does not
depend on how the rest of the graph was fused. Logits and presents are untouched, so the plain
generator still runs the graph (the extra outputs are ignored) and a bare InferenceSession
loads it.

On a shared-layout graph (``passes.select_logits``: a ``logits_index`` [B, K] input picks the
positions that reach the LM head) the branch sees those K positions: its hidden state and
logits are already the selected ones, and its input ids are gathered with the same index. A
verify step selects every position (K = S, the branch works as on concat); a prefill or decode
step selects the last one, and the branch then yields the next token and K fresh drafts.

``strip_mtp_branch`` undoes the pass (the plain reference of a benchmark), and
``expose_lm_head_input`` adds the hidden state as an output: with both, MTP token trees
(``runtime.speculative.mtp_tree``) verify on the base graph and seed the standalone heads.
"""

from __future__ import annotations

import logging
from typing import Any

import onnx_ir as ir

from specport.core.errors import PassError
from specport.passes.base import Pass

logger = logging.getLogger(__name__)

BRANCH_INPUTS = ("mtp_hidden", "mtp_logits", "mtp_input_ids")
BRANCH_OUTPUTS = ("mtp_accepted", "mtp_bonus", "mtp_drafts")
_PASS_THROUGH = {"Identity", "Cast", "Reshape", "Slice"}


def find_lm_head_input(model: ir.Model, logits_name: str = "logits") -> ir.Value:
    """The [B, S, H] value the LM head multiplies into ``logits``."""
    outputs = {v.name: v for v in model.graph.outputs}
    if logits_name not in outputs:
        raise PassError(
            f"graph has no output {logits_name!r}; the MTP pass needs the exported decoder contract"
        )
    node = outputs[logits_name].producer()
    seen = []
    while node is not None and node.op_type in _PASS_THROUGH:
        seen.append(node.op_type)
        node = node.inputs[0].producer() if node.inputs[0] is not None else None
    if node is None or node.op_type not in ("MatMul", "Gemm") or node.inputs[0] is None:
        found = node.op_type if node is not None else "a graph input"
        raise PassError(
            f"cannot find the LM head: {logits_name!r} comes from {found} (via {seen or 'nothing'}), "
            "not a MatMul/Gemm. Export the model unquantized, or apply the MTP pass before passes "
            "that rewrite the LM head."
        )
    return node.inputs[0]


class InsertMTPBranchPass(Pass):
    """Splice an exported MTPBranch graph into the decoder graph (in place)."""

    name = "insert_mtp_branch"

    def __init__(self, branch: ir.Model, logits_name: str = "logits") -> None:
        self.branch = branch
        self.logits_name = logits_name

    def precondition(self, model: ir.Model) -> str | None:
        names = {v.name for v in model.graph.outputs}
        if any(n in names for n in BRANCH_OUTPUTS):
            return "graph already has an MTP branch"
        if "input_ids" not in {v.name for v in model.graph.inputs}:
            return "graph has no input_ids input"
        branch_in = [str(v.name) for v in self.branch.graph.inputs]
        if sorted(branch_in) != sorted(BRANCH_INPUTS):
            return f"branch inputs {branch_in} are not {list(BRANCH_INPUTS)}"
        return None

    def rewrite(self, model: ir.Model) -> tuple[bool, dict[str, Any]]:
        graph, branch = model.graph, self.branch.graph
        input_ids = next(v for v in graph.inputs if v.name == "input_ids")
        index = next((v for v in graph.inputs if v.name == "logits_index"), None)
        main_values = {
            "mtp_hidden": find_lm_head_input(model, self.logits_name),
            "mtp_logits": next(v for v in graph.outputs if v.name == self.logits_name),
            "mtp_input_ids": input_ids if index is None else _gather_ids(graph, input_ids, index),
        }
        for version_domain, version in self.branch.opset_imports.items():
            have = model.opset_imports.get(version_domain)
            if have is not None and have != version:
                raise PassError(
                    f"opset mismatch for domain {version_domain!r}: graph {have}, branch {version}"
                )
            model.opset_imports[version_domain] = version
        for key, func in list(self.branch.functions.items()):
            if key in model.functions:
                raise PassError(f"function {key} exists in both the graph and the MTP branch")
            model.functions[key] = func
        inits = list(branch.initializers.values())
        branch.initializers.clear()
        for value in inits:
            value.name = f"mtp.{value.name}"
            graph.register_initializer(value)
        nodes = list(branch)
        for node in nodes:
            branch.remove(node)
        for node in nodes:
            node.name = f"/mtp/{node.name or node.op_type}"
            for out in node.outputs:
                if out.name not in BRANCH_OUTPUTS:
                    out.name = f"/mtp/{out.name}"
            graph.append(node)
        for value in list(branch.inputs):
            value.replace_all_uses_with(main_values[str(value.name)])
        branch_outputs = list(branch.outputs)
        branch.outputs.clear()
        graph.outputs.extend(branch_outputs)
        hidden = main_values["mtp_hidden"]
        return True, {
            "hidden_from": hidden.name,
            "nodes_added": len(nodes),
            "initializers_added": len(inits),
            "outputs": [v.name for v in branch_outputs],
        }


def _gather_ids(graph: ir.Graph, input_ids: ir.Value, index: ir.Value) -> ir.Value:
    """input_ids [B, S] at logits_index [B, K] -> [B, K] (the positions the LM head sees)."""
    import numpy as np

    axes = ir.Value(name="mtp.gather_ids/axes", const_value=ir.tensor(np.array([-1], np.int64)))
    axes.shape, axes.type = ir.Shape([1]), ir.TensorType(ir.DataType.INT64)
    graph.register_initializer(axes)
    ids3 = ir.node("Unsqueeze", [input_ids, axes], name="/mtp/gather_ids/ids")
    idx3 = ir.node("Unsqueeze", [index, axes], name="/mtp/gather_ids/index")
    gather = ir.node(
        "GatherND", [ids3.outputs[0], idx3.outputs[0]], {"batch_dims": 1}, name="/mtp/gather_ids"
    )
    out = ir.node("Squeeze", [gather.outputs[0], axes], name="/mtp/gather_ids/squeeze")
    for i, node in enumerate((ids3, idx3, gather, out)):
        node.outputs[0].name = f"/mtp/gather_ids/out{i}"
        graph.append(node)
    value = out.outputs[0]
    value.type = ir.TensorType(ir.DataType.INT64)
    value.shape = ir.Shape(["batch", "kept"])
    return value


def strip_mtp_branch(model: ir.Model) -> int:
    """Remove the MTP outputs and every node only they needed (in place); returns nodes removed.

    What is left is the base decoder graph: the plain-decoding reference a speculative benchmark
    must compare against (onnxruntime runs every node of a graph whatever outputs are fetched,
    so plain decoding on the MTP graph would also pay for the heads).
    """
    from onnx_ir.passes.common import RemoveUnusedFunctionsPass, RemoveUnusedNodesPass

    graph = model.graph
    before = len(list(graph.all_nodes()))
    kept = [v for v in graph.outputs if v.name not in BRANCH_OUTPUTS]
    graph.outputs.clear()
    graph.outputs.extend(kept)
    RemoveUnusedNodesPass()(model)
    RemoveUnusedFunctionsPass()(model)
    for name in [n for n in graph.initializers if n.startswith("mtp.")]:
        if not graph.initializers[name].uses():
            graph.initializers.pop(name)
    return before - len(list(graph.all_nodes()))


HIDDEN_OUTPUT = "lm_head_input"


def expose_lm_head_input(
    model: ir.Model, name: str = HIDDEN_OUTPUT, logits_name: str = "logits"
) -> ir.Value:
    """Add the LM head's input (the hidden state [B, S, H] behind ``logits``) as output ``name``.

    Token-tree MTP decoding seeds the heads with the hidden state of the tree's accepted node;
    the value already exists, so the output costs one Identity and no compute.
    """
    hidden = find_lm_head_input(model, logits_name)
    node = ir.node("Identity", [hidden], name=f"/{name}/Identity")
    out = node.outputs[0]
    out.name = name
    out.type = hidden.type
    out.shape = hidden.shape
    model.graph.append(node)
    model.graph.outputs.append(out)
    return out
