"""A module whose KV cache is flat tensors, so `torch.onnx.export` sees plain inputs/outputs.

transformers' `DynamicCache` is not an accepted export input. The wrapper rebuilds one from
`past_key_values.{i}.key/value` tensors on every call and returns the updated per-layer tensors
as `present.{i}.key/value`: the classic "concat" layout (present = past + new along T).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache


def kv_input_names(num_layers: int) -> list[str]:
    return [f"past_key_values.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]


def kv_output_names(num_layers: int) -> list[str]:
    return [f"present.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]


class FlatKVWrapper(torch.nn.Module):
    """forward(input_ids [B,S], attention_mask [B,P+S], position_ids [B,S], *past [B,Hkv,P,D])
    -> (logits [B,S,V], *present [B,Hkv,P+S,D])."""

    def __init__(self, model: torch.nn.Module, num_layers: int) -> None:
        super().__init__()
        self.model = model
        self.num_layers = num_layers

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        *past: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        cache = DynamicCache()
        for i in range(self.num_layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        )
        present: list[torch.Tensor] = []
        for layer in out.past_key_values.layers[: self.num_layers]:
            present += [layer.keys, layer.values]
        return (out.logits, *present)


def probe_kv_shapes(model: torch.nn.Module) -> list[tuple[int, int, int]]:
    """Per layer (kv_heads, key_dim, value_dim), read off a real forward pass.

    Reading shapes from the cache rather than the config covers MLA (DeepSeek), MQA and any
    family whose config spells head counts differently.
    """
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([[1, 2]]), past_key_values=DynamicCache(), use_cache=True
        )
    shapes = []
    for layer in out.past_key_values.layers:
        k, v = layer.keys, layer.values
        shapes.append((int(k.shape[1]), int(k.shape[-1]), int(v.shape[-1])))
    return shapes


def example_inputs(
    vocab_size: int, kv: list[tuple[int, int, int]], batch: int = 2, seq: int = 3, past: int = 4
) -> tuple[Any, ...]:
    """Tracing inputs: sizes chosen > 1 and distinct so no dynamic axis gets specialized."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=g)
    mask = torch.ones(batch, past + seq, dtype=torch.int64)
    pos = torch.arange(past, past + seq).unsqueeze(0).expand(batch, seq).contiguous()
    flat: list[torch.Tensor] = []
    for heads, kd, vd in kv:
        flat += [
            torch.randn(batch, heads, past, kd, generator=g),
            torch.randn(batch, heads, past, vd, generator=g),
        ]
    return (ids, mask, pos, *flat)


def dynamic_shapes(num_layers: int) -> dict[str, Any]:
    from torch.export import Dim

    b, s, p, t = (
        Dim("batch"),
        Dim("sequence_length"),
        Dim("past_sequence_length"),
        Dim("total_sequence_length"),
    )
    kv = tuple({0: b, 2: p} for _ in range(2 * num_layers))
    return {
        "input_ids": {0: b, 1: s},
        "attention_mask": {0: b, 1: t},
        "position_ids": {0: b, 1: s},
        "past": kv,
    }
