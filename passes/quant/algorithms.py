"""Weight quantization algorithms: pure numpy on one weight matrix at a time.

Every function takes an ONNX-layout weight `w` [K, N] (the graph computes `x @ w`, K input
channels, N outputs) and returns a `BlockQuant`: integer codes per output row and block of K,
with one scale and one zero point per (row, block). That is the layout of onnxruntime's
`com.microsoft.MatMulNBits` (B [N, n_blocks, blob], scales [N * n_blocks]), so packing is a
reshape; `dequantize` is the numpy reference the graph must reproduce:
``w_hat[k, n] = (q[n, k] - zero[n, k // g]) * scale[n, k // g]``.

Calibration-based algorithms (GPTQ, learned clipping) need only the Gram matrix of the layer's
input activations, H = sum_rows x^T x [K, K]: the output error of a weight change dW is
trace(dW^T H dW), so no activation rows are kept per layer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from specport.errors import QuantizationError

logger = logging.getLogger(__name__)

GROUP_SIZES = (16, 32, 64, 128, 256)


@dataclass
class BlockQuant:
    """Blockwise-quantized weight. q [N, K_pad] codes in [0, 2^bits); scale, zero [N, n_blocks].

    `zero` is float for HQQ (continuous zero points), integer-valued otherwise. `k` is the
    true K (K_pad = n_blocks * group_size; the padding rows hold the zero point, value 0).
    """

    q: np.ndarray
    scale: np.ndarray
    zero: np.ndarray
    bits: int
    group_size: int
    k: int
    symmetric: bool

    @property
    def n_blocks(self) -> int:
        return self.scale.shape[1]

    @property
    def integer_zero(self) -> bool:
        return bool(np.all(self.zero == np.round(self.zero)))


def check_group_size(k: int, group_size: int, allow_pad: bool = True) -> None:
    """Raise QuantizationError when `group_size` is unsupported or (without padding) does not divide K."""
    if group_size not in GROUP_SIZES:
        raise QuantizationError(
            f"group size {group_size} is not supported; use one of {', '.join(map(str, GROUP_SIZES))}"
        )
    if not allow_pad and k % group_size:
        raise QuantizationError(
            f"group size {group_size} does not divide the input dimension K={k}; choose a group "
            f"size that divides {k} (or use the MatMulNBits form, which pads K)"
        )


def _blocks(w: np.ndarray, group_size: int) -> tuple[np.ndarray, int]:
    """[K, N] -> [N, n_blocks, g] float64 with zero padding of K; also returns n_blocks."""
    k, n = w.shape
    nb = -(-k // group_size)
    wt = np.zeros((n, nb * group_size), dtype=np.float64)
    wt[:, :k] = w.T
    return wt.reshape(n, nb, group_size), nb


def _params(
    wb: np.ndarray, bits: int, symmetric: bool, ratio: np.ndarray | float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """Scale and integer zero for blocks wb [..., g], range shrunk by `ratio` [...] (clipping)."""
    qmax = 2**bits - 1
    r = np.asarray(ratio, dtype=np.float64)
    if symmetric:
        # Signed extreme mapped to -2^(b-1): uses the full [-8, 7] code range like onnxruntime.
        mx, mn = wb.max(-1), wb.min(-1)
        extreme = np.where(np.abs(mx) > np.abs(mn), mx, mn) * r
        scale = extreme / -(2 ** (bits - 1))
        zero = np.full(scale.shape, 2.0 ** (bits - 1))
    else:
        mn, mx = wb.min(-1) * r, wb.max(-1) * r
        scale = (mx - mn) / qmax
        zero = np.where(
            scale == 0, 2.0 ** (bits - 1), np.round(-mn / np.where(scale == 0, 1, scale))
        )
        zero = np.clip(zero, 0, qmax)
    scale = np.where(scale == 0, 1.0, scale)
    return scale, zero


def _codes(wb: np.ndarray, scale: np.ndarray, zero: np.ndarray, bits: int) -> np.ndarray:
    return np.clip(np.round(wb / scale[..., None] + zero[..., None]), 0, 2**bits - 1)


def _pack_result(
    q: np.ndarray, scale: np.ndarray, zero: np.ndarray, bits: int, g: int, k: int, sym: bool
) -> BlockQuant:
    n, nb = scale.shape
    q = q.reshape(n, nb * g).astype(np.uint8)
    return BlockQuant(q, scale.astype(np.float32), zero.astype(np.float32), bits, g, k, sym)


def dequantize(bq: BlockQuant) -> np.ndarray:
    """Numpy reference of the MatMulNBits dequantization: BlockQuant -> w_hat [K, N] float32."""
    n, nb = bq.scale.shape
    q = bq.q.reshape(n, nb, bq.group_size).astype(np.float32)
    w = (q - bq.zero[..., None]) * bq.scale[..., None]
    return w.reshape(n, -1)[:, : bq.k].T.copy()


def quantize_rtn(
    w: np.ndarray,
    bits: int = 4,
    group_size: int = 32,
    symmetric: bool = False,
    clip_ratio: np.ndarray | float = 1.0,
) -> BlockQuant:
    """Round-to-nearest blockwise quantization of w [K, N]; clip_ratio [N, n_blocks] or scalar."""
    check_group_size(w.shape[0], group_size)
    wb, _ = _blocks(w, group_size)
    scale, zero = _params(wb, bits, symmetric, clip_ratio)
    return _pack_result(
        _codes(wb, scale, zero, bits), scale, zero, bits, group_size, w.shape[0], symmetric
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
    wb = _blocks(w, group_size)[0].astype(np.float32)
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
    q = _codes(wb.astype(np.float64), scale64, zero64, bits)
    return _pack_result(q, scale64, zero64, bits, group_size, w.shape[0], False)


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
    wb, nb = _blocks(w, group_size)
    if ratios is None:
        ratios = np.linspace(1.0, 0.5, 21)
    kp = nb * group_size
    hp = np.zeros((kp, kp))
    if h is not None:
        hp[:k, :k] = h
    best = np.full((n, nb), np.inf)
    best_r = np.ones((n, nb))
    for r in ratios:
        scale, zero = _params(wb, bits, symmetric, r)
        dw = (_codes(wb, scale, zero, bits) - zero[..., None]) * scale[..., None] - wb  # [N, nb, g]
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
        wb, _ = _blocks(w, group_size)
        scale, zero = _params(wb, bits, symmetric, ratio)
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
                wg, _ = _blocks(cur.T, group_size)
                r: np.ndarray | float = (
                    search_clip(cur.T, None, bits, group_size, symmetric) if mse_clip else 1.0
                )
                s, z = _params(wg, bits, symmetric, r)
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
    return _pack_result(Q, scale, zero, bits, group_size, k, symmetric)


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


# ------------------------------------------------------------------------------ MatMulNBits


def pack_matmul_nbits(bq: BlockQuant) -> dict[str, np.ndarray]:
    """BlockQuant -> onnxruntime MatMulNBits initializers.

    B uint8 [N, n_blocks, g*bits/8] (two 4-bit codes per byte, low nibble first);
    scales float32 [N * n_blocks]; zero_points either uint8 packed per row
    [N * ceil(n_blocks*bits/8)] (integer zeros) or float32 [N * n_blocks] (HQQ), or absent for
    symmetric 4-bit (implicit 8).
    """
    n, nb = bq.scale.shape
    q = bq.q.reshape(n, nb, bq.group_size)
    out: dict[str, np.ndarray] = {"scales": bq.scale.reshape(-1).astype(np.float32)}
    if bq.bits == 4:
        b = (q[..., 0::2] & 0xF) | ((q[..., 1::2] & 0xF) << 4)
    elif bq.bits == 8:
        b = q
    else:
        raise QuantizationError(f"MatMulNBits packing supports 4 or 8 bits, not {bq.bits}")
    out["B"] = np.ascontiguousarray(b.astype(np.uint8))
    if bq.symmetric and bq.integer_zero and np.all(bq.zero == 2 ** (bq.bits - 1)):
        return out
    if bq.integer_zero:
        z: np.ndarray = bq.zero.astype(np.uint8)
        if bq.bits == 4:
            if nb % 2:
                z = np.concatenate([z, np.zeros((n, 1), np.uint8)], axis=1)
            z = (z[:, 0::2] & 0xF) | ((z[:, 1::2] & 0xF) << 4)
        out["zero_points"] = z.reshape(-1).astype(np.uint8)
    else:
        out["zero_points"] = bq.zero.reshape(-1).astype(np.float32)
    return out
