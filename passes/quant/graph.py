"""Graph helpers shared by the quantization passes: find the MatMuls with constant weights,
read their weights, add initializers and swap nodes, all on onnx_ir models in place.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

logger = logging.getLogger(__name__)


@dataclass
class WeightSite:
    """A MatMul(x, W) whose W [K, N] is a constant (directly or as Transpose(W^T) of one).

    `transposed` is True for the tied LM head pattern MatMul(x, Transpose(E)), E [N, K].
    `lm_head` marks the MatMul that produces the graph output `logits`.
    """

    node: ir.Node
    x: ir.Value  # [..., K]
    weight: ir.Value  # initializer: [K, N], or [N, K] when transposed
    transposed: bool
    k: int
    n: int
    lm_head: bool

    @property
    def name(self) -> str:
        return self.node.name or self.weight.name or "matmul"

    def weight_array(self) -> np.ndarray:
        """W [K, N] float32."""
        w = np.asarray(self.weight.const_value.numpy(), dtype=np.float32)  # type: ignore[union-attr]
        return np.ascontiguousarray(w.T) if self.transposed else w


def _const(value: ir.Value | None) -> bool:
    return value is not None and value.const_value is not None and value.is_initializer()


PASS_THROUGH = ("Reshape", "Cast", "Identity", "Add", "Concat")


def _joins_matmuls(concat: ir.Node) -> bool:
    """A Concat of MatMul outputs only: the head split by vocabulary rows."""
    return all(
        v is not None and (p := v.producer()) is not None and p.op_type in ("MatMul", "MatMulNBits")
        for v in concat.inputs
    )


def _feeds_logits(node: ir.Node, graph: ir.Graph) -> bool:
    """True when `node` reaches a graph output through at most 4 single-user shape/cast ops
    (or the Concat that joins a head split by vocabulary rows, vocab_split.py)."""
    cur = node
    for _ in range(5):
        if any(o.is_graph_output() for o in cur.outputs):
            return True
        users = [u for o in cur.outputs for u, _ in o.uses()]
        if len(users) != 1 or users[0].op_type not in PASS_THROUGH:
            return False
        if users[0].op_type == "Concat" and not _joins_matmuls(users[0]):
            return False  # e.g. a new key joining the past: only a split head's parts pass
        cur = users[0]
    return False


def find_weight_matmuls(model: ir.Model) -> list[WeightSite]:
    """All MatMuls of the main graph whose right input is a 2-D float constant."""
    graph = model.graph
    sites: list[WeightSite] = []
    for node in graph:
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
            continue
        x, b = node.inputs[0], node.inputs[1]
        if x is None or b is None:
            continue
        transposed = False
        weight = b
        if not _const(b):
            prod = b.producer()
            if prod is None or prod.op_type != "Transpose" or not _const(prod.inputs[0]):
                continue
            perm = prod.attributes.get_ints("perm", None)
            if perm is not None and list(perm) != [1, 0]:
                continue
            weight, transposed = prod.inputs[0], True  # type: ignore[assignment]
        assert weight is not None
        shape = weight.const_value.shape  # type: ignore[union-attr]
        if len(shape) != 2 or weight.const_value.dtype != ir.DataType.FLOAT:  # type: ignore[union-attr]
            continue
        d0, d1 = int(shape[0]), int(shape[1])  # type: ignore[arg-type]
        k, n = (d1, d0) if transposed else (d0, d1)
        sites.append(WeightSite(node, x, weight, transposed, k, n, _feeds_logits(node, graph)))
    return sites


def layer_chunks(sites: list[WeightSite]) -> list[list[WeightSite]]:
    """Sites grouped by decoder layer, in graph order (the unit of progress and of memory).

    A layer starts at each site that reads a different input than the previous site and
    whose input is a normalization output (q/k/v, then o, gate/up, down): the graph does not
    name layers, so the grouping follows the data. LM heads are a chunk of their own.
    """
    chunks: list[list[WeightSite]] = []
    for site in sites:
        starts_layer = (
            not chunks
            or site.lm_head
            or chunks[-1][-1].lm_head
            or (
                _is_norm_output(site.x)
                and site.x is not chunks[-1][-1].x
                and _attention_input(site, chunks[-1])
            )
        )
        if starts_layer:
            chunks.append([site])
        else:
            chunks[-1].append(site)
    if sum(not c[0].lm_head for c in chunks) > 1 or len(sites) < 2:
        return chunks
    # No normalization ops to follow (an unfused graph): sites sharing an input stay together.
    runs: list[list[WeightSite]] = []
    for site in sites:
        if runs and runs[-1][-1].x is site.x and not site.lm_head:
            runs[-1].append(site)
        else:
            runs.append([site])
    return runs


def _attention_input(site: WeightSite, chunk: list[WeightSite]) -> bool:
    """True when `site` reads the first normalized input seen in a layer, i.e. the chunk
    already went past its MLP (its norm inputs are all different from `site`'s)."""
    norm_inputs = {id(s.x) for s in chunk if _is_norm_output(s.x)}
    return len(norm_inputs) >= 2


def _is_norm_output(x: ir.Value) -> bool:
    prod = x.producer()
    return prod is not None and "Norm" in prod.op_type


def release_weight(value: ir.Value) -> None:
    """Unmap the fp32 data of a weight just quantized (onnx_ir maps the whole external data
    file per tensor; pages read stay resident while mapped). Reloaded if read again."""
    tensor = value.const_value
    release = getattr(tensor, "release", None)
    if callable(release):
        try:
            release()
        except BufferError:  # a view of the mapping is still alive: it is unmapped later
            logger.debug("weight %s still referenced; not unmapped yet", value.name)


def add_initializer(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """Register `array` as a new initializer with a name unique in the graph."""
    base, i = name, 0
    existing = set(graph.initializers)
    while name in existing:
        i += 1
        name = f"{base}_{i}"
    value = ir.Value(
        name=name,
        shape=ir.Shape(array.shape),
        type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
    )
    value.const_value = ir.tensor(array, name=name)
    graph.register_initializer(value)
    return value


def named(node: ir.Node) -> ir.Node:
    """Give unnamed outputs `<node name>/output_<i>`: the serializer's automatic names are
    not unique against names inside If/Loop subgraphs, which breaks SSA."""
    for i, out in enumerate(node.outputs):
        if not out.name:
            out.name = f"{node.name}/output_{i}"
    return node


def replace_node(
    graph: ir.Graph, old: ir.Node, new_nodes: list[ir.Node], new_output: ir.Value
) -> None:
    """Insert `new_nodes` before `old`, route old's output users to `new_output`, drop `old`."""
    for n in new_nodes:
        named(n)
    graph.insert_before(old, new_nodes)
    out = old.outputs[0]
    new_output.shape = out.shape
    new_output.type = out.type
    name = out.name
    ir.convenience.replace_all_uses_with(out, new_output, replace_graph_outputs=True)
    graph.remove(old, safe=True)
    out.name = f"{name}_replaced"
    new_output.name = name


def remove_unused(model: ir.Model) -> None:
    """Drop nodes and initializers left without users (old fp32 weights, their Transposes)."""
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    RemoveUnusedNodesPass()(model)
