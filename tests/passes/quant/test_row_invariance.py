"""What quant/row_invariance.py says about onnxruntime's kernels, checked against them, and the
verdict `quantize` records for int8-activation artifacts."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import specport
from specport.passes.quant.row_invariance import PORTABLE_ROW_INVARIANT_BLOCK, kernel_row_invariant


def _matmul_nbits(bits: int, k: int, n: int, block: int) -> ort.InferenceSession:
    rng = np.random.default_rng(0)
    blocks = -(-k // block)
    weight = rng.integers(0, 255, size=(n, blocks, block * bits // 8), dtype=np.uint8)
    scales = rng.random(n * blocks, dtype=np.float32) * 0.01 + 0.001
    zeros = rng.integers(0, 255, size=n * ((blocks * bits + 7) // 8), dtype=np.uint8)
    node = helper.make_node(
        "MatMulNBits", ["x", "w", "s", "z"], ["y"], domain="com.microsoft",
        K=k, N=n, bits=bits, block_size=block, accuracy_level=4,
    )  # fmt: skip
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "M", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "M", n])],
        [
            numpy_helper.from_array(a, name)
            for a, name in ((weight, "w"), (scales, "s"), (zeros, "z"))
        ],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _rows_alone_equal(sess: ort.InferenceSession, k: int) -> bool:
    x = np.random.default_rng(1).standard_normal((1, 12, k)).astype(np.float32) * 3
    x[0, 4] *= 40
    alone = np.concatenate([sess.run(None, {"x": x[:, i : i + 1]})[0] for i in range(12)], axis=1)
    return all(
        np.array_equal(sess.run(None, {"x": x[:, :m]})[0], alone[:, :m]) for m in (2, 3, 5, 9, 12)
    )


@pytest.mark.parametrize("k", [64, 576])
@pytest.mark.parametrize("bits", sorted(PORTABLE_ROW_INVARIANT_BLOCK))
def test_int8_matmulnbits_rows_do_not_depend_on_the_run(bits, k):
    """At the largest block invariant on every CPU measured, any run of M rows gives each row
    the bits a one-row run gives it (outliers included, which widen a row's own quantization
    scale): what `--exact-speculation`'s default blocks rely on wherever the file runs."""
    block = PORTABLE_ROW_INVARIANT_BLOCK[bits]
    assert _rows_alone_equal(_matmul_nbits(bits, k, 96, block), k)
    assert kernel_row_invariant(bits, block)


@pytest.mark.parametrize("block", [16, 32, 64])
@pytest.mark.parametrize("bits", [4, 8])
def test_the_probe_measures_this_cpus_kernel(bits, block):
    """`kernel_row_invariant` (one probe shape) says what the kernel does at SmolLM2's K and
    another N: the verdict quantize records, and the runtime's re-check, are this CPU's."""
    assert kernel_row_invariant(bits, block) == _rows_alone_equal(
        _matmul_nbits(bits, 576, 96, block), 576
    )


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
