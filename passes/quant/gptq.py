"""Hessian-based quantization: GPTQ and the scale refit that follows it.

Both need only the Gram matrix of the layer's calibration inputs, H = sum_rows x^T x [K, K]:
the output error of a weight change dW is trace(dW^T H dW). GPTQ spreads each channel's
rounding error onto the channels not yet quantized through H^-1; `refit_scales` then re-solves
each block's scale and offset with the codes fixed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specport.core.errors import QuantizationError
from specport.passes.quant.blockquant import (
    BlockQuant,
    block_params,
    check_group_size,
    pack_blocks,
    to_blocks,
)
from specport.passes.quant.rtn import search_clip


@dataclass
class GptqFactor:
    """What GPTQ derives from the Hessian alone, shared by every row chunk of one weight:
    channel order `perm`, the upper Cholesky factor `u` of the permuted damped H^-1, and the
    dead (never active) input channels."""

    perm: np.ndarray  # [K]
    u: np.ndarray  # [K, K]
    dead: np.ndarray  # [K] bool


def gptq_factor(h: np.ndarray, damp: float = 0.01, act_order: bool = False) -> GptqFactor:
    """Factor h [K, K] (X^T X of the calibration inputs) once for `quantize_gptq`."""
    k = h.shape[0]
    H = h.astype(np.float64).copy()
    dead = np.diag(H) == 0
    H[dead, dead] = 1.0
    H[np.diag_indices(k)] += damp * np.mean(np.diag(H))
    perm = np.arange(k)
    if act_order:
        perm = np.argsort(-np.diag(H), kind="stable")
        H = H[np.ix_(perm, perm)]
    return GptqFactor(perm, _upper_cholesky_of_inverse(H), dead)


def _upper_cholesky_of_inverse(h: np.ndarray) -> np.ndarray:
    """Upper-triangular U with U^T U = h^-1, from one Cholesky and one triangular solve.

    With J the reversal permutation and J h J = L L^T, h = R R^T for the upper-triangular
    R = J L J, so h^-1 = R^-T R^-1 and U = R^-1 = J L^-1 J. That is about a seventh of the
    work of inverting h's factor in general and factoring the inverse again (the inverse was a
    third of GPTQ's time on a 0.5B model)."""
    import torch

    rev = torch.from_numpy(np.ascontiguousarray(h[::-1, ::-1]))
    lower, info = torch.linalg.cholesky_ex(rev)
    if int(info) != 0:
        raise QuantizationError(
            "GPTQ Hessian is not positive definite even after dampening; use more calibration text"
        )
    eye = torch.eye(h.shape[0], dtype=rev.dtype)
    inv = torch.linalg.solve_triangular(lower, eye, upper=False)
    return np.ascontiguousarray(inv.numpy()[::-1, ::-1])


