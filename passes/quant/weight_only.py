"""Weight-only blockwise quantization of MatMul weights (W4A16, W8A16, W4A8).

Two output forms of the same BlockQuant:

- `matmulnbits` (onnxruntime CPU/CUDA): MatMul(x, W) -> com.microsoft.MatMulNBits(x, B, scales,
  zero_points) with attributes K, N, bits, block_size and optionally accuracy_level (4 = int8
  activations computed inside the kernel: the W4A8 scheme). K need not be a multiple of the
  block size (the kernel pads).
- `qdq` (any ONNX runtime with opset 21 blocked quantization): MatMul(x, DequantizeLinear(Wq,
  scale, zero, axis=0, block_size=g)) with Wq uint4 [K, N], scale/zero [ceil(K/g), N]. Zero
  points must be integers here, so HQQ's float zeros are rounded. Note: onnxruntime's CPU
  optimizer fuses this pair into MatMulNBits with accuracy level 4 (int8 activations) unless
  the session config `session.qdq_matmulnbits_accuracy_level` is "0" (measured: ~2% output
  difference on random data), so the QDQ form runs as W4A8 on onnxruntime by default.

The tied LM head pattern MatMul(x, Transpose(E)) is handled by quantizing E^T; E itself stays
for the embedding Gather (see embedding.py) and is dropped when nothing uses it any more.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import onnx_ir as ir

from specport.core.errors import QuantizationError
from specport.core.progress import track
from specport.passes.base import Pass
from specport.passes.quant.block_offsets import (
    activation_rank,
    block_offsets_form,
    with_block_offsets,
)
from specport.passes.quant.blockquant import (
    BlockQuant,
    check_group_size,
    dequantize,
    pack_matmul_nbits,
)
from specport.passes.quant.calibration import ActStats
from specport.passes.quant.gptq import gptq_factor
from specport.passes.quant.graph import (
    WeightSite,
    add_initializer,
    find_weight_matmuls,
    layer_chunks,
    named,
    release_weight,
    remove_unused,
    replace_node,
)
from specport.passes.quant.rtn import quantize_rtn
from specport.passes.quant.weight_quant import (
    ALGOS,
    CHUNK_ELEMENTS,
    NEEDS_CALIB,
    PARALLEL_MIN_ELEMENTS,
    WORKERS,
    better_rows,
    concat_rows,
    error_terms,
    head_group_size,
    integer_zero_points,
    quantize_weight,
)

logger = logging.getLogger(__name__)


class QuantizeWeightsNBitsPass(Pass):
    """Replace MatMuls with constant weights by blockwise-quantized ones.

    `plan` maps a site name to its bits (4, 8, or 0 = keep fp32); sites absent from it use
    `bits`, except the LM head which uses `lm_head_bits`. `group_plan` maps a site name to its
    block size (a size budget's choice, passes/quant/budget.py).
    """

    name = "quantize_weights_nbits"
    activity = "quantizing weights"

    def __init__(
        self,
        bits: int = 4,
        group_size: int = 32,
        algo: str = "rtn",
        symmetric: bool = False,
        stats: Mapping[str, ActStats] | None = None,
        form: str = "matmulnbits",
        accuracy_level: int | None = None,
        lm_head_bits: int = 8,
        plan: dict[str, int] | None = None,
        float_zero: bool = False,
        pack: bool = True,
        lm_head_group_size: int | None = None,
        group_plan: dict[str, int] | None = None,
        float_zero_sites: set[str] | None = None,
    ) -> None:
        # float_zero: let refit/HQQ/RTN keep float zero points, emitted as symmetric codes plus
        # block offsets (block_offsets.py: onnxruntime's own float zero points run a slow
        # fallback); they cost 6.0 bits per weight at block 32 against 5.125, so integer zero
        # points stay the default and a size budget weighs the two (budget.py).
        if algo not in ALGOS:
            raise QuantizationError(f"unknown algorithm {algo!r}; choose one of {', '.join(ALGOS)}")
        if form not in ("matmulnbits", "qdq"):
            raise QuantizationError(f"unknown weight-only form {form!r}; use matmulnbits or qdq")
        if algo in NEEDS_CALIB and not stats:
            raise QuantizationError(f"algorithm {algo!r} needs calibration data; pass --calib FILE")
        check_group_size(1, group_size)
        self.bits, self.group_size, self.algo, self.symmetric = bits, group_size, algo, symmetric
        self.stats = stats or {}
        self.form, self.accuracy_level = form, accuracy_level
        self.lm_head_bits, self.plan = lm_head_bits, plan or {}
        self.group_plan = group_plan or {}  # site name -> block size (a size budget's plan)
        # None: `head_group_size`'s rule; an int: that block size for the head at any width
        if lm_head_group_size is not None:
            check_group_size(1, lm_head_group_size)
        self.lm_head_group_size = lm_head_group_size
        self.float_zero = float_zero
        # A size budget's choice (budget.py): these 4-bit sites keep float zero points, every
        # other site integer ones, whatever `float_zero` says.
        self.float_zero_sites = float_zero_sites
        # site name -> (report row, weight) already quantized by this pass's own settings (the
        # LM head that `--lm-head-bits auto` measured): used instead of quantizing it again.
        self.prequantized: dict[str, tuple[dict[str, Any], BlockQuant]] = {}
        # pack: sibling MatMuls that read the same input (q/k/v, gate/up) become one
        # MatMulNBits + Split. Blocks run along K, so this changes no number; it saves a kernel
        # launch and an activation quantization per sibling (decode is launch-bound at batch 1).
        self.pack = pack
        # A tied head's table name -> (its MatMulNBits, bits, block, K): the embedding pass can
        # gather from these same codes instead of storing the matrix a second time.
        self.tied_heads: dict[str, tuple[ir.Node, int, int, int]] = {}

    def precondition(self, model: ir.Model) -> str | None:
        return None if find_weight_matmuls(model) else "no MatMul with a constant 2-D float weight"

    def bits_for(self, site: WeightSite) -> int:
        if site.name in self.plan:
            return self.plan[site.name]
        return self.lm_head_bits if site.lm_head else self.bits

    def group_for(self, site: WeightSite, bits: int) -> int:
        """The site's block size: the plan's, else `group_size`, except the LM head (see
        `head_group_size`)."""
        if site.name in self.group_plan:
            return self.group_plan[site.name]
        if not site.lm_head:
            return self.group_size
        if self.lm_head_group_size is not None:
            return self.lm_head_group_size
        return head_group_size(site.k, bits, self.group_size, self.accuracy_level == 4)

    def rewrite(self, model: ir.Model) -> tuple[bool, dict[str, Any]]:
        graph = model.graph
        layers: dict[str, dict[str, Any]] = {}
        modified = False
        packed = 0
        chunks = layer_chunks(find_weight_matmuls(model))
        desc = f"quantizing weights ({self.algo})"  # one step per decoder layer
        for chunk in track(chunks, desc, every_step=True):
            # One decoder layer at a time: its weights are read, quantized and emitted, and
            # their memory-mapped fp32 pages released, before the next layer is touched.
            pending: list[tuple[WeightSite, BlockQuant]] = []
            for site in chunk:
                row, bq = self._quantize_site(site)
                layers[site.name] = row
                if bq is None:
                    continue
                modified = True
                if self.form == "matmulnbits":
                    pending.append((site, bq))
                else:
                    self._emit_qdq(graph, site, bq)
                release_weight(site.weight)
            packed += self.emit_nbits_groups(graph, pending)
        remove_unused(model)
        if modified:
            _ensure_opset(
                model, "com.microsoft", 1
            ) if self.form == "matmulnbits" else _ensure_opset(model, "", 21)
        details = {
            "form": self.form,
            "algo": self.algo,
            "group_size": self.group_size,
            "symmetric": self.symmetric,
            "accuracy_level": self.accuracy_level,
            "packed_groups": packed,
            "layers": layers,
        }
        return modified, details

    def _quantize_site(self, site: WeightSite) -> tuple[dict[str, Any], BlockQuant | None]:
        """(report row, quantized weight or None when the site stays in float)."""
        bits = self.bits_for(site)
        group = self.group_for(site, bits)
        done = self.prequantized.pop(site.name, None)
        if done is not None and (done[0]["bits"], done[0].get("group_size")) == (bits, group):
            return done
        if bits not in (4, 8):
            return {"bits": 32, "reason": "kept in float by plan"}, None
        if self.form == "qdq" and bits != 4:
            return {"bits": 32, "reason": "qdq form supports 4 bits only"}, None
        w = site.weight_array()
        stats = self.stats.get(site.x.name or "")
        # HQQ's float zero points exist only for 4 bits in MatMulNBits; 8 bits uses RTN.
        algo = self.algo if bits == 4 or self.algo != "hqq" else "rtn"
        float_zero = self.form == "matmulnbits" and (
            self.float_zero if self.float_zero_sites is None else site.name in self.float_zero_sites
        )
        k, n = w.shape
        gptq = algo in ("gptq", "default")
        # GPTQ's linear algebra already uses every core (BLAS); the elementwise algorithms
        # are single-threaded numpy, which releases the GIL: their row chunks run in threads.
        workers = 1 if gptq else WORKERS
        step = max(1, CHUNK_ELEMENTS // max(k, 1))
        if workers > 1 and w.size >= PARALLEL_MIN_ELEMENTS:
            step = min(step, -(-n // workers))
        factor = None
        if n > step and stats is not None and gptq:
            factor = gptq_factor(stats.hessian, act_order=algo == "default")
        h = stats.hessian if stats is not None else None

        def chunk(a: int) -> tuple[BlockQuant, float, float]:
            wc = np.ascontiguousarray(w[:, a : a + step])
            bq = quantize_weight(wc, algo, bits, group, self.symmetric, stats, float_zero, factor)
            if not float_zero and not bq.integer_zero:
                bq = integer_zero_points(bq, wc)
            if float_zero and bits == 4 and algo != "rtn" and not self.symmetric:
                bq = better_rows(bq, quantize_rtn(wc, 4, group, float_zero=True), wc, h)
            return (bq, *error_terms(wc, dequantize(bq), h))

        starts = range(0, n, step)
        if workers > 1 and len(starts) > 1:
            with ThreadPoolExecutor(workers) as pool:
                results = list(pool.map(chunk, starts))
        else:
            results = [chunk(a) for a in starts]
        parts = [r[0] for r in results]
        bq = parts[0] if len(parts) == 1 else concat_rows(parts)
        err = sum(r[1] for r in results) / max(sum(r[2] for r in results), 1e-30)
        row = {
            "bits": bits,
            "algo": algo,
            "group_size": group,
            "k": site.k,
            "n": site.n,
            "lm_head": site.lm_head,
            "rel_output_error": round(err, 8),
        }
        return row, bq

    def emit_nbits_groups(self, graph: ir.Graph, items: list[tuple[WeightSite, BlockQuant]]) -> int:
        """Emit MatMulNBits for every (site, quantized weight); with `pack`, siblings sharing an
        input and a precision are packed along N (LM heads stay alone). Returns the packed count."""
        groups: dict[tuple[int, int, bool, int], list[tuple[WeightSite, BlockQuant]]] = {}
        for site, bq in items:
            key = (id(site.x), bq.bits, bq.integer_zero, bq.group_size)
            if not self.pack or site.lm_head:
                key = (id(site), -1, False, 0)
            groups.setdefault(key, []).append((site, bq))
        for group in groups.values():
            if len(group) == 1:
                self._emit_nbits(graph, *group[0])
            else:
                self._emit_packed(graph, group)
        return sum(len(g) > 1 for g in groups.values())

    def _emit_packed(self, graph: ir.Graph, group: list[tuple[WeightSite, BlockQuant]]) -> None:
        sites = [s for s, _ in group]
        bqs = [b for _, b in group]
        bq = dataclasses.replace(
            bqs[0],
            q=np.concatenate([b.q for b in bqs], axis=0),
            scale=np.concatenate([b.scale for b in bqs], axis=0),
            zero=np.concatenate([b.zero for b in bqs], axis=0),
            symmetric=all(b.symmetric for b in bqs),
        )
        first = sites[0]
        packed = dataclasses.replace(first, n=sum(s.n for s in sites))
        base = f"{first.name}.packed{len(sites)}"
        node = self._nbits_node(packed, bq, graph, base)
        rank = activation_rank(first.x, first.node.outputs[0])
        nodes, out = with_block_offsets(graph, first.x, packed.k, bq, base, node, rank)
        sizes = add_initializer(
            graph, f"{first.name}.packed_split", np.array([s.n for s in sites], dtype=np.int64)
        )
        split = ir.node(
            "Split",
            [out, sizes],
            {"axis": -1},
            num_outputs=len(sites),
            name=f"{first.name}/PackedSplit",
        )
        graph.insert_before(first.node, [*(named(n) for n in nodes), named(split)])
        for site, out in zip(sites, split.outputs):
            old = site.node.outputs[0]
            out.shape, out.type, name = old.shape, old.type, old.name
            ir.convenience.replace_all_uses_with(old, out, replace_graph_outputs=True)
            graph.remove(site.node, safe=True)
            old.name, out.name = f"{name}_replaced", name

    def _nbits_node(self, site: WeightSite, bq: BlockQuant, graph: ir.Graph, base: str) -> ir.Node:
        if block_offsets_form(bq, activation_rank(site.x, site.node.outputs[0])):
            # codes only: the zero points become block offsets (block_offsets.py)
            bq = dataclasses.replace(bq, zero=np.full_like(bq.zero, 8.0), symmetric=True)
        packed = pack_matmul_nbits(bq)
        b = add_initializer(graph, f"{base}.q{bq.bits}.B", packed["B"])
        s = add_initializer(graph, f"{base}.q{bq.bits}.scales", packed["scales"])
        inputs: list[ir.Value | None] = [site.x, b, s]
        if "zero_points" in packed:
            zp = add_initializer(graph, f"{base}.q{bq.bits}.zero_points", packed["zero_points"])
            inputs.append(zp)
        attrs: dict[str, Any] = {
            "K": site.k,
            "N": site.n,
            "bits": bq.bits,
            "block_size": bq.group_size,
        }
        if self.accuracy_level:
            attrs["accuracy_level"] = self.accuracy_level
        return ir.node(
            "MatMulNBits", inputs, attrs, domain="com.microsoft", name=f"{base}/MatMulNBits"
        )

    def _emit_nbits(self, graph: ir.Graph, site: WeightSite, bq: BlockQuant) -> None:
        node = self._nbits_node(site, bq, graph, site.name)
        rank = activation_rank(site.x, site.node.outputs[0])
        nodes, out = with_block_offsets(graph, site.x, site.k, bq, site.name, node, rank)
        replace_node(graph, site.node, nodes, out)
        # A table gathers integer codes only: a head with block offsets is not shared.
        if site.lm_head and site.transposed and site.weight.name and bq.integer_zero:
            self.tied_heads[site.weight.name] = (node, bq.bits, bq.group_size, site.k)

    def _emit_qdq(self, graph: ir.Graph, site: WeightSite, bq: BlockQuant) -> None:
        k, g = bq.k, bq.group_size
        if not bq.integer_zero:
            bq = integer_zero_points(bq, site.weight_array())
        zero = bq.zero
        q = bq.q.astype(np.float64)
        base = f"{site.name}.q4"
        qv = add_initializer(
            graph, f"{base}.weight", np.ascontiguousarray(q[:, :k].T).astype(np.uint8)
        )
        qv.const_value = ir.tensor(qv.const_value.numpy(), dtype=ir.DataType.UINT4, name=qv.name)  # type: ignore[union-attr]
        qv.type = ir.TensorType(ir.DataType.UINT4)
        sv = add_initializer(
            graph, f"{base}.scale", np.ascontiguousarray(bq.scale.T).astype(np.float32)
        )
        zv = add_initializer(graph, f"{base}.zero", np.ascontiguousarray(zero.T).astype(np.uint8))
        zv.const_value = ir.tensor(zv.const_value.numpy(), dtype=ir.DataType.UINT4, name=zv.name)  # type: ignore[union-attr]
        zv.type = ir.TensorType(ir.DataType.UINT4)
        dq = ir.node(
            "DequantizeLinear",
            [qv, sv, zv],
            {"axis": 0, "block_size": g},
            name=f"{site.name}/DequantizeLinear",
        )
        mm = ir.node("MatMul", [site.x, dq.outputs[0]], name=f"{site.name}/MatMul")
        replace_node(graph, site.node, [dq, mm], mm.outputs[0])


def _ensure_opset(model: ir.Model, domain: str, version: int) -> None:
    if model.opset_imports.get(domain, 0) < version:
        model.opset_imports[domain] = version
