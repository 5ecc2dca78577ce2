"""onnxruntime's own `MatMulNBitsQuantizer` run on an artifact's graph: the ort-default /
ort-hqq baselines `quantize_artifact` offers beside its own algorithms (same graph, same group
size), so a comparison needs nothing but a different `algo`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specport.artifact.manifest import DATA_NAME


def run_ort_baseline(
    model_path: Path, out_model: Path, algo: str, group_size: int, accuracy_level: int | None
) -> dict[str, Any]:
    """Quantize `model_path` into `out_model` with onnxruntime; returns the pass report."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        HQQWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    proto = onnx.load(str(model_path))
    if algo == "ort-hqq":
        cfg: Any = HQQWeightOnlyQuantConfig(block_size=group_size, bits=4)
    else:
        cfg = DefaultWeightOnlyQuantConfig(
            block_size=group_size, is_symmetric=False, accuracy_level=accuracy_level
        )
    q = MatMulNBitsQuantizer(proto, algo_config=cfg)
    q.process()
    onnx.save(q.model.model, str(out_model), save_as_external_data=True, location=DATA_NAME)
    return {"name": f"onnxruntime.{type(cfg).__name__}", "modified": True, "group_size": group_size}
