"""Gemma: Llama-shaped, with sqrt(hidden)-scaled embeddings and (1 + w) RMSNorm in the HF class."""

from __future__ import annotations

from specport.exporter.archs.llama import Llama
from specport.exporter.registry import register_arch


@register_arch("gemma")
class Gemma(Llama):
    pass
