"""What onnxruntime makes of a quantized graph: the op histogram after its CPU optimizations.

QDQ is only a promise of integer arithmetic; this check records whether onnxruntime kept it
(DQ -> MatMul <- DQ fused into MatMulIntegerToFloat / QLinearMatMul / DynamicQuantizeMatMul) or
fell back to dequantize-then-float-MatMul, so the manifest tells the truth about the kernels.
"""

from __future__ import annotations

import collections
import logging
import tempfile
from pathlib import Path

import onnx
import onnxruntime as ort

logger = logging.getLogger(__name__)

INTEGER_KERNELS = (
    "MatMulIntegerToFloat",
    "QLinearMatMul",
    "DynamicQuantizeMatMul",
    "MatMulInteger",
    "MatMulNBits",
)


def ort_optimized_ops(model_path: str | Path) -> dict[str, int]:
    """Op histogram of the model as onnxruntime's CPU provider will run it (all optimizations)."""
    with tempfile.TemporaryDirectory(prefix="specport-ortopt-") as tmp:
        out = Path(tmp) / "opt.onnx"
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        so.optimized_model_filepath = str(out)
        so.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name", "opt.onnx.data"
        )
        ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])
        m = onnx.load(str(out), load_external_data=False)
    counts = collections.Counter(
        (f"{n.domain}." if n.domain else "") + n.op_type for n in m.graph.node
    )
    return dict(sorted(counts.items()))


def integer_kernel_summary(model_path: str | Path) -> dict[str, object]:
    """{kernels: {op: count}, float_matmuls: n, dequantize_linear_left: n} after ORT optimization."""
    ops = ort_optimized_ops(model_path)
    kernels = {k: v for k, v in ops.items() if k.split(".")[-1] in INTEGER_KERNELS}
    return {
        "kernels": kernels,
        "float_matmuls": ops.get("MatMul", 0),
        "dequantize_linear_left": ops.get("DequantizeLinear", 0),
    }
