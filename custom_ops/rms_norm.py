# mypy: disable-error-code="arg-type,type-var"
# (onnxscript functions: ONNX types, not Python types)
"""specport.RMSNorm and specport.SkipRMSNorm (Llama, Qwen, Mistral, Phi-3, Gemma norms).

Contract:
    RMSNorm(X [..., D], scale [D]; epsilon) -> Y [..., D]
        Y = X / sqrt(mean(X^2, -1) + epsilon) * scale          (computed in X's dtype)
    SkipRMSNorm(X [..., D], skip [..., D], scale [D]; epsilon) -> (Y [..., D], Sum [..., D])
        Sum = X + skip;  Y = RMSNorm(Sum)                       (the residual add fused in)

Gemma's `(1 + w)` scale is already folded into the exported weight, so one op covers all.
Lowerings: cpu/cuda -> com.microsoft SimplifiedLayerNormalization / SkipSimplifiedLayerNormalization
(or ai.onnx RMSNormalization-23, see lowering.py); cann -> the function body below;
torch_npu -> torch_npu.npu_rms_norm.
"""

from __future__ import annotations

import numpy as np
from onnxscript import opset23 as op
from onnxscript import script

from specport.custom_ops._base import OPSET, CustomOp, register


def rms_norm_reference(x: np.ndarray, scale: np.ndarray, epsilon: float = 1e-6) -> np.ndarray:
    x64 = x.astype(np.float64)
    inv = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + epsilon)
    return (x64 * inv * scale).astype(x.dtype)


def skip_rms_norm_reference(
    x: np.ndarray, skip: np.ndarray, scale: np.ndarray, epsilon: float = 1e-6
) -> tuple[np.ndarray, np.ndarray]:
    s = x + skip
    return rms_norm_reference(s, scale, epsilon), s


@script(OPSET, default_opset=op)
def RMSNorm(X, scale, epsilon: float = 1e-6):
    ms = op.ReduceMean(op.Mul(X, X), op.Constant(value_ints=[-1]), keepdims=1)
    eps = op.CastLike(op.Constant(value_float=epsilon), X)
    inv = op.Reciprocal(op.Sqrt(op.Add(ms, eps)))
    return op.Mul(op.Mul(X, inv), scale)


@script(OPSET, default_opset=op)
def SkipRMSNorm(X, skip, scale, epsilon: float = 1e-6):
    total = op.Add(X, skip)
    ms = op.ReduceMean(op.Mul(total, total), op.Constant(value_ints=[-1]), keepdims=1)
    eps = op.CastLike(op.Constant(value_float=epsilon), total)
    inv = op.Reciprocal(op.Sqrt(op.Add(ms, eps)))
    return op.Mul(op.Mul(total, inv), scale), total


RMS_NORM = register(
    CustomOp(
        "RMSNorm",
        RMSNorm,
        rms_norm_reference,
        {
            "cpu": "com.microsoft.SimplifiedLayerNormalization",
            "cann": "function body",
            "torch_npu": "npu_rms_norm",
        },
    )
)
SKIP_RMS_NORM = register(
    CustomOp(
        "SkipRMSNorm",
        SkipRMSNorm,
        skip_rms_norm_reference,
        {
            "cpu": "com.microsoft.SkipSimplifiedLayerNormalization",
            "cann": "function body",
            "torch_npu": "npu_rms_norm (after add)",
        },
    )
)
