"""Embedding quantization: Gather(E, ids) -> com.microsoft.GatherBlockQuantized.

E [V, D] is quantized blockwise along D (quantize_axis=1) per row, gathered on axis 0.
onnxruntime's layout for uint8 data: codes packed low nibble first along D, data [V, D*bits/8],
scales [V, D/g], zero_points packed the same way [V, ceil(D/g*bits/8)]. Dequantization
happens after the gather, so only the looked-up rows are expanded.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import onnx_ir as ir

from specport.passes.base import Pass
from specport.passes.quant.blockquant import dequantize
from specport.passes.quant.graph import (
    add_initializer,
    release_weight,
    remove_unused,
    replace_node,
)
from specport.passes.quant.rtn import quantize_rtn
from specport.passes.quant.weight_quant import CHUNK_ELEMENTS, concat_rows

logger = logging.getLogger(__name__)


def _pack_rows(codes: np.ndarray, bits: int) -> np.ndarray:
    """[V, M] codes -> [V, M*bits/8] uint8, low bits first (M padded to even for 4 bits)."""
    codes = codes.astype(np.uint8)
    if bits == 8:
        return codes
    if codes.shape[1] % 2:
        codes = np.concatenate([codes, np.zeros((codes.shape[0], 1), np.uint8)], axis=1)
    return ((codes[:, 0::2] & 0xF) | ((codes[:, 1::2] & 0xF) << 4)).astype(np.uint8)


def gather_tables(model: ir.Model) -> list[tuple[ir.Node, ir.Value]]:
    """(Gather node, its table) for every Gather on axis 0 of a constant 2-D float table."""
    out = []
    for node in model.graph:
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx"):
            continue
        data = node.inputs[0]
        if data is None or data.const_value is None or not data.is_initializer():
            continue
        if len(data.const_value.shape) != 2 or data.const_value.dtype != ir.DataType.FLOAT:
            continue
        if node.attributes.get_int("axis", 0) != 0:
            continue
        out.append((node, data))
    return out


def _integer_zeros(head: ir.Node) -> bool:
    """GatherBlockQuantized takes packed uint8 zero points only (no float ones)."""
    zp = head.inputs[3] if len(head.inputs) > 3 else None
    return zp is None or zp.const_value is None or zp.const_value.dtype == ir.DataType.UINT8


def _gather_from_head(
    graph: ir.Graph, node: ir.Node, tied: tuple[ir.Node, int, int, int], v: int, d: int
) -> dict[str, Any]:
    """Gather(E, ids) -> GatherBlockQuantized over the tied head's own MatMulNBits codes,
    scales and zero points, reshaped: blocks run along D in both (MatMulNBits' K is the
    table's D, its N the vocabulary), so the layouts agree row for row when the block divides
    D. The matrix is stored once, as llama.cpp stores a tied token embedding."""
    head, bits, g, k = tied
    assert k == d
    nb = d // g
    shapes = {1: [v, d * bits // 8], 2: [v, nb], 3: [v, -(-nb * bits // 8)]}
    base = f"{node.name or 'gather'}/shared"
    new_nodes, inputs = [], []
    for i in (1, 2, 3):
        if i >= len(head.inputs) or head.inputs[i] is None:
            continue
        shape = add_initializer(graph, f"{base}.shape{i}", np.array(shapes[i], dtype=np.int64))
        r = ir.node("Reshape", [head.inputs[i], shape], name=f"{base}/Reshape{i}")
        new_nodes.append(r)
        inputs.append(r.outputs[0])
    data, scales, *zero = inputs
    attrs = {"bits": bits, "block_size": g, "gather_axis": 0, "quantize_axis": 1}
    gbq = ir.node(
        "GatherBlockQuantized",
        [data, node.inputs[1], scales, *zero],
        attrs,
        domain="com.microsoft",
        name=f"{node.name or 'gather'}/GatherBlockQuantized",
    )
    replace_node(graph, node, [*new_nodes, gbq], gbq.outputs[0])
    return {"bits": bits, "group_size": g, "vocab": v, "shared_with": head.name}


class QuantizeEmbeddingPass(Pass):
    """Blockwise RTN (asymmetric) of constant Gather tables on axis 0."""

    name = "quantize_embedding"
    activity = "quantizing the embedding table"

    def __init__(
        self,
        bits: int = 8,
        group_size: int = 32,
        shared: dict[str, tuple[ir.Node, int, int, int]] | None = None,
    ) -> None:
        self.bits, self.group_size = bits, group_size
        # table name -> (tied head's MatMulNBits, bits, block, K): gather from its codes
        self.shared = {} if shared is None else shared  # filled by the weight pass first

    def _sites(self, model: ir.Model) -> list[ir.Node]:
        return [node for node, _ in gather_tables(model)]

    def precondition(self, model: ir.Model) -> str | None:
        return None if self._sites(model) else "no Gather over a constant 2-D float table"

    def rewrite(self, model: ir.Model) -> tuple[bool, dict[str, Any]]:
        graph = model.graph
        layers: dict[str, Any] = {}
        for node in self._sites(model):
            data = node.inputs[0]
            assert data is not None and data.const_value is not None
            v, d = data.const_value.shape.numpy()  # a constant's shape is concrete
            tied = self.shared.get(data.name or "")
            if tied is not None and d % tied[2] == 0 and _integer_zeros(tied[0]):
                layers[node.name or "gather"] = _gather_from_head(graph, node, tied, v, d)
                continue
            e = np.asarray(data.const_value.numpy())  # [V, D]
            if d % self.group_size:
                layers[node.name or "gather"] = {
                    "bits": 32,
                    "reason": f"D={d} not a multiple of {self.group_size}",
                }
                continue
            # Rows in chunks: a 128k x 4096 table would need ~17 GB of float64 temporaries.
            step = max(1, CHUNK_ELEMENTS // d)
            parts = []
            err = 0.0
            for a in range(0, v, step):
                rows = e[a : a + step].astype(np.float32)
                bq = quantize_rtn(rows.T, self.bits, self.group_size, symmetric=False)
                err = max(err, float(np.abs(dequantize(bq).T - rows).max()))
                parts.append(bq)
            bq = parts[0] if len(parts) == 1 else concat_rows(parts)
            del e, rows
            release_weight(data)
            base = f"{data.name}.q{self.bits}"
            dv = add_initializer(graph, f"{base}.data", _pack_rows(bq.q, self.bits))
            sv = add_initializer(graph, f"{base}.scales", bq.scale.astype(np.float32))
            zv = add_initializer(
                graph, f"{base}.zero_points", _pack_rows(bq.zero.astype(np.uint8), self.bits)
            )
            attrs = {
                "bits": self.bits,
                "block_size": self.group_size,
                "gather_axis": 0,
                "quantize_axis": 1,
            }
            g = ir.node(
                "GatherBlockQuantized",
                [dv, node.inputs[1], sv, zv],
                attrs,
                domain="com.microsoft",
                name=f"{node.name or 'gather'}/GatherBlockQuantized",
            )
            replace_node(graph, node, [g], g.outputs[0])
            layers[node.name or "gather"] = {
                "bits": self.bits,
                "group_size": self.group_size,
                "vocab": v,
                "max_abs_error": err,
            }
        remove_unused(model)
        if layers and model.opset_imports.get("com.microsoft", 0) < 1:
            model.opset_imports["com.microsoft"] = 1
        modified = any(x.get("bits") != 32 for x in layers.values())
        return modified, {"layers": layers}
