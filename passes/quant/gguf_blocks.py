"""GGUF quantized blocks -> MatMulNBits blocks (`BlockQuant`), without a second rounding.

llama.cpp's weight formats are blockwise affine codes along K, the same shape onnxruntime's
MatMulNBits computes, `(q - zero) * scale` per block:

| GGUF | block | value | MatMulNBits | exact? |
|---|---|---|---|---|
| Q4_0 | 32 | d·(q − 8) | 4 bits, scale d, zero 8 | yes |
| Q8_0 | 32 | d·q (int8) | 8 bits, scale d, zero 128 (q + 128) | yes |
| Q5_0 | 32 | d·(q − 16), q 5-bit | 8 bits, scale d, zero 16 | yes (5-bit codes in 8) |
| Q6_K | 16 | (d·sc)·(q − 32), q 6-bit | 8 bits, block 16, scale d·sc, zero 32 | yes |
| Q4_1 | 32 | d·q + m | 4 bits, scale d, float zero −m/d | to ~1 ulp |
| Q4_K | 32 | (d·sc)·q − dmin·m | 4 bits, scale d·sc, float zero dmin·m/(d·sc) | to ~1 ulp |
| Q5_1, Q5_K | 32 | affine, 5-bit q | 8 bits with a float zero: onnxruntime's CPU kernel refuses it | kept in float |

The codes are never re-derived from float weights: they are the file's own bits. The scale
d·sc is a product of an fp16 and a small integer, exact in float32; only the minimum of the
affine types becomes a float zero point (its rounding is the "~1 ulp"). A block whose scale is
zero (a constant block) keeps its value exactly with codes 0, zero −1 and the constant as
scale. Other types (Q2_K, Q3_K, IQ*) are not converted here.
"""

from __future__ import annotations

import numpy as np

from specport.passes.quant.blockquant import BlockQuant

EXACT = {"Q4_0", "Q8_0", "Q5_0", "Q6_K"}
APPROX = {"Q4_1", "Q4_K"}
# 8-bit codes with float zero points: block_quant builds them, but onnxruntime 1.32's CPU
# MatMulNBits refuses 8-bit weights with float zero points, so the pass keeps these in float.
AFFINE_8BIT = {"Q5_1", "Q5_K"}
SUPPORTED = EXACT | APPROX


def _f16(raw: np.ndarray) -> np.ndarray:
    """[n, 2] bytes -> [n] float32."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[:, 0]


def _codes_legacy(blocks: np.ndarray, qtype: str) -> np.ndarray:
    """The integer codes of Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 blocks, read with gguf's own unpacking:
    dequantize copies of the blocks whose scale is 1 and minimum 0 (no float error: small ints)."""
    from gguf import GGMLQuantizationType, dequantize

    unit = blocks.copy()
    unit[:, 0:2] = np.frombuffer(np.float16(1).tobytes(), np.uint8)
    if qtype in ("Q4_1", "Q5_1"):
        unit[:, 2:4] = 0
    values = dequantize(unit, GGMLQuantizationType[qtype])  # [n_blocks, 32]
    offset = {"Q4_0": 8, "Q5_0": 16, "Q8_0": 128}.get(qtype, 0)
    return np.rint(values + offset).astype(np.int32)


def _k_scale_min(blocks: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: per 32-sub-block scale d·sc, minimum dmin·m, and codes [nb, 8, 32]."""
    from gguf.quants import Q4_K

    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
    scale = d[:, None] * sc.astype(np.float32)
    minimum = dmin[:, None] * m.astype(np.float32)
    if qtype == "Q4_K":
        qs = blocks[:, 16:144].reshape(n, -1, 1, 32) >> np.array([0, 4], np.uint8).reshape(
            1, 1, 2, 1
        )
        q = (qs & 0x0F).reshape(n, 8, 32)
    else:
        qh, qs = blocks[:, 16:48], blocks[:, 48:176]
        ql = qs.reshape(n, -1, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        hi = qh.reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
        q = (ql & 0x0F).reshape(n, 8, 32) | ((hi & 0x01).reshape(n, 8, 32) << 4)
    return scale, minimum, q.astype(np.int32)


def _q6k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K: per 16-sub-block scale d·sc and codes [nb, 16, 16] (value = scale·(q − 32))."""
    n = blocks.shape[0]
    ql, qh = blocks[:, 0:128], blocks[:, 128:192]
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(blocks[:, 208:210])
    low4 = ql.reshape(n, -1, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    low = (low4 & 0x0F).reshape(n, -1, 32)
    high2 = qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    high = (high2 & 0x03).reshape(n, -1, 32)
    q = (low | (high << 4)).reshape(n, 16, 16).astype(np.int32)
    return d[:, None] * sc, q


def block_quant(raw: np.ndarray, qtype: str, n: int, k: int) -> BlockQuant:
    """Blocks of one GGUF tensor (raw uint8 [N, bytes per row]) as a BlockQuant over W [K, N]."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    _, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    blocks = np.ascontiguousarray(raw).reshape(-1, size)  # row-major: row r's blocks in order
    if qtype in ("Q4_0", "Q8_0", "Q5_0", "Q4_1", "Q5_1"):
        q = _codes_legacy(blocks, qtype)  # [n_blocks, 32]
        d = _f16(blocks[:, 0:2])[:, None]
        if qtype in ("Q4_1", "Q5_1"):
            m = _f16(blocks[:, 2:4])[:, None]
            scale, zero, q = _affine(d, m, q[:, None, :])
        else:
            scale = d
            zero = np.full_like(d, {"Q4_0": 8, "Q5_0": 16, "Q8_0": 128}[qtype])
            q = q[:, None, :]
        group = 32
    elif qtype in ("Q4_K", "Q5_K"):
        s, mins, codes = _k_scale_min(blocks, qtype)
        scale, zero, q = _affine(s, -mins, codes)
        group = 32
    elif qtype == "Q6_K":
        scale, q = _q6k(blocks)
        zero = np.full_like(scale, 32)
        group = 16
    else:
        raise ValueError(f"GGUF type {qtype} has no MatMulNBits form")
    bits = 4 if qtype in ("Q4_0", "Q4_1", "Q4_K") else 8
    sub = k // group
    return BlockQuant(
        q=q.reshape(n, sub * group).astype(np.uint8),
        scale=scale.reshape(n, sub).astype(np.float32),
        zero=zero.reshape(n, sub).astype(np.float32),
        bits=bits,
        group_size=group,
        k=k,
        symmetric=qtype in ("Q4_0",),
    )


def _affine(
    scale: np.ndarray, minimum: np.ndarray, q: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """value = scale·q + minimum as (q − zero)·scale; constant blocks (scale 0) kept exactly."""
    flat = scale == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        zero = np.where(flat, -1.0, -minimum / np.where(flat, 1.0, scale)).astype(np.float32)
    q = np.where(flat[..., None], 0, q)
    scale = np.where(flat, minimum, scale).astype(np.float32)
    return scale, zero, q
