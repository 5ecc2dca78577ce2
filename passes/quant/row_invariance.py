"""Does a quantized graph compute a token the same in a one-token step and in a verify run?

Greedy speculative decoding gives plain greedy's tokens exactly when every op computes each
row (token) of a run bit for bit as it would in a run of one row: then a verify run over
1 + K tokens produces the logits, and writes the KV, that K + 1 plain steps would. With int8
activations this is not a nicety: a last-bit difference upstream of an activation quantizer
moves a value across a rounding step, and over 30 layers that moves logits by up to ~1 on
SmolLM2-135M (benchmarks/row_invariance.py diffs every intermediate and names the ops).

Measured on onnxruntime 1.32's CPU kernels (AVX-512 VNNI, AMX; benchmarks/row_invariance.py):

- MatMulNBits with accuracy_level 4 (int8 activations quantized per row and block inside the
  kernel, integer dot products): a row's result does not depend on the run's row count for
  4-bit blocks up to 32 and 8-bit blocks up to 64 (`ROW_INVARIANT_BLOCK`); larger blocks take
  another path for one row than for several. Float activations (levels 0-1) and float MatMul
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

from typing import Any

import onnx_ir as ir

from specport.passes.pad_attention_rows import PADDED

# Largest MatMulNBits block (per weight bit width) whose int8-activation kernel gives a row
# the same result in a run of one row as in a run of several (onnxruntime 1.32 CPU).
ROW_INVARIANT_BLOCK = {4: 32, 8: 64}
PER_TENSOR_DYNAMIC = ("DynamicQuantizeMatMul", "DynamicQuantizeLinear")


def row_invariant_block(bits: int, block: int) -> bool:
    """Whether a `bits`-bit MatMulNBits with int8 activations and this block is row-invariant."""
    return block <= ROW_INVARIANT_BLOCK.get(bits, 0)


def token_exact_report(model: ir.Model) -> dict[str, Any]:
    """{"exact": bool, "reasons": [why not, one line per kind of op]} for the main graph."""
    reasons: dict[str, list[str]] = {}

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
            elif not row_invariant_block(bits, block):
                limit = ROW_INVARIANT_BLOCK.get(bits, 0)
                why(
                    f"{bits}-bit MatMulNBits blocks above {limit} (int8 kernel's one-row path)",
                    node,
                )
        elif op in PER_TENSOR_DYNAMIC:
            why(f"{op}: one activation scale per run (a row's codes depend on the others)", node)
        elif op in ("MatMul", "Gemm") and node.domain in ("", "ai.onnx"):
            why("float MatMul (SGEMM's one-row path)", node)
        elif op in ("Attention", "MultiHeadAttention"):
            why(f"{op}: not measured, only GroupQueryAttention is", node)
        elif op == "GroupQueryAttention" and PADDED not in node.metadata_props:
            why("GroupQueryAttention without a padded second row (one-row GEMM path)", node)
    lines = [f"{kind}: {len(names)} node(s), e.g. {names[0]}" for kind, names in reasons.items()]
    return {"exact": not lines, "reasons": lines}
