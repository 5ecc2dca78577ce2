"""Quantize a graph whose weights are still lazy: `specport export SRC --quant w4a8`.

After a streaming export (exporter/checkpoint.py) every weight initializer reads its tensor
from the checkpoint when asked. Running the weight-only pass at that point reads each weight
once, one decoder layer at a time, and replaces it by its 4- or 8-bit blocks before the next is
read: the float model never exists, in memory or on disk, so a checkpoint larger than the
machine's memory in float32 (an 8B model: 32 GB) exports straight to 4 bits.

Only the calibration-free algorithms run here (rtn, hqq): calibrated ones need the float
model's activations, i.e. an exported float artifact (`specport quantize`).
"""

from __future__ import annotations

import logging
from typing import Any

import onnx_ir as ir

from specport.core.errors import QuantizationError
from specport.passes.quant.embedding import QuantizeEmbeddingPass
from specport.passes.quant.weight_only import QuantizeWeightsNBitsPass

logger = logging.getLogger(__name__)

INLINE_SCHEMES = ("w4a16", "w4a8", "w8a16")
INLINE_ALGOS = ("rtn", "hqq")


def check_inline(scheme: str, algo: str) -> None:
    """Refuse what cannot be quantized without calibration (before anything is loaded)."""
    if scheme not in INLINE_SCHEMES:
        raise QuantizationError(
            f"export --quant {scheme} is not supported; choose one of {', '.join(INLINE_SCHEMES)} "
            "(w8a8 needs calibrated activation ranges: export, then `specport quantize --calib`)"
        )
    if algo not in INLINE_ALGOS:
        raise QuantizationError(
            f"export --quant runs {' or '.join(INLINE_ALGOS)} (no calibration); for {algo!r} "
            "export in float, then `specport quantize --algo {algo} --calib FILE`"
        )


def quantize_inline(
    model: ir.Model,
    scheme: str,
    algo: str = "hqq",
    group_size: int = 32,
    lm_head_bits: int | None = None,
    embedding_bits: int | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Quantize `model` in place; returns (pass reports, the manifest's `quant` section).

    Defaults as `specport quantize`: an 8-bit head where activations are int8 (w4a8), float
    otherwise; an 8-bit embedding table for 4-bit schemes (`embedding_bits` 0 keeps it float).
    """
    check_inline(scheme, algo)
    bits = 8 if scheme == "w8a16" else 4
    if lm_head_bits is None:
        lm_head_bits = 8 if scheme == "w4a8" else 0
    if embedding_bits is None:
        embedding_bits = 8 if bits == 4 else 0  # as `specport quantize` (apply.py)
    weights = QuantizeWeightsNBitsPass(
        bits,
        group_size,
        algo if bits == 4 else "rtn",
        accuracy_level=4 if scheme == "w4a8" else None,
        lm_head_bits=lm_head_bits,
    )
    passes: list[Any] = [weights]
    if embedding_bits:
        passes.append(QuantizeEmbeddingPass(bits=embedding_bits, group_size=group_size))
    reports: list[dict[str, Any]] = []
    per_layer: dict[str, Any] = {}
    for p in passes:
        result = p(model)
        reports.append(result.report)
        per_layer.update(result.report.get("layers", {}))
    quant = {
        "scheme": scheme,
        "algorithm": algo,
        "group_size": group_size,
        "form": "matmulnbits",
        "accuracy_level": 4 if scheme == "w4a8" else 0,
        "lm_head_bits": lm_head_bits,
        "float_zero_points": False,
        "embedding_bits": embedding_bits,
        "mixed_precision": "off",
        "in_export": True,
        "layers": {k: v.get("bits") if isinstance(v, dict) else v for k, v in per_layer.items()},
        "calibration": None,
    }
    return reports, quant
