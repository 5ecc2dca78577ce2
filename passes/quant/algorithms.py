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

This module is the family's one import path (`from specport.passes.quant import algorithms as
A`); each family lives in its own module: the format and packing in `blockquant`, RTN and
learned clipping in `rtn`, HQQ in `hqq`, GPTQ and the scale refit in `gptq`.
"""

from __future__ import annotations

from specport.passes.quant.blockquant import (
    GROUP_SIZES,
    BlockQuant,
    check_group_size,
    dequantize,
    pack_matmul_nbits,
)
from specport.passes.quant.gptq import GptqFactor, gptq_factor, quantize_gptq, refit_scales
from specport.passes.quant.hqq import quantize_hqq
from specport.passes.quant.rtn import quantize_clip, quantize_rtn, search_clip

__all__ = [
    "GROUP_SIZES",
    "BlockQuant",
    "GptqFactor",
    "check_group_size",
    "dequantize",
    "gptq_factor",
    "pack_matmul_nbits",
    "quantize_clip",
    "quantize_gptq",
    "quantize_hqq",
    "quantize_rtn",
    "refit_scales",
    "search_clip",
]
