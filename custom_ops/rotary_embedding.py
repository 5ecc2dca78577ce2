# mypy: disable-error-code="arg-type,type-var"
# (onnxscript functions: ONNX types, not Python types)
"""specport.RotaryEmbedding (RoPE, full or partial, half-split "neox" layout).

Contract (mirrors ai.onnx RotaryEmbedding-23 with 4-D input):
    RotaryEmbedding(X [B, H, S, Dh], cos [B, S, R/2], sin [B, S, R/2]) -> Y [B, H, S, Dh]
        R = 2 * cos.shape[-1] <= Dh (partial rotary when R < Dh: the tail passes through)
        x1, x2 = X[..., :R/2], X[..., R/2:R]
        Y[..., :R] = concat(x1*cos - x2*sin, x2*cos + x1*sin);  Y[..., R:] = X[..., R:]
Interleaved (GPT-J) layout is not covered: the fusion leaves such nodes alone and says so.
Lowerings: cpu/cuda -> ai.onnx RotaryEmbedding-23 (ORT CPU kernel); cann -> function body;
torch_npu -> torch_npu.npu_rotary_mul.
"""

from __future__ import annotations

import numpy as np
from onnxscript import opset23 as op
from onnxscript import script

from specport.custom_ops._base import OPSET, CustomOp, register


def rotary_reference(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    half = cos.shape[-1]
    r = 2 * half
    c, s = cos[:, None], sin[:, None]  # [B, 1, S, R/2]
    x1, x2 = x[..., :half], x[..., half:r]
    out = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[..., r:]], axis=-1)
    return out.astype(x.dtype)


@script(OPSET, default_opset=op)
def RotaryEmbedding(X, cos, sin):
    half = op.Shape(cos, start=-1)
    rot = op.Add(half, half)
    axis = op.Constant(value_ints=[3])
    zero = op.Constant(value_ints=[0])
    big = op.Constant(value_ints=[9223372036854775807])
    x1 = op.Slice(X, zero, half, axis)
    x2 = op.Slice(X, half, rot, axis)
    rest = op.Slice(X, rot, big, axis)
    c = op.Unsqueeze(cos, op.Constant(value_ints=[1]))
    s = op.Unsqueeze(sin, op.Constant(value_ints=[1]))
    o1 = op.Sub(op.Mul(x1, c), op.Mul(x2, s))
    o2 = op.Add(op.Mul(x2, c), op.Mul(x1, s))
    return op.Concat(o1, o2, rest, axis=-1)


ROTARY_EMBEDDING = register(
    CustomOp(
        "RotaryEmbedding",
        RotaryEmbedding,
        rotary_reference,
        {
            "cpu": "ai.onnx.RotaryEmbedding-23",
            "cann": "function body",
            "torch_npu": "npu_rotary_mul",
        },
    )
)