def quantize_gptq(
    w: np.ndarray,
    h: np.ndarray,
    bits: int = 4,
    group_size: int = 32,
    symmetric: bool = False,
    damp: float = 0.01,
    block: int = 128,
    mse_clip: bool = False,
    act_order: bool = False,
    factor: GptqFactor | None = None,
) -> BlockQuant:
    """GPTQ (Frantar et al. 2022): quantize input channels in order, spreading each channel's
    rounding error onto the not-yet-quantized channels through the inverse Hessian.

    h [K, K] is X^T X of the layer's calibration inputs. Group parameters are chosen when the
    first channel of a group is reached, from the already-updated weights (with an MSE clip
    search when `mse_clip`). With `act_order`, channels are processed by decreasing H_jj
    with "static groups": group parameters fixed up front from the original weights, so the
    groups stay contiguous in K as MatMulNBits requires. Output rows are independent given
    H: a large weight may be quantized in row chunks sharing one `factor` (`gptq_factor`).
    """
    k, n = w.shape
    check_group_size(k, group_size)
    if h.shape != (k, k):
        raise QuantizationError(f"GPTQ Hessian has shape {h.shape}, expected ({k}, {k})")
    if factor is None:
        factor = gptq_factor(h, damp, act_order)
    W = w.T.astype(np.float64).copy()  # [N, K]
    W[:, factor.dead] = 0.0
    nb = -(-k // group_size)
    scale = np.ones((n, nb))
    zero = np.zeros((n, nb))
    perm = factor.perm
    if act_order:
        ratio = (
            search_clip(w, h if mse_clip == "hessian" else None, bits, group_size, symmetric)
            if mse_clip
            else 1.0
        )
        wb, _ = to_blocks(w, group_size)
        scale, zero = block_params(wb, bits, symmetric, ratio)
        W = W[:, perm]
    U = factor.u
    Q = np.zeros((n, nb * group_size))
    qmax = 2**bits - 1
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        W1 = W[:, b0:b1].copy()
        Err = np.zeros_like(W1)
        U1 = U[b0:b1, b0:b1]
        for j in range(b1 - b0):
            col = b0 + j
            if not act_order and col % group_size == 0:
                g = col // group_size
                # Group params from the current (error-compensated) weights of the whole group.
                cur = np.concatenate([W1[:, j:], W[:, b1:]], axis=1)[:, :group_size]
                wg, _ = to_blocks(cur.T, group_size)
                r: np.ndarray | float = (
                    search_clip(cur.T, None, bits, group_size, symmetric) if mse_clip else 1.0
                )
                s, z = block_params(wg, bits, symmetric, r)
                scale[:, g], zero[:, g] = s[:, 0], z[:, 0]
            g = perm[col] // group_size
            x = W1[:, j]
            q = np.clip(np.round(x / scale[:, g] + zero[:, g]), 0, qmax)
            Q[:, perm[col]] = q
            deq = (q - zero[:, g]) * scale[:, g]
            err = (x - deq) / U1[j, j]
            W1[:, j:] -= np.outer(err, U1[j, j:])
            Err[:, j] = err
        W[:, b1:] -= Err @ U[b0:b1, b1:]
    # Padding columns hold the zero point (dequantize to 0).
    for col in range(k, nb * group_size):
        Q[:, col] = zero[:, col // group_size]
    return pack_blocks(Q, scale, zero, bits, group_size, k, symmetric)


def refit_scales(bq: BlockQuant, w: np.ndarray, h: np.ndarray, sweeps: int = 2) -> BlockQuant:
    """Keep the codes, re-solve each block's (scale, offset) to minimise the output error.

    With codes q fixed, w_hat_b = s_b q_b + o_b is linear in (s_b, o_b); minimising
    (w_hat - w)^T H (w_hat - w) over one block with the others fixed is a 2x2 least-squares
    problem per output row (block coordinate descent, `sweeps` passes). Zero points become
    continuous (-o/s), which MatMulNBits accepts as float zero_points.
    """
    k = bq.k
    g = bq.group_size
    n, nb = bq.scale.shape
    q = bq.q.reshape(n, nb * g)[:, :k].astype(np.float64)  # [N, K]
    s = bq.scale.astype(np.float64).copy()
    o = -bq.zero.astype(np.float64) * s
    H = h.astype(np.float64)
    target = w.T.astype(np.float64)  # [N, K]

    def what() -> np.ndarray:
        return q * np.repeat(s, g, axis=1)[:, :k] + np.repeat(o, g, axis=1)[:, :k]

    d = what() - target
    base = float(np.einsum("nk,kj,nj->", d, H, d))
    for _ in range(sweeps):
        for b in range(nb):
            sl = slice(b * g, min((b + 1) * g, k))
            hb = H[sl, sl]
            # c = H_{b,rest} d_rest for every row: full product minus the block's own part.
            c = d @ H[:, sl] - d[:, sl] @ hb  # [N, g]
            qb = q[:, sl]
            hq = qb @ hb
            m11 = (qb * hq).sum(1)
            m12 = hq.sum(1)
            m22 = hb.sum()
            v = target[:, sl] @ hb - c
            r1, r2 = (qb * v).sum(1), v.sum(1)
            det = m11 * m22 - m12 * m12
            ok = np.abs(det) > 1e-12 * np.maximum(np.abs(m11 * m22), 1e-30)
            sd = np.where(ok, det, 1.0)
            s_new = np.where(ok, (r1 * m22 - r2 * m12) / sd, s[:, b])
            o_new = np.where(ok, (m11 * r2 - m12 * r1) / sd, o[:, b])
            ok &= np.abs(s_new) > 1e-12
            s[:, b] = np.where(ok, s_new, s[:, b])
            o[:, b] = np.where(ok, o_new, o[:, b])
            d[:, sl] = qb * s[:, b : b + 1] + o[:, b : b + 1] - target[:, sl]
    after = float(np.einsum("nk,kj,nj->", d, H, d))
    if not after < base:
        return bq
    zero = -o / s
    return BlockQuant(bq.q, s.astype(np.float32), zero.astype(np.float32), bq.bits, g, k, False)
