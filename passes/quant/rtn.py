"""Round-to-nearest quantization and its learned clipping (AWQ-style clip search).

RTN is the calibration-free baseline; `search_clip` picks a per-(row, block) range-shrink ratio
that minimises the output error given the activation Gram matrix (or the weight MSE without
one), and GPTQ reuses it for its clip search.
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


def quantize_rtn(
    w: np.ndarray,
    bits: int = 4,
    group_size: int = 32,
    symmetric: bool = False,
    clip_ratio: np.ndarray | float = 1.0,
    float_zero: bool = False,
) -> BlockQuant:
    """Round-to-nearest blockwise quantization of w [K, N]; clip_ratio [N, n_blocks] or scalar.

    `float_zero` (asymmetric): min/max RTN with float zero points, llama.cpp's Q4_1 at 4 bits
    and block 32 (`block_params`)."""
    check_group_size(w.shape[0], group_size)
    wb, _ = to_blocks(w, group_size)
    scale, zero = block_params(wb, bits, symmetric, clip_ratio, float_zero and not symmetric)
    return pack_blocks(
        block_codes(wb, scale, zero, bits), scale, zero, bits, group_size, w.shape[0], symmetric
    )


def search_clip(
    w: np.ndarray,
    h: np.ndarray | None,
    bits: int = 4,
    group_size: int = 32,
    symmetric: bool = False,
    ratios: np.ndarray | None = None,
) -> np.ndarray:
    """Learned clipping: per (row, block) range-shrink ratio minimising the output error.

    The error of block b of row n for ratio r is dW^T H_bb dW with H_bb the block's diagonal
    block of the activation Gram matrix h [K, K] (cross-block terms are ignored, as in AWQ's
    clip search); with h None it is the plain weight MSE. Returns ratios [N, n_blocks].
    """
    k, n = w.shape
    wb, nb = to_blocks(w, group_size)
    if ratios is None:
        ratios = np.linspace(1.0, 0.5, 21)
    kp = nb * group_size
    hp = np.zeros((kp, kp))
    if h is not None:
        hp[:k, :k] = h
    best = np.full((n, nb), np.inf)
    best_r = np.ones((n, nb))
    for r in ratios:
        scale, zero = block_params(wb, bits, symmetric, r)
        w_hat = (block_codes(wb, scale, zero, bits) - zero[..., None]) * scale[..., None]
        dw = w_hat - wb  # [N, nb, g]
        if h is None:
            err = (dw**2).sum(-1)
        else:
            err = np.empty((n, nb))
            for b in range(nb):
                sl = slice(b * group_size, (b + 1) * group_size)
                hb = hp[sl, sl]
                err[:, b] = np.einsum("ng,gh,nh->n", dw[:, b], hb, dw[:, b])
        better = err < best
        best[better] = err[better]
        best_r[better] = r
    return best_r


def quantize_clip(
    w: np.ndarray,
    h: np.ndarray | None,
    bits: int = 4,
    group_size: int = 32,
    symmetric: bool = False,
) -> BlockQuant:
    """RTN with the learned clip ratios of `search_clip`."""
    ratio = search_clip(w, h, bits, group_size, symmetric)
    return quantize_rtn(w, bits, group_size, symmetric, ratio)
