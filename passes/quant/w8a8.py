"""W8A8 in QDQ form: int8 per-channel weights, static per-tensor uint8 activations, SmoothQuant.

For each activation x feeding one or more weight MatMuls (q/k/v share the attention norm
output, gate/up share the MLP norm output):

1. SmoothQuant: choose alpha on calibration rows (or no smoothing when it does not help);
   s [K] is shared by every consumer. x / s is folded into the RMSNormalization scale when x
   comes straight from a norm whose every user is one of these MatMuls; otherwise an explicit
   Mul(x, 1/s) is inserted.
2. x' -> QuantizeLinear -> DequantizeLinear (uint8, range from calibration min/max of x / s).
3. W' = diag(s) W -> int8 per output channel -> DequantizeLinear(axis=1) -> MatMul.

onnxruntime's QDQ transformer fuses DQ->MatMul<-DQ into MatMulIntegerToFloat (or QLinearMatMul
when the output is quantized too), so the integer kernels run; the pass does not depend on it.
The LM head stays weight-only (8-bit MatMulNBits) unless `lm_head_bits` is 0 (kept float).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import onnx_ir as ir

from specport.passes.base import Pass
from specport.passes.quant import smoothquant as SQ
from specport.passes.quant.calibration import ActStats
from specport.passes.quant.graph import (
    WeightSite,
    add_initializer,
    find_weight_matmuls,
    named,
    remove_unused,
    replace_node,
)
from specport.passes.quant.weight_only import QuantizeWeightsNBitsPass

logger = logging.getLogger(__name__)

# Norm op -> index of its scale (gamma) input.
NORM_OPS = {
    "RMSNormalization": 1,
    "SimplifiedLayerNormalization": 1,
    "SkipSimplifiedLayerNormalization": 2,
}


def _norm_scale(x: ir.Value, sites: list[WeightSite]) -> tuple[ir.Node, int] | None:
    """(norm node, index of its scale input) when x = Norm(h, scale) can absorb 1/s, else None."""
    prod = x.producer()
    if prod is None or prod.op_type not in NORM_OPS or prod.outputs[0] is not x:
        return None
    consumers = {id(u) for u, _ in x.uses()}
    if consumers != {id(s.node) for s in sites} or x.is_graph_output():
        return None
    idx = NORM_OPS[prod.op_type]
    scale = prod.inputs[idx] if len(prod.inputs) > idx else None
    if scale is None or scale.const_value is None or not scale.is_initializer():
        return None
    return prod, idx


def _fold_into_norm(graph: ir.Graph, norm: ir.Node, idx: int, s: np.ndarray) -> None:
    """gamma <- gamma / s; a scale shared with other norms (exporters deduplicate equal
    initializers) gets a private copy first."""
    scale = norm.inputs[idx]
    assert scale is not None and scale.const_value is not None
    gamma = scale.const_value.numpy().astype(np.float32) / s
    if len(list(scale.uses())) == 1:
        scale.const_value = ir.tensor(gamma, name=scale.name)
    else:
        norm.replace_input_with(idx, add_initializer(graph, f"{scale.name}.smoothed", gamma))


class QuantizeW8A8Pass(Pass):
    """Static W8A8 with SmoothQuant; needs calibration statistics per MatMul input."""

    name = "quantize_w8a8"

    def __init__(
        self,
        stats: dict[str, ActStats],
        smooth: bool = True,
        lm_head_bits: int = 8,
        group_size: int = 128,
        alphas: tuple[float, ...] = (0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8),
    ) -> None:
        self.stats, self.smooth, self.lm_head_bits = stats, smooth, lm_head_bits
        self.group_size, self.alphas = group_size, alphas

    def precondition(self, model: ir.Model) -> str | None:
        sites = [s for s in find_weight_matmuls(model) if not s.lm_head]
        if not sites:
            return "no MatMul with a constant weight"
        missing = [s.x.name for s in sites if s.x.name not in self.stats]
        return f"no calibration statistics for {missing[:3]}" if missing else None

    def rewrite(self, model: ir.Model) -> tuple[bool, dict[str, Any]]:
        graph = model.graph
        groups: dict[str, list[WeightSite]] = {}
        heads: list[WeightSite] = []
        for site in find_weight_matmuls(model):
            if site.lm_head:
                heads.append(site)
            else:
                groups.setdefault(site.x.name or "", []).append(site)
        layers: dict[str, Any] = {}
        folded = explicit = 0
        for xname, sites in groups.items():
            st = self.stats[xname]
            x = sites[0].x
            weights = [s.weight_array() for s in sites]
            alpha, s, err = None, None, None
            if self.smooth:
                alpha, s, err = SQ.search_smoothquant(
                    st.rows_sample(), weights, st.absmax, self.alphas
                )
            if s is not None:
                norm = _norm_scale(x, sites)
                if norm is not None:
                    _fold_into_norm(graph, norm[0], norm[1], s)
                    folded += 1
                    how = "folded into norm"
                else:
                    inv = add_initializer(
                        graph, f"{xname}.smooth_inv", (1.0 / s).astype(np.float32)
                    )
                    mul = ir.node("Mul", [x, inv], name=f"{sites[0].name}/SmoothQuantMul")
                    graph.insert_before(sites[0].node, named(mul))
                    x = mul.outputs[0]
                    x.name = f"{xname}.smoothed"
                    explicit += 1
                    how = "explicit Mul"
                lo, hi = float(np.min(st.lo / s)), float(np.max(st.hi / s))
            else:
                how = "none"
                lo, hi = float(st.lo.min()), float(st.hi.max())
            sa, za = SQ.quantize_activation_uint8(lo, hi)
            sv = add_initializer(graph, f"{xname}.act_scale", np.array(sa, dtype=np.float32))
            zv = add_initializer(graph, f"{xname}.act_zero", np.array(za, dtype=np.uint8))
            ql = ir.node("QuantizeLinear", [x, sv, zv], name=f"{sites[0].name}/QuantizeLinear")
            dql = ir.node(
                "DequantizeLinear",
                [ql.outputs[0], sv, zv],
                name=f"{sites[0].name}/DequantizeLinear",
            )
            graph.insert_before(sites[0].node, [named(ql), named(dql)])
            xq = dql.outputs[0]
            for site, w in zip(sites, weights):
                ws = w if s is None else w * s[:, None]
                q, sw = SQ.quantize_int8_per_channel(ws)
                qv = add_initializer(graph, f"{site.name}.w8", q)
                swv = add_initializer(graph, f"{site.name}.w8_scale", sw)
                dqw = ir.node(
                    "DequantizeLinear",
                    [qv, swv],
                    {"axis": 1},
                    name=f"{site.name}/DequantizeLinearW",
                )
                mm = ir.node("MatMul", [xq, dqw.outputs[0]], name=f"{site.name}/MatMul")
                replace_node(graph, site.node, [dqw, mm], mm.outputs[0])
                layers[site.name] = {
                    "bits": 8,
                    "activation_bits": 8,
                    "smooth_alpha": alpha,
                    "smoothing": how,
                    "act_range": [round(lo, 6), round(hi, 6)],
                    "sample_rel_error": None if err is None else round(err / len(sites), 8),
                }
        head_report: dict[str, Any] = {}
        if heads and self.lm_head_bits:
            plan = {h.name: self.lm_head_bits for h in heads}
            sub = QuantizeWeightsNBitsPass(
                8, self.group_size, "rtn", lm_head_bits=self.lm_head_bits, plan=plan
            )
            _, head_report = sub.rewrite(model)
            layers.update(head_report["layers"])
        remove_unused(model)
        if model.opset_imports.get("", 0) < 21:
            model.opset_imports[""] = 21
        return bool(layers), {
            "smoothing_folded": folded,
            "smoothing_explicit": explicit,
            "layers": layers,
        }
