"""The blockwise-quantized weight format every algorithm produces, and its two readers.

A `BlockQuant` holds integer codes per output row and block of K with one scale and one zero
point per (row, block): the layout of onnxruntime's `com.microsoft.MatMulNBits`, so
`pack_matmul_nbits` is a reshape and `dequantize` the numpy reference the graph must reproduce.
The block helpers here (`to_blocks`, `block_params`, `block_codes`, `pack_blocks`) are shared by
the algorithm modules, one per family: RTN and learned clipping in `rtn`, HQQ in `hqq`, GPTQ and
the scale refit in `gptq`. Every algorithm takes an ONNX-layout weight `w` [K, N] (the graph
computes `x @ w`) and returns a `BlockQuant`; ``w_hat[k, n] = (q[n, k] - zero[n, k // g]) *
scale[n, k // g]``. Calibrated algorithms (GPTQ, learned clipping) need only the Gram matrix of
the layer's input activations, H = sum_rows x^T x [K, K]: the output error of a weight change dW
is trace(dW^T H dW), so no activation rows are kept per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specport.core.errors import QuantizationError

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


def to_blocks(w: np.ndarray, group_size: int) -> tuple[np.ndarray, int]:
    """[K, N] -> [N, n_blocks, g] float64 with zero padding of K; also returns n_blocks."""
    k, n = w.shape
    nb = -(-k // group_size)
    wt = np.zeros((n, nb * group_size), dtype=np.float64)
    wt[:, :k] = w.T
    return wt.reshape(n, nb, group_size), nb


def block_params(
    wb: np.ndarray,
    bits: int,
    symmetric: bool,
    ratio: np.ndarray | float = 1.0,
    float_zero: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Scale and zero for blocks wb [..., g], range shrunk by `ratio` [...] (clipping).

    The zero is an integer code unless `float_zero` (asymmetric only): then it is -min/scale
    unrounded, so the block's minimum and maximum are both codes exactly. That is llama.cpp's
    Q4_1 (w = d*q + m, d and m per block of 32) written as MatMulNBits' (q - zero) * scale,
    with zero = -m/d; an integer zero moves every level of such a grid by up to half a step."""
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
        if float_zero:
            safe = np.where(scale == 0, 1.0, scale)
            zero = np.where(scale == 0, -mn + 2.0 ** (bits - 1), -mn / safe)
            return np.where(scale == 0, 1.0, scale), zero
        zero = np.where(
            scale == 0, 2.0 ** (bits - 1), np.round(-mn / np.where(scale == 0, 1, scale))
        )
        zero = np.clip(zero, 0, qmax)
    scale = np.where(scale == 0, 1.0, scale)
    return scale, zero


def block_codes(wb: np.ndarray, scale: np.ndarray, zero: np.ndarray, bits: int) -> np.ndarray:
    return np.clip(np.round(wb / scale[..., None] + zero[..., None]), 0, 2**bits - 1)


def pack_blocks(
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
