"""What the onnxruntime CANN execution provider can run, and a check of a graph against it.

Source: onnxruntime `onnxruntime/core/providers/cann/cann_execution_provider.cc`, kernel
registrations in `RegisterCANNKernels` (microsoft/onnxruntime at commit
a774228376990fe7c990d42e56d722c481b3abd6; op types only, all type/version variants merged).
Ops outside this set still run: ORT assigns them to the CPU EP (host round trips). Ops outside
the ai.onnx domain (specport, com.microsoft) or the opset-23 fused ops the EP has no kernel for
(RMSNormalization, RotaryEmbedding, Attention) are what the `cann` lowering must remove.

A W8A8 `cann` artifact (Ascend's layout, passes/quant/w8a8.py form `ascend`) adds
QuantizeLinear / DequantizeLinear: the EP registers no single-op kernel for them, so they are
counted apart (`quant_ops`) rather than as CPU fallbacks; whether the EP's graph mode hands
them to Ascend's graph compiler as one quantized graph has not been checked on a device.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import onnx_ir as ir

logger = logging.getLogger(__name__)

CANN_EP_OPS = frozenset(
    {
        "Abs", "Add", "AveragePool", "BatchNormalization", "Cast", "Ceil", "Conv", "Cos",
        "Div", "Dropout", "Erf", "Exp", "Flatten", "Floor", "Gemm", "GlobalAveragePool",
        "GlobalMaxPool", "Identity", "Log", "MatMul", "MaxPool", "Mul", "Neg", "Reciprocal",
        "Relu", "Reshape", "Round", "Sin", "Sqrt", "Sub", "Transpose",
    }
)  # fmt: skip

# Fused standard ops new in opset 23 that the CANN EP has no kernel for and that the CPU
# fallback would run far from the NPU: the lowering must decompose them.
NOT_ON_CANN = frozenset({"RMSNormalization", "RotaryEmbedding", "Attention"})
QUANT_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})


def check_ops(model: ir.Model) -> dict[str, Any]:
    """Split the main graph's ops into NPU kernels, CPU fallbacks and forbidden ops."""
    counts: Counter[str] = Counter()
    forbidden: Counter[str] = Counter()
    quant: Counter[str] = Counter()
    for node in model.graph.all_nodes():
        if node.domain not in ("", "ai.onnx"):
            forbidden[f"{node.domain}.{node.op_type}"] += 1
        elif node.op_type in NOT_ON_CANN:
            forbidden[node.op_type] += 1
        elif node.op_type in QUANT_OPS:
            quant[node.op_type] += 1
        else:
            counts[node.op_type] += 1
    on_npu = {k: v for k, v in counts.items() if k in CANN_EP_OPS}
    fallback = {k: v for k, v in counts.items() if k not in CANN_EP_OPS}
    total = sum(counts.values()) or 1
    return {
        "ok": not forbidden,
        "forbidden": dict(forbidden),
        "npu_kernels": dict(sorted(on_npu.items())),
        "cpu_fallback": dict(sorted(fallback.items())),
        "npu_fraction": round(sum(on_npu.values()) / total, 3),
        "quant_ops": dict(sorted(quant.items())),
    }
