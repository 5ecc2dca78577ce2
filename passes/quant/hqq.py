"""Half-quadratic quantization (HQQ): calibration-free, with continuous zero points.

Its own module because it is the one algorithm that leaves float zero points (MatMulNBits
takes them as float32 `zero_points`) and the one iterative calibration-free search.
"""

from __future__ import annotations

import numpy as np

from specport.passes.quant.blockquant import (
    BlockQuant,
    block_codes,
    check_group_size,
    pack_blocks,
    to_blocks,
)


def quantize_hqq(
    w: np.ndarray,
    bits: int = 4,
    group_size: int = 32,
    iters: int = 20,
    lp_norm: float = 0.7,
    beta: float = 10.0,
    kappa: float = 1.01,
    tol: float = 1e-4,
) -> BlockQuant:
    """Half-quadratic quantization (Badri & Shaji 2023): calibration-free, float zero points.

    Minimises ||w - dequant(quant(w))||_p^p (p < 1, robust to outliers) over the zero point by
    alternating a proximal shrinkage step on the error with a closed-form zero update. The
    scale is refined once at the end by least squares given the codes, which the original
    keeps fixed; the best iterate by L2 block error is kept. As in the reference
    implementation the loop runs in float32 and stops early once the total L2 error improves
    by less than `tol` (relative) in an iteration: most blocks settle in a few iterations, and
    a 0.5B model then quantizes in minutes instead of half an hour of float64 passes.
    """
    check_group_size(w.shape[0], group_size)
    wb = to_blocks(w, group_size)[0].astype(np.float32)
    qmax = np.float32(2**bits - 1)
    mn, mx = wb.min(-1, keepdims=True), wb.max(-1, keepdims=True)
    scale = np.where(mx - mn == 0, np.float32(1.0), (mx - mn) / qmax).astype(np.float32)
    zero = (-mn / scale).astype(np.float32)
    ws = wb / scale  # the scale is fixed during the iterations
    best_err = np.full(scale.shape, np.inf, np.float32)
    best_scale, best_zero = scale.copy(), zero.copy()

    def track(s: np.ndarray, z: np.ndarray, q: np.ndarray) -> np.ndarray:
        """Keep (s, z) where the L2 error of codes q beats the best; returns the error e."""
        e = wb - (q - z) * s
        err = np.einsum("...g,...g->...", e, e)[..., None]
        better = err < best_err
        best_err[better] = err[better]
        best_scale[better] = np.broadcast_to(s, better.shape)[better]
        best_zero[better] = np.broadcast_to(z, better.shape)[better]
        return e

    total = np.inf
    for _ in range(iters):
        q = np.clip(np.round(ws + zero), 0, qmax)
        e = track(scale, zero, q)
        now = float(best_err.sum(dtype=np.float64))
        if now > total * (1 - tol):
            break
        total = now
        ae = np.abs(e)
        shrunk = np.maximum(
            ae - np.float32(1.0 / beta) * np.power(ae + np.float32(1e-8), lp_norm - 1), 0
        )
        w_e = np.copysign(shrunk, e)
        zero = np.mean(q - ws + w_e / scale, axis=-1, keepdims=True, dtype=np.float32)
        beta *= kappa
    # Least-squares refit of (scale, offset) given the best codes.
    scale, zero = best_scale, best_zero
    q = np.clip(np.round(wb / scale + zero), 0, qmax)
    qm = q.mean(-1, keepdims=True)
    wm = wb.mean(-1, keepdims=True)
    var = ((q - qm) ** 2).sum(-1, keepdims=True)
    s_ls = np.where(
        var > 0, ((q - qm) * (wb - wm)).sum(-1, keepdims=True) / np.where(var > 0, var, 1), scale
    )
    s_ls = np.where(np.abs(s_ls) < 1e-12, scale, s_ls).astype(np.float32)
    z_ls = (qm - wm / s_ls).astype(np.float32)
    track(s_ls, z_ls, np.clip(np.round(wb / s_ls + z_ls), 0, qmax))
    scale64, zero64 = best_scale[..., 0].astype(np.float64), best_zero[..., 0].astype(np.float64)
    q = block_codes(wb.astype(np.float64), scale64, zero64, bits)
    return pack_blocks(q, scale64, zero64, bits, group_size, w.shape[0], False)
