"""Gemma family: Llama-shaped, with sqrt(hidden)-scaled embeddings and (1 + w) RMSNorm.

Gemma 2 and 3 alternate sliding-window and global layers (Gemma 3 with a rope base per layer
type, and q/k norm), Gemma 2 soft-caps attention and final logits. All of it is traced from
transformers' modules; what the entries state is what the passes and KV layouts can take.
"""

from __future__ import annotations

from specport.exporter.archs.base import register_arch
from specport.exporter.archs.llama import Llama


@register_arch("gemma")
class Gemma(Llama):
    pass


@register_arch("gemma2")
class Gemma2(Gemma):
    trace_onnx_attention = True  # soft-capped attention as one Attention-23 node


@register_arch("gemma3_text")
class Gemma3Text(Gemma):
    refused = {"use_bidirectional_attention": "bidirectional attention (EmbeddingGemma)"}
