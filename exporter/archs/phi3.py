"""Phi-3 / Phi-3.5 / Phi-4-mini: fused qkv_proj and gate_up_proj; partial rotary; long-rope.

Long-rope picks its short or long frequency set per forward call (inside the graph, exactly
as PyTorch does), but transformers' `generate` also drops the KV cache and recomputes the
whole sequence the first time it grows past `original_max_position_embeddings`, so keys cached
before the switch are re-rotated. An artifact's runtime keeps its cache, so the artifact's
context is capped at the original length, where both agree token for token.
"""

from __future__ import annotations

import logging
from typing import Any

from specport.exporter.archs.base import register_arch
from specport.exporter.archs.llama import Llama

logger = logging.getLogger(__name__)


@register_arch("phi3")
class Phi3(Llama):
    rope_types = Llama.rope_types | {"longrope"}

    @classmethod
    def normalize(cls, config: Any) -> dict[str, Any]:
        out = super().normalize(config)
        params = getattr(config, "rope_parameters", None) or {}
        original = params.get("original_max_position_embeddings")
        if params.get("rope_type") == "longrope" and original and original < out["context_length"]:
            logger.warning(
                "long-rope model: context capped at %d tokens (of %d): transformers recomputes "
                "the KV cache when a sequence grows past it, which an artifact does not",
                original,
                out["context_length"],
            )
            out["rope_long_context"] = {
                "original_max_position_embeddings": int(original),
                "max_position_embeddings": out["context_length"],
            }
            out["context_length"] = int(original)
        return out
