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


def token_exact(manifest: Any) -> bool:
    """Whether greedy speculation on this artifact gives plain greedy's tokens by construction
    (float activations, or an int8-activation graph checked row-invariant when quantized)."""
    if not int8_activations(manifest):
        return True
    verdict = manifest.quant.get("token_exact_speculation") or {}
    return bool(verdict.get("exact"))


def warn_if_not_token_exact(manifest: Any) -> None:
    """Log once per scheme and process that greedy speculation may differ from plain greedy."""
    if token_exact(manifest):
        return
    scheme = str(manifest.quant.get("scheme"))
    reasons = (manifest.quant.get("token_exact_speculation") or {}).get("reasons")
    if scheme in _warned:
        return
    _warned.add(scheme)
    why = (
        "; ".join(reasons)
        if reasons
        else "it was quantized before specport made int8 graphs row-invariant"
    )
    logger.warning(
        "this artifact quantizes activations to int8 (%s) and a multi-token verify run does not "
        "compute exactly as one-token steps (%s): speculative greedy output equals plain greedy "
        "up to near-ties, not token for token. Quantize it again with --exact-speculation (or "
        "--scheme w4a16 / w8a16) for token-exact speculation.",
        scheme,
        why,
    )
