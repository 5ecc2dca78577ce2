"""Does a quantized graph compute a token the same in a one-token step and in a verify run?

Greedy speculative decoding gives plain greedy's tokens exactly when every op computes each
row (token) of a run bit for bit as it would in a run of one row: then a verify run over
1 + K tokens produces the logits, and writes the KV, that K + 1 plain steps would. With int8
activations this is not a nicety: a last-bit difference upstream of an activation quantizer
moves a value across a rounding step, and over 30 layers that moves logits by up to ~1 on
SmolLM2-135M (benchmarks/row_invariance.py diffs every intermediate and names the ops).

Measured on onnxruntime 1.32's CPU kernels (benchmarks/row_invariance.py):

- MatMulNBits with accuracy_level 4 (int8 activations quantized per row and block inside the
  kernel, integer dot products): whether a row's result depends on the run's row count depends
  on the block size *and on the CPU*. On an AVX-512 VNNI / AMX Xeon, 4-bit blocks up to 32 and
  8-bit blocks up to 64 are invariant; on an AVX2 EPYC (no AVX-512), 4-bit blocks of 32 are
  not (every run of 2-17 rows rounds each row differently from a run of one, at 1, 2 or 4
  threads), 4-bit blocks of 16 and 8-bit blocks up to 64 are. So the verdict is measured on the
  machine that asks (`kernel_row_invariant`: a one-node session, once per process and kind),
  the verdict records the kernels it relied on, and the runtime measures them again where the
  artifact runs (runtime/speculative/exactness.py). `PORTABLE_ROW_INVARIANT_BLOCK` holds the
  blocks invariant on every CPU measured. Float activations (levels 0-1) and float MatMul
  (MLAS SGEMM) round one row differently from several at every size.
- GroupQueryAttention: one query row takes GEMM's single-row path, two or more the general
  one; runs of two or more rows agree bit for bit. `PadAttentionRowsPass` gives every run a
  second row.
- DynamicQuantizeMatMul / DynamicQuantizeLinear: one activation scale per tensor, computed
  over all rows of the run, so a row's codes depend on its neighbours.
- Row-wise ops (SkipSimplifiedLayerNormalization, RMSNormalization, rotary, Split, activations,
  Gather, ArgMax) compute each row alone: invariant.

`token_exact_report` reads these facts off a graph; the artifact records the verdict and the
runtime warns when speculation on an int8-activation artifact cannot promise exact tokens.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from specport.passes.pad_attention_rows import PADDED

logger = logging.getLogger(__name__)

# Largest MatMulNBits block (per weight bit width) whose int8-activation kernel gives a row
# the same result in a run of one row as in a run of several on every CPU measured (onnxruntime
# 1.32: AVX-512 VNNI/AMX allows 4-bit blocks of 32, AVX2 only 16; both allow 8-bit blocks of 64).
PORTABLE_ROW_INVARIANT_BLOCK = {4: 16, 8: 64}
PER_TENSOR_DYNAMIC = ("DynamicQuantizeMatMul", "DynamicQuantizeLinear")
_PROBE_K = 512  # divisible by every block MatMulNBits takes (16-256)
_PROBE_N = 64
_PROBE_ROWS = (2, 3, 5, 9, 17)  # a verify run holds 1 + K rows, K up to 16


def matmul_nbits_session(bits: int, k: int, n: int, block: int, zero_points: bool = True) -> Any:
    """A one-node onnxruntime session: x [1, M, k] -> MatMulNBits(bits, block, accuracy_level
    4) on random codes and scales, 2 threads (what `kernel_row_invariant` measures)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    blocks = -(-k // block)
    arrays = [
        (rng.integers(0, 255, size=(n, blocks, block * bits // 8), dtype=np.uint8), "w"),
        (rng.random(n * blocks, dtype=np.float32) * 0.01 + 0.001, "s"),
    ]
    if zero_points:
        arrays.append(
            (rng.integers(0, 255, size=n * ((blocks * bits + 7) // 8), dtype=np.uint8), "z")
        )
    node = helper.make_node(
        "MatMulNBits", ["x", *(name for _, name in arrays)], ["y"], domain="com.microsoft",
        K=k, N=n, bits=bits, block_size=block, accuracy_level=4,
    )  # fmt: skip
    graph = helper.make_graph(
        [node],
        "row_invariance_probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "M", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "M", n])],
        [numpy_helper.from_array(a, name) for a, name in arrays],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def rows_computed_alone(sess: Any, x: np.ndarray, runs: Sequence[int]) -> bool:
    """Whether every run of the first m rows of x [1, R, K] (m in `runs`) gives each row the
    bits that row gets in a run of its own."""
    alone = np.concatenate(
        [sess.run(None, {"x": x[:, i : i + 1]})[0] for i in range(max(runs))], axis=1
    )
    return all(np.array_equal(sess.run(None, {"x": x[:, :m]})[0], alone[:, :m]) for m in runs)


@functools.cache
def kernel_row_invariant(bits: int, block: int) -> bool:
    """Whether this machine's int8-activation MatMulNBits (accuracy_level 4) computes every row
    of a run of several rows bit for bit as it computes that row alone, measured once per
    process: a one-node session at K=512, with and without zero points, on random codes and
    an outlier row (which widens its own activation scale)."""
    if _PROBE_K % block or bits not in (4, 8):
        return False
    x = np.random.default_rng(1).standard_normal((1, max(_PROBE_ROWS), _PROBE_K)) * 3
    x[0, 4] *= 40
    try:
        return all(
            rows_computed_alone(
                matmul_nbits_session(bits, _PROBE_K, _PROBE_N, block, zeros),
                x.astype(np.float32),
                _PROBE_ROWS,
            )
            for zeros in (True, False)
        )
    except Exception as exc:  # an onnxruntime build without the kernel: nothing is promised
        logger.warning("could not measure MatMulNBits' row invariance here: %s", exc)
        return False


def row_invariant_block(bits: int, block: int) -> bool:
    """Whether a block is safe to *choose* for a `bits`-bit MatMulNBits with int8 activations:
    row-invariant on this machine (`kernel_row_invariant`) and on every CPU measured
    (`PORTABLE_ROW_INVARIANT_BLOCK`), so that a file made here stays exact where it runs."""
    return block <= PORTABLE_ROW_INVARIANT_BLOCK.get(bits, 0) and kernel_row_invariant(bits, block)


def token_exact_report(model: ir.Model) -> dict[str, Any]:
    """{"exact": bool, "reasons": [why not, one line per kind of op], "kernels": [[bits, block],
    ...]} for the main graph, on this machine's kernels. `kernels` lists the int8-activation
    MatMulNBits kinds the verdict relied on, so that the machine that runs the artifact can
    measure them again (`kernels_row_invariant`)."""
    reasons: dict[str, list[str]] = {}
    kernels: set[tuple[int, int]] = set()

    def why(kind: str, node: ir.Node) -> None:
        reasons.setdefault(kind, []).append(node.name or node.op_type)

    for node in model.graph:
        op = node.op_type
        if op == "MatMulNBits":
            level = node.attributes.get_int("accuracy_level", 0)
            bits = node.attributes.get_int("bits", 4)
            block = node.attributes.get_int("block_size", 0)
            if level != 4:
                why("MatMulNBits with float activations (one row rounds differently)", node)
            elif not kernel_row_invariant(bits, block):
                why(
                    f"{bits}-bit MatMulNBits blocks of {block} (this CPU's int8 kernel computes "
                    "one row differently from several)",
                    node,
                )
            else:
                kernels.add((bits, block))
        elif op in PER_TENSOR_DYNAMIC:
            why(f"{op}: one activation scale per run (a row's codes depend on the others)", node)
        elif op in ("MatMul", "Gemm") and node.domain in ("", "ai.onnx"):
            why("float MatMul (SGEMM's one-row path)", node)
        elif op in ("Attention", "MultiHeadAttention"):
            why(f"{op}: not measured, only GroupQueryAttention is", node)
        elif op == "GroupQueryAttention" and PADDED not in node.metadata_props:
            why("GroupQueryAttention without a padded second row (one-row GEMM path)", node)
    lines = [f"{kind}: {len(names)} node(s), e.g. {names[0]}" for kind, names in reasons.items()]
    return {"exact": not lines, "reasons": lines, "kernels": [list(k) for k in sorted(kernels)]}


def kernels_row_invariant(kernels: Sequence[Sequence[int]]) -> list[str]:
    """The recorded int8 MatMulNBits kinds ([bits, block]) that this machine's kernel does
    *not* compute row-invariantly, as "4-bit blocks of 32" lines (empty: all are)."""
    return [
        f"{int(bits)}-bit blocks of {int(block)}"
        for bits, block in kernels
        if not kernel_row_invariant(int(bits), int(block))
    ]


def portable(kernels: Sequence[Sequence[int]]) -> bool:
    """Whether every recorded kind is row-invariant on every CPU measured."""
    return all(
        int(block) <= PORTABLE_ROW_INVARIANT_BLOCK.get(int(bits), 0) for bits, block in kernels
    )
