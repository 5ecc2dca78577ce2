"""Quantizing one weight matrix: the algorithm dispatch, integer zero points, the LM head's
block size, the output error a choice costs, and row chunks for bounded memory.

Split from the pass (weight_only.py) so that the mixed-precision planner, the LM-head choice
and the embedding pass reuse the per-weight math without the graph rewrite.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from specport.core.errors import QuantizationError
from specport.passes.quant.blockquant import BlockQuant, dequantize
from specport.passes.quant.calibration import ActStats
from specport.passes.quant.gptq import GptqFactor, quantize_gptq, refit_scales
from specport.passes.quant.hqq import quantize_hqq, quantize_symmetric_search
from specport.passes.quant.row_invariance import row_invariant_block
from specport.passes.quant.rtn import quantize_clip, quantize_rtn

ALGOS = ("rtn", "hqq", "gptq", "clip", "default")
NEEDS_CALIB = ("gptq", "clip", "default")
HEAD_GROUPS = (128, 64)  # block sizes an 8-bit LM head may take, largest first


def head_group_size(k: int, bits: int, group_size: int, int8_activations: bool = True) -> int:
    """Block size of the LM head's MatMulNBits: for an 8-bit head with int8 activations
    (accuracy_level 4) the largest of `HEAD_GROUPS` that divides K (no padding), is not
    below `group_size` and keeps the kernel row-invariant (`row_invariance.py`: blocks of 128
    compute one row differently from several, which breaks speculation's exact tokens);
    otherwise `group_size`.

    Why: onnxruntime's 8-bit int8-activation kernel (accuracy_level 4) is compute-bound on
    per-block work, not on bytes. Measured on SmolLM2-135M's head (K=576, N=49152, one
    thread): block 64 runs 1.3x faster than block 32, and a K=1024 head 1.6x faster at
    block 128, while the 8-bit weights stay far finer than the 4-bit body (SmolLM2 W4A8
    perplexity 44.8068 at block 32, 44.7973 at block 64). MatMulNBits takes its block size
    per node, so the body keeps `group_size` (its perplexity budget) and only the head grows.
    A 4-bit head keeps `group_size`: there the block is the precision budget. So a K=1024 head
    takes blocks of 64, not the 1.6x faster 128: exact speculative tokens come first.
    """
    if bits != 8 or not int8_activations:
        return group_size
    for g in HEAD_GROUPS:
        if g >= group_size and k % g == 0 and row_invariant_block(bits, g):
            return g
    return group_size


def integer_zero_points(bq: BlockQuant, w: np.ndarray) -> BlockQuant:
    """Round float zero points (HQQ, refit) and re-derive the codes so they stay consistent.

    w [K, N]. Integer zero points are what QDQ requires and what onnxruntime's fast
    MatMulNBits kernels expect.
    """
    top = (1 << bq.bits) - 1
    zero = np.clip(np.round(bq.zero), 0, top)
    n, g = w.shape[1], bq.group_size
    padded = np.zeros((n, bq.n_blocks * g))
    padded[:, : bq.k] = w.T
    wb = padded.reshape(n, bq.n_blocks, g)
    q = np.clip(np.round(wb / bq.scale[..., None] + zero[..., None]), 0, top).reshape(n, -1)
    return dataclasses.replace(bq, q=q.astype(bq.q.dtype), zero=zero)


def quantize_weight(
    w: np.ndarray,
    algo: str,
    bits: int,
    group_size: int,
    symmetric: bool,
    stats: ActStats | None,
    float_zero: bool = True,
    factor: GptqFactor | None = None,
) -> BlockQuant:
    """Dispatch one weight w [K, N] to an algorithm (`factor`: a shared GPTQ factorization).

    `default` (the best measured combination on stories260K) = GPTQ in activation order with
    static MSE-clipped group ranges, then a least-squares refit of every block's scale and
    offset against the calibration Hessian (4 bits).
    """
    h = stats.hessian if stats is not None else None
    if algo in NEEDS_CALIB and h is None:
        raise QuantizationError(f"algorithm {algo!r} needs calibration data; pass --calib FILE")
    if algo == "rtn":
        return quantize_rtn(w, bits, group_size, symmetric, float_zero=float_zero and bits == 4)
    if algo == "hqq":
        if symmetric:
            return quantize_symmetric_search(w, bits, group_size)
        return quantize_hqq(w, bits, group_size)
    if algo == "clip":
        return quantize_clip(w, h, bits, group_size, symmetric)
    if algo == "gptq":
        assert h is not None
        return quantize_gptq(w, h, bits, group_size, symmetric, factor=factor)
    if algo == "default":
        assert h is not None
        bq = quantize_gptq(
            w, h, bits, group_size, symmetric, mse_clip=True, act_order=True, factor=factor
        )
        # Float zero points exist only for 4 bits in MatMulNBits (and not at all in QDQ).
        return bq if symmetric or bits != 4 or not float_zero else refit_scales(bq, w, h)
    raise QuantizationError(f"unknown algorithm {algo!r}; choose one of {', '.join(ALGOS)}")


def better_rows(a: BlockQuant, b: BlockQuant, w: np.ndarray, h: np.ndarray | None) -> BlockQuant:
    """Per output row, whichever of two quantizations of w [K, N] errs less (dW^T H dW).

    Why: min/max RTN with float zero points reproduces a weight that already lies on a Q4_1
    grid exactly (a GGUF's weights dequantized), where GPTQ's clipped, refit ranges only move
    it off the grid; on weights that lie on no grid GPTQ wins most rows. Rows are independent
    given H, so mixing them is exact. Both must share bits, block and zero-point kind.

    H is damped by 1% of its mean diagonal (as GPTQ damps it): an input channel the calibration
    text never excites has zero rows in H, and an error there (the scale refit can blow a
    block's scale up along such a direction: SmolLM2, 32 calibration documents) would
    otherwise look free and win the row."""
    damp = 0.0 if h is None else 0.01 * float(np.mean(np.diag(h)))
    errs = []
    for bq in (a, b):
        dw = (dequantize(bq) - w).astype(np.float64)
        hd = dw if h is None else h @ dw + damp * dw
        errs.append(np.einsum("kn,kn->n", dw, hd))
    take = errs[1] < errs[0]  # [N]
    if not take.any():
        return a
    return dataclasses.replace(
        a,
        q=np.where(take[:, None], b.q, a.q),
        scale=np.where(take[:, None], b.scale, a.scale),
        zero=np.where(take[:, None], b.zero, a.zero).astype(np.float32),
    )


def output_rel_error(w: np.ndarray, w_hat: np.ndarray, stats: ActStats | None) -> float:
    """trace(dW^T H dW) / trace(W^T H W): relative output error on the calibration inputs
    (weight-space relative error when there is no calibration)."""
    num, den = error_terms(w, w_hat, stats.hessian if stats is not None else None)
    return float(num / max(den, 1e-30))


def error_terms(w: np.ndarray, w_hat: np.ndarray, h: np.ndarray | None) -> tuple[float, float]:
    """(trace(dW^T H dW), trace(W^T H W)) for columns of a weight; sums over column chunks."""
    dw = (w_hat - w).astype(np.float64)
    w64 = w.astype(np.float64)
    if h is None:
        return float((dw**2).sum()), float((w64**2).sum())
    return float(np.einsum("kn,kn->", dw, h @ dw)), float(np.einsum("kn,kn->", w64, h @ w64))


# Weights are quantized in chunks of output rows of about this many elements: every algorithm
# here treats rows independently (GPTQ given one shared factorization of H), and the float64
# working copies of a 128k-vocabulary LM head would otherwise take several GB at once.
CHUNK_ELEMENTS = 1 << 23
PARALLEL_MIN_ELEMENTS = 1 << 20  # smaller weights are not worth a thread pool
WORKERS = max(1, min(4, os.cpu_count() or 1))


def concat_rows(parts: list[BlockQuant]) -> BlockQuant:
    """Join BlockQuants of consecutive output-row chunks of one weight (same K, bits, group)."""
    return dataclasses.replace(
        parts[0],
        q=np.concatenate([b.q for b in parts], axis=0),
        scale=np.concatenate([b.scale for b in parts], axis=0),
        zero=np.concatenate([b.zero for b in parts], axis=0),
        symmetric=all(b.symmetric for b in parts),
    )
