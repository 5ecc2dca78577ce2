"""When speculative greedy decoding cannot promise plain greedy's exact tokens, say so once.

Greedy verification accepts a draft exactly when it is the argmax of the logits the verify
run computes. Plain decoding computes the same position in a one-token run. In float weights
or weight-only quantization (fp32, w4a16, w8a16) the two agree to float rounding (a 1e-5
logit difference: onnxruntime's GEMMs round one row differently from several), and the tokens
are the same. With int8 activations (w4a8, w8a8) a last-bit difference upstream of an
activation quantizer becomes a different rounding step now and then; over 30 layers that
moved SmolLM2-135M's logits by up to ~1 and greedy picked another token at near-ties (no
W8A8 chat answer, 4 of 56 W4A8 ones, matched plain greedy).

`specport quantize --exact-speculation` makes int8-activation graphs row-invariant (every op
computes a token bit for bit the same in a run of one row and of several: pad_attention_rows.py,
passes/quant/row_invariance.py); every int8 artifact records the verdict in
`quant.token_exact_speculation`. Artifacts without a positive verdict get the warning, with
its reasons.

The int8 MatMulNBits kernel's row invariance depends on the CPU as well as the block size (4-bit
blocks of 32 are invariant on AVX-512 VNNI, not on AVX2), so a positive verdict lists the kernel
kinds it relied on and this machine measures them again before believing it
(`kernels_row_invariant`: a one-node session per kind, once per process).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

INT8_ACTIVATION_SCHEMES = frozenset({"w4a8", "w8a8"})
_warned: set[str] = set()


def int8_activations(manifest: Any) -> bool:
    """Whether the artifact's MatMuls quantize their activations to int8."""
    return (
        str((getattr(manifest, "quant", None) or {}).get("scheme", "")) in INT8_ACTIVATION_SCHEMES
    )


def not_exact_here(manifest: Any) -> list[str]:
    """Why greedy speculation on this artifact may leave plain greedy's tokens on this machine
    (empty: it gives them by construction: float activations, or an int8-activation graph
    checked row-invariant when quantized whose kernels are row-invariant here too)."""
    if not int8_activations(manifest):
        return []
    verdict = manifest.quant.get("token_exact_speculation") or {}
    if not verdict.get("exact"):
        return list(verdict.get("reasons") or []) or [
            "it was quantized before specport made int8 graphs row-invariant"
        ]
    from specport.passes.quant.row_invariance import kernels_row_invariant

    differ = kernels_row_invariant(_kernels(manifest.quant, verdict))
    if not differ:
        return []
    return [
        f"this CPU's int8 MatMulNBits kernel computes one row differently from several for "
        f"{', '.join(differ)} (row-invariant on the CPU that quantized it; quantize again here, "
        "with --exact-speculation and 4-bit blocks of 16, for a file exact on every CPU measured)"
    ]


def _kernels(quant: dict[str, Any], verdict: dict[str, Any]) -> list[list[int]]:
    """The int8 MatMulNBits kinds a verdict relied on; verdicts written before they were
    recorded get the body's (scheme bits, group size) and the head's (8, its block)."""
    if "kernels" in verdict:
        return [list(k) for k in verdict["kernels"]]
    kinds = []
    if quant.get("group_size"):
        kinds.append([4 if quant.get("scheme") == "w4a8" else 8, int(quant["group_size"])])
    if quant.get("lm_head_group_size"):
        kinds.append([8, int(quant["lm_head_group_size"])])
    return kinds


def token_exact(manifest: Any) -> bool:
    """Whether greedy speculation on this artifact gives plain greedy's tokens on this machine."""
    return not not_exact_here(manifest)


def warn_if_not_token_exact(manifest: Any) -> None:
    """Log once per scheme and process that greedy speculation may differ from plain greedy."""
    reasons = not_exact_here(manifest)
    if not reasons:
        return
    scheme = str(manifest.quant.get("scheme"))
    if scheme in _warned:
        return
    _warned.add(scheme)
    why = "; ".join(reasons)
    logger.warning(
        "this artifact quantizes activations to int8 (%s) and a multi-token verify run does not "
        "compute exactly as one-token steps (%s): speculative greedy output equals plain greedy "
        "up to near-ties, not token for token. Quantize it again with --exact-speculation (or "
        "--scheme w4a16 / w8a16) for token-exact speculation.",
        scheme,
        why,
    )
