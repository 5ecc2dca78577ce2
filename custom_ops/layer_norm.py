# mypy: disable-error-code="arg-type,type-var"
# (onnxscript functions: ONNX types, not Python types)
"""specport.SkipLayerNorm (GPT-2 residual + LayerNorm).

Contract:
    SkipLayerNorm(X [..., D], skip [..., D], gamma [D], beta [D]; epsilon) -> (Y, Sum)
        Sum = X + skip;  Y = (Sum - mean) / sqrt(var + epsilon) * gamma + beta
Plain LayerNorm needs no op of ours: ai.onnx LayerNormalization (opset 17) runs everywhere ORT
does. Lowerings: cpu -> Add + LayerNormalization (faster than the contrib kernel there, see
custom_ops/lowering.py); cuda -> com.microsoft SkipLayerNormalization; cann -> function body.
"""

from __future__ import annotations

import numpy as np
from onnxscript import opset23 as op
from onnxscript import script

from specport.custom_ops._base import OPSET, CustomOp, register


def skip_layer_norm_reference(
    x: np.ndarray, skip: np.ndarray, gamma: np.ndarray, beta: np.ndarray, epsilon: float = 1e-5
) -> tuple[np.ndarray, np.ndarray]:
    s = (x + skip).astype(np.float64)
    mean = s.mean(-1, keepdims=True)
    var = ((s - mean) ** 2).mean(-1, keepdims=True)
    y = (s - mean) / np.sqrt(var + epsilon) * gamma + beta
    return y.astype(x.dtype), (x + skip)


@script(OPSET, default_opset=op)
def SkipLayerNorm(X, skip, gamma, beta, epsilon: float = 1e-5):
    total = op.Add(X, skip)
    axes = op.Constant(value_ints=[-1])
    mean = op.ReduceMean(total, axes, keepdims=1)
    d = op.Sub(total, mean)
    var = op.ReduceMean(op.Mul(d, d), axes, keepdims=1)
    eps = op.CastLike(op.Constant(value_float=epsilon), total)
    y = op.Mul(op.Div(d, op.Sqrt(op.Add(var, eps))), gamma)
    return op.Add(y, beta), total


SKIP_LAYER_NORM = register(
    CustomOp(
        "SkipLayerNorm",
        SkipLayerNorm,
        skip_layer_norm_reference,
        {"cpu": "com.microsoft.SkipLayerNormalization", "cann": "function body"},
    )
)
