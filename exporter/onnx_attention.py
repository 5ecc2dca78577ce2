"""Trace attention features SDPA lacks (logit soft-capping) as one ONNX Attention-23 node.

transformers runs Gemma 2's soft-capped attention eagerly (`scores = cap * tanh(scores / cap)`
between MatMul and Softmax): exported, that is a dozen decomposed ops that no fusion maps to
onnxruntime's GroupQueryAttention. `torch.onnx.ops.attention` is torch's own op for ONNX
Attention-23 (with a `softcap` attribute and an eager reference implementation), so an
attention function that calls it traces to the node `fuse_attention` already rewrites.

It is used only while tracing (`tracing`): verification and every test compare the graph with
transformers' own attention implementation, switched back before the references are computed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

NAME = "specport_onnx_attention"


def onnx_attention_forward(
    module: Any,
    query: torch.Tensor,  # [B, H, S, Dh]
    key: torch.Tensor,  # [B, Hkv, T, Dh]
    value: torch.Tensor,  # [B, Hkv, T, Dv]
    attention_mask: torch.Tensor | None,  # [B, 1, S, T] bool (True = attend), SDPA's format
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:  # [B, S, H, Dv]
    from transformers.integrations.sdpa_attention import repeat_kv

    groups = query.shape[1] // key.shape[1]
    # The head repeat stays outside the op (Reshape(Expand(Unsqueeze))), as SDPA exports it.
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        zero = torch.zeros((), dtype=query.dtype)
        attention_mask = torch.where(attention_mask, zero, torch.finfo(query.dtype).min)
    out, _k, _v, _qk = torch.onnx.ops.attention(
        query, key, value, attention_mask, scale=scaling, softcap=float(softcap or 0.0)
    )
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(NAME, onnx_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


@contextlib.contextmanager
def tracing(model: Any, enabled: bool) -> Iterator[None]:
    """Run `model` with the ONNX attention function inside the block; restore it after."""
    if not enabled:
        yield
        return
    _register()
    before = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(before)
