"""Float zero points for 4-bit MatMulNBits without onnxruntime's slow path.

A 4-bit weight with float zero points z (llama.cpp's Q4_1 grid, HQQ, the GPTQ scale refit)
is w = (q - z) * s = (q - 8) * s + (8 - z) * s per block: symmetric MatMulNBits codes plus
one offset per (block, output column). So Y = MatMulNBits_sym(x) + S(x) @ O, with S(x) [.., n_blocks]
the sums of x over each block of K (Reshape + ReduceSum) and O [n_blocks, N] the offsets.

Why: onnxruntime 1.32's CPU MatMulNBits takes float zero points but runs them on a
dequantizing fallback that ignores accuracy_level 4: 19-21x the CPU time of packed integer
zero points with float activations, 47-74x with int8 activations. Measured on SmolLM2's shapes
(K=576/1536, N=576-3072, one thread, docs/benchmarks/2026-12-06-q4-1-offsets.md): the symmetric
kernel plus the four small ops costs within 5% of integer zero points with float activations
and 0-40% more per call with int8 activations (1.2x the decode CPU per token on the model). Same numbers (an exact rewrite of (q - z) * s) and the same bytes as float zero
points: one float32 per block, 6.0 bits per weight at block 32.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from specport.core.weight_size import BLOCK_OFFSETS_SUFFIX
from specport.passes.quant.blockquant import BlockQuant
from specport.passes.quant.graph import add_initializer


def activation_rank(x: ir.Value, y: ir.Value) -> int | None:
    """The rank of a weight MatMul's input x (or of its output y, the same), if recorded."""
    for v in (x, y):
        if v.shape is not None and len(v.shape) >= 2:
            return len(v.shape)
    return None


def block_offsets_form(bq: BlockQuant, rank: int | None) -> bool:
    """Whether `bq` is emitted in this form: 4 bits with float zero points, and an input of
    known rank (the block sums reshape its last axis); otherwise MatMulNBits takes the float
    zero points itself (the slow path, same numbers)."""
    return bq.bits == 4 and not bq.integer_zero and rank is not None


def with_block_offsets(
    graph: ir.Graph, x: ir.Value, k: int, bq: BlockQuant, base: str, node: ir.Node, rank: int | None
) -> tuple[list[ir.Node], ir.Value]:
    """The nodes that compute x @ w_hat and that output: `node` (the MatMulNBits of `bq`'s
    codes, x [.., K]) alone, or, for float zero points, plus x's block sums times the
    block offsets. `base` names the new initializers and nodes."""
    if not block_offsets_form(bq, rank):
        return [node], node.outputs[0]
    assert rank is not None
    g, nb = bq.group_size, bq.n_blocks
    # offsets [n_blocks, N]: w = (q - z) * s = (q - 8) * s + (8 - z) * s
    offsets = ((8.0 - bq.zero.astype(np.float64)) * bq.scale).T.astype(np.float32)
    off = add_initializer(graph, f"{base}.q4{BLOCK_OFFSETS_SUFFIX}", offsets)
    blocks = add_initializer(
        graph, f"{base}.block_shape", np.array([0] * (rank - 1) + [nb, g], dtype=np.int64)
    )
    last = add_initializer(graph, f"{base}.last_axis", np.array([-1], dtype=np.int64))
    nodes = [node]
    xin = x
    if nb * g != k:  # MatMulNBits pads K with zeros; so do the block sums
        pads = add_initializer(graph, f"{base}.k_pad", np.array([0, nb * g - k], dtype=np.int64))
        pad = ir.node("Pad", [x, pads, None, last], name=f"{base}/PadK")
        nodes.append(pad)
        xin = pad.outputs[0]
    shaped = ir.node("Reshape", [xin, blocks], name=f"{base}/Blocks")
    sums = ir.node(
        "ReduceSum", [shaped.outputs[0], last], {"keepdims": 0}, name=f"{base}/BlockSums"
    )
    times = ir.node("MatMul", [sums.outputs[0], off], name=f"{base}/BlockOffsets")
    add = ir.node("Add", [node.outputs[0], times.outputs[0]], name=f"{base}/AddOffsets")
    nodes += [shaped, sums, times, add]
    return nodes, add.outputs[0]
