"""Older fused EAGLE draft graphs, given the attention-length inputs the runtime feeds.

``eagle_graph.fused_draft_graph`` writes the head's GroupQueryAttention with its lengths as
inputs (``core.contract.EAGLE_LENGTH_INPUTS``), so the runtime binds one KV buffer as past and
present (``runtime.speculative.eagle_kv``). Graphs written before computed them from the
past's shape (P + S - 1, P + S), which holds only when the past is exactly the valid
positions; ``lengths_as_inputs`` turns such a graph into the new form when it is opened (onnx
only: the runtime needs no torch for it).
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from specport.core.contract import EAGLE_LENGTH_INPUTS


def lengths_as_inputs(model: onnx.ModelProto) -> bool:
    """Give a fused draft graph written before ``EAGLE_LENGTH_INPUTS`` existed (its attention's
    lengths computed from the past's shape) those inputs, in place; drop the nodes only
    they fed. False (unchanged) when the graph has no GroupQueryAttention or takes them
    already. Both forms compute the same function when fed P + S - 1 and P + S."""
    graph = model.graph
    attention = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    names = {i.name for i in graph.input}
    if len(attention) != 1 or set(EAGLE_LENGTH_INPUTS) <= names or len(attention[0].input) < 7:
        return False
    node = attention[0]
    node.input[5], node.input[6] = EAGLE_LENGTH_INPUTS
    for n in [n for n in graph.node if set(n.output) & set(EAGLE_LENGTH_INPUTS)]:
        graph.node.remove(n)  # the earlier graphs named their Expand's output seqlens_k
    graph.input.extend(
        [
            helper.make_tensor_value_info(EAGLE_LENGTH_INPUTS[0], TensorProto.INT32, ["batch"]),
            helper.make_tensor_value_info(EAGLE_LENGTH_INPUTS[1], TensorProto.INT32, []),
        ]
    )
    while True:  # the Shape / Gather / Add / Cast chain nothing reads any more
        used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
        dead = [n for n in graph.node if not any(o in used for o in n.output)]
        if not dead:
            break
        for n in dead:
            graph.node.remove(n)
    used = {i for n in graph.node for i in n.input}
    for init in [i for i in graph.initializer if i.name not in used]:
        graph.initializer.remove(init)
    return True
