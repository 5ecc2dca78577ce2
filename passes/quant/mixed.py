"""Mixed precision `auto`: choose 4 or 8 bits per MatMul from weight statistics and measured
sensitivity on calibration activations.

Per layer we measure (1) the weight outlier ratio max|w| / IQR(w), which predicts how badly a
uniform 4-bit grid fits the distribution, and (2) the relative output error of quantizing the
layer with the chosen algorithm, trace(dW^T H dW) / trace(W^T H W), on the calibration Gram
matrix. The score is their product's square root weighted toward the measurement; layers scoring
above `threshold` x the median are promoted to 8 bits, highest first, within a budget of
`budget` of the quantized parameters. Everything measured is in the report.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx_ir as ir

from specport.passes.quant.blockquant import dequantize
from specport.passes.quant.calibration import ActStats
from specport.passes.quant.graph import find_weight_matmuls
from specport.passes.quant.weight_quant import output_rel_error, quantize_weight

logger = logging.getLogger(__name__)


def plan_mixed_precision(
    model: ir.Model,
    stats: Mapping[str, ActStats],
    bits: int,
    group_size: int,
    algo: str,
    budget: float = 0.25,
    threshold: float = 2.0,
) -> tuple[dict[str, int], dict[str, Any]]:
    """Returns ({site name: bits}, report). With bits 8 the plan keeps everything at 8."""
    sites = [s for s in find_weight_matmuls(model) if not s.lm_head]
    rows: list[dict[str, Any]] = []
    for site in sites:
        w = site.weight_array()
        q1, q3 = np.percentile(w, [25, 75])
        outlier = float(np.abs(w).max() / max(q3 - q1, 1e-12))
        st = stats.get(site.x.name or "")

        bq = quantize_weight(
            w, "rtn" if algo in ("default", "gptq") else algo, bits, group_size, False, st, False
        )
        err = output_rel_error(w, dequantize(bq), st)
        rows.append(
            {"name": site.name, "params": w.size, "outlier_ratio": outlier, "rel_output_error": err}
        )
    plan = {r["name"]: bits for r in rows}
    if bits == 4 and rows:
        errs = np.array([r["rel_output_error"] for r in rows])
        outl = np.array([r["outlier_ratio"] for r in rows])
        score = errs / np.median(errs) * np.sqrt(outl / np.median(outl))
        total = sum(r["params"] for r in rows)
        spent = 0
        for i in np.argsort(-score):
            if score[i] < threshold:
                break
            if spent + rows[i]["params"] > budget * total:
                continue
            plan[rows[i]["name"]] = 8
            spent += rows[i]["params"]
        for r, sc in zip(rows, score):
            r["score"] = round(float(sc), 4)
    for r in rows:
        r["bits"] = plan[r["name"]]
        r["rel_output_error"] = round(r["rel_output_error"], 8)
        r["outlier_ratio"] = round(r["outlier_ratio"], 3)
    promoted = [n for n, b in plan.items() if b != bits]
    logger.info("mixed precision: %d of %d layers promoted to 8 bits", len(promoted), len(rows))
    return plan, {
        "name": "plan_mixed_precision",
        "modified": False,
        "promoted": promoted,
        "layers_scored": rows,
    }
