"""Int8 and SmoothQuant math for W8A8: pure numpy.

Weights: asymmetric uint8 per output channel with a zero point (`quantize_uint8_per_channel`),
the form onnxruntime computes exactly on every x86 CPU; symmetric int8 per output channel
(`quantize_int8_per_channel`) is kept for layouts that require it (Ascend). Activations:
static per-tensor asymmetric uint8 from calibration ranges.

Why not int8 weights for onnxruntime: its uint8 x int8 GEMM (MatMulInteger,
MatMulIntegerToFloat, DynamicQuantizeMatMul) on AVX2 CPUs without VNNI multiplies with
vpmaddubsw, which adds two u8*s8 products in a saturating int16: 255*127*2 = 64770 > 32767,
so an activation code near 255 against two large weights gives a wrong result (measured on an
AVX2-only EPYC: a 26650 dot product off by 5117). uint8 x uint8 runs a non-saturating kernel
and an artifact is made once and run on whatever CPU the user has. SmoothQuant (Xiao et al. 2022) migrates activation outliers into the
weights with a per-input-channel scale s, exact in real arithmetic: (x / s) @ (diag(s) w).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# ---------------------------------------------------------------------------- int8 per channel


def quantize_int8_per_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per output channel: w [K, N] -> (q int8 [K, N], scale [N]); w ~ q * scale."""
    amax = np.abs(w).max(axis=0)
    scale = np.where(amax == 0, 1.0, amax / 127.0).astype(np.float32)
    q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
    return q, scale


def quantize_uint8_per_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric uint8 per output channel: w [K, N] -> (q uint8 [K, N], scale [N], zero
    uint8 [N]); w ~ (q - zero) * scale. The range [min, max] (widened to include 0, so zero
    is an exact code) uses all 256 levels: finer than symmetric int8's 255 over [-amax, amax].
    """
    lo = np.minimum(w.min(axis=0), 0.0).astype(np.float64)
    hi = np.maximum(w.max(axis=0), 0.0).astype(np.float64)
    scale = np.where(hi > lo, (hi - lo) / 255.0, 1.0).astype(np.float32)
    zero = np.clip(np.round(-lo / scale), 0, 255)
    q = np.clip(np.round(w / scale) + zero, 0, 255).astype(np.uint8)
    return q, scale, zero.astype(np.uint8)


def dequantize_uint8_per_channel(q: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    return (q.astype(np.float32) - zero.astype(np.float32)) * scale


def quantize_activation_uint8(lo: float, hi: float) -> tuple[np.float32, np.uint8]:
    """Static per-tensor asymmetric uint8 params covering [lo, hi] (always including 0)."""
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    scale = (hi - lo) / 255.0 if hi > lo else 1.0
    zp = int(np.clip(np.round(-lo / scale), 0, 255))
    return np.float32(scale), np.uint8(zp)


def fake_quant_uint8(x: np.ndarray, scale: float, zp: int) -> np.ndarray:
    return (np.clip(np.round(x / scale) + zp, 0, 255) - zp) * scale


# ------------------------------------------------------------------------------- SmoothQuant


def smoothquant_scales(act_absmax: np.ndarray, w_absmax: np.ndarray, alpha: float) -> np.ndarray:
    """s_j = max|X_j|^alpha / max|W_j|^(1-alpha) per input channel j (Xiao et al. 2022).

    The graph computes (x / s) @ (diag(s) w): exact in real arithmetic, while moving
    activation outliers into the weights, which tolerate them better.
    """
    a = np.maximum(act_absmax.astype(np.float64), 1e-5)
    wm = np.maximum(w_absmax.astype(np.float64), 1e-5)
    s = a**alpha / wm ** (1.0 - alpha)
    return np.clip(s, 1e-4, 1e4).astype(np.float32)


def w8a8_error(x: np.ndarray, w: np.ndarray, s: np.ndarray | None) -> float:
    """Relative output error of per-tensor uint8 activations x uint8 per-channel weights."""
    xs = x if s is None else x / s
    ws = w if s is None else w * s[:, None]
    sa, za = quantize_activation_uint8(xs.min(), xs.max())
    y = x @ w
    yq = fake_quant_uint8(xs, float(sa), int(za)) @ dequantize_uint8_per_channel(
        *quantize_uint8_per_channel(ws)
    )
    return float(np.sum((y - yq) ** 2) / max(np.sum(y**2), 1e-20))


def search_smoothquant(
    x: np.ndarray,
    weights: list[np.ndarray],
    act_absmax: np.ndarray,
    alphas: tuple[float, ...] = (0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8),
    error: Callable[[np.ndarray, np.ndarray, np.ndarray | None], float] = w8a8_error,
    tie: Callable[[np.ndarray], np.ndarray] | None = None,
) -> tuple[float | None, np.ndarray | None, float]:
    """Choose alpha for one activation shared by `weights` (e.g. q/k/v) on sample rows x [R, K].

    `tie` maps a per-channel vector [K] to one equal within each group of channels that must
    share a scale (the query heads of one KV head, when s is folded into the values): the
    maxima of activations and weights are tied before s is computed.
    Returns (alpha, s, error); alpha None means smoothing does not help and s is None.
    """
    w_absmax = np.max([np.abs(w).max(axis=1) for w in weights], axis=0)
    if tie is not None:
        act_absmax, w_absmax = tie(act_absmax), tie(w_absmax)
    best: tuple[float | None, np.ndarray | None, float] = (
        None,
        None,
        sum(error(x, w, None) for w in weights),
    )
    for a in alphas:
        s = smoothquant_scales(act_absmax, w_absmax, a)
        err = sum(error(x, w, s) for w in weights)
        if err < best[2]:
            best = (a, s, err)
    return best
