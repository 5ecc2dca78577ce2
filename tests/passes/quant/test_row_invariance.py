"""What quant/row_invariance.py says about onnxruntime's kernels, checked against them, and the
verdict `quantize` records for int8-activation artifacts."""

from __future__ import annotations

import numpy as np
import pytest

import specport
from specport.passes.quant.row_invariance import (
    PORTABLE_ROW_INVARIANT_BLOCK,
    kernel_row_invariant,
    matmul_nbits_session,
    rows_computed_alone,
)


def _rows_alone_equal(bits: int, k: int, block: int) -> bool:
    x = np.random.default_rng(1).standard_normal((1, 12, k)).astype(np.float32) * 3
    x[0, 4] *= 40
    return rows_computed_alone(matmul_nbits_session(bits, k, 96, block), x, (2, 3, 5, 9, 12))


@pytest.mark.parametrize("k", [64, 576])
@pytest.mark.parametrize("bits", sorted(PORTABLE_ROW_INVARIANT_BLOCK))
def test_int8_matmulnbits_rows_do_not_depend_on_the_run(bits, k):
    """At the largest block invariant on every CPU measured, any run of M rows gives each row
    the bits a one-row run gives it (outliers included, which widen a row's own quantization
    scale): what `--exact-speculation`'s default blocks rely on wherever the file runs."""
    block = PORTABLE_ROW_INVARIANT_BLOCK[bits]
    assert _rows_alone_equal(bits, k, block)
    assert kernel_row_invariant(bits, block)


@pytest.mark.parametrize("block", [16, 32, 64])
@pytest.mark.parametrize("bits", [4, 8])
def test_the_probe_measures_this_cpus_kernel(bits, block):
    """`kernel_row_invariant` (one probe shape) says what the kernel does at SmolLM2's K and
    another N: the verdict quantize records, and the runtime's re-check, are this CPU's."""
    assert kernel_row_invariant(bits, block) == _rows_alone_equal(bits, 576, block)


@pytest.mark.slow
def test_quantize_records_the_verdict(quant_src, calib_text, tmp_path):
    """Default blocks keep the int8 kernels row-invariant; a block they split by row count does not,
    and the verdict says which nodes and why. (The unfused tiny graph's attention is the ONNX
    Attention op, not measured: fused graphs are checked in
    tests/runtime/speculative/test_quantized_exactness.py.)"""
    w8 = specport.quantize(quant_src, tmp_path / "w8", scheme="w8a8", calib_files=[calib_text])
    assert w8.quant["group_size"] == 64
    reasons = w8.quant["token_exact_speculation"]["reasons"]
    assert reasons and not any("MatMulNBits" in r for r in reasons), reasons  # attention only
    wide = specport.quantize(quant_src, tmp_path / "wide", scheme="w4a8", group_size=64, algo="rtn")
    verdict = wide.quant["token_exact_speculation"]
    assert not verdict["exact"]
    assert any("4-bit MatMulNBits blocks of 64" in r for r in verdict["reasons"])
    exact = specport.quantize(
        quant_src, tmp_path / "exact", scheme="w4a8", algo="rtn", exact_speculation=True
    )
    # the largest 4-bit block up to 32 that this CPU's kernel keeps row-invariant
    assert exact.quant["group_size"] == (32 if kernel_row_invariant(4, 32) else 16)
