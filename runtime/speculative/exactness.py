"""When speculative greedy decoding cannot promise plain greedy's exact tokens, say so once.

Greedy verification accepts a draft exactly when it is the argmax of the logits the verify
run computes. Plain decoding computes the same position in a one-token run. The two runs agree
to float rounding, not bit for bit: onnxruntime's GroupQueryAttention rounds a one-token query
differently from a multi-token one (3.6e-7 on SmolLM2's shapes). In float weights or
weight-only quantization (fp32, w4a16, w8a16) that stays a 1e-5 logit difference, and the
tokens are the same. With int8 activations (w4a8, w8a8) the activation quantizer turns it
into a different rounding step now and then. Over 30 layers that moves logits by up to ~0.9
on SmolLM2-135M, and greedy picks a different token at a near-tie: 12 of 16 chat answers
diverged within 128 tokens. Both outputs are greedy decodes of the same quantized model. Users
who need token-exact speculation pick a weight-only scheme, and the warning tells them.
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


def warn_if_not_token_exact(manifest: Any) -> None:
    """Log once per scheme and process that greedy speculation may differ from plain greedy."""
    if not int8_activations(manifest):
        return
    scheme = str(manifest.quant.get("scheme"))
    if scheme in _warned:
        return
    _warned.add(scheme)
    logger.warning(
        "this artifact quantizes activations to int8 (%s): speculative greedy output equals "
        "plain greedy up to near-ties, not token for token (a multi-token verify run rounds "
        "attention differently from a one-token step, and int8 activations amplify it). For "
        "token-exact speculation quantize with --scheme w4a16 or w8a16.",
        scheme,
    )
