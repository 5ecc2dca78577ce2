"""Half-quadratic quantization (HQQ): calibration-free, with continuous zero points.

Its own module because it is the one algorithm that leaves float zero points (MatMulNBits
takes them as float32 `zero_points`) and the one iterative calibration-free search. Symmetric
weights have no zero point to fit; for them the calibration-free search is over each block's
scale instead (`quantize_symmetric_search`).
"""

from __future__ import annotations

import numpy as np

from specport.passes.quant.blockquant import (
    BlockQuant,
    block_codes,
    block_params,
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


def quantize_symmetric_search(
    w: np.ndarray,
    bits: int = 4,
    group_size: int = 32,
    steps: tuple[int, int] = (-4, 4),
    refine: int = 1,
) -> BlockQuant:
    """Symmetric blocks (codes -2^(b-1)..2^(b-1)-1, no zero point) with a searched scale.

    Why: symmetric weights are what onnxruntime's int8-activation MatMulNBits runs fastest (no
    zero points to apply), and round-to-nearest, which maps each block's signed extreme to -8,
    costs stories260K 18% more KL than asymmetric HQQ. Trying scales extreme/-(8 + 0.1 i) for
    i in `steps` (the idea of llama.cpp's make_qx_quants), taking each candidate's codes at
    their least-squares scale and keeping the smallest block error, then re-rounding `refine`
    times, measured (KL against fp32): stories260K 0.096 (RTN 0.112, asymmetric HQQ 0.095),
    SmolLM2-135M 0.342 (RTN 0.342, HQQ 0.344). A wider search (i in -9..24, as llama.cpp)
    errs less on the weights but more on SmolLM2's outputs (0.359): clipping a block's
    extreme costs more than the squared error says.
    """
    check_group_size(w.shape[0], group_size)
    wb = to_blocks(w, group_size)[0].astype(np.float32)
    half = 2 ** (bits - 1)
    zero = np.full(wb.shape[:-1], float(half))
    best_gain = np.full(wb.shape[:-1], -np.inf, np.float32)
    best_scale = np.ones(wb.shape[:-1], np.float32)

    def consider(scale: np.ndarray) -> None:
        """Codes at `scale`, their least-squares scale, kept where the block error drops.

        The error of codes L at scale s* = <w, L>/<L, L> is |w|^2 - <w, L>^2/<L, L>, so the
        best candidate is the one with the largest <w, L>^2/<L, L>."""
        codes = (block_codes(wb, scale, zero, bits) - half).astype(np.float32)
        ll = np.einsum("...g,...g->...", codes, codes)
        lw = np.einsum("...g,...g->...", codes, wb)
        safe = np.where(ll > 0, ll, np.float32(1.0))
        gain = np.where(ll > 0, lw * lw / safe, np.float32(0.0))
        better = gain > best_gain
        best_gain[better] = gain[better]
        best_scale[better] = np.where(lw * ll != 0, lw / safe, scale)[better]  # never 0

    for i in range(steps[0], steps[1] + 1):  # block_params maps the extreme to -half * ratio
        consider(block_params(wb, bits, True, half / (half + 0.1 * i))[0].astype(np.float32))
    for _ in range(refine):
        consider(best_scale.copy())
    return pack_blocks(
        block_codes(wb, best_scale, zero, bits),
        best_scale,
        zero,
        bits,
        group_size,
        w.shape[0],
        True,
    )
