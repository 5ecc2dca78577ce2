"""Phi-3: fused qkv_proj and gate_up_proj; optional partial rotary."""

from __future__ import annotations

from specport.exporter.archs.llama import Llama
from specport.exporter.registry import register_arch


@register_arch("phi3")
class Phi3(Llama):
    pass
