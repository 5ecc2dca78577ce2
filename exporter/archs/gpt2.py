"""GPT-2: learned positions, LayerNorm, Conv1D fused QKV; config names differ from Llama's."""

from __future__ import annotations

from specport.exporter.archs.base import ArchConfig, register_arch


@register_arch("gpt2")
class GPT2(ArchConfig):
    layers_attr = "n_layer"
    heads_attr = "n_head"
    kv_heads_attr = None
    context_attr = "n_positions"
    rope = "none"
