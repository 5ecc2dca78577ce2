"""A module whose KV cache is flat tensors, so `torch.onnx.export` sees plain inputs/outputs.

transformers' `DynamicCache` is not an accepted export input. The wrapper rebuilds one from
`past_key_values.{i}.key/value` tensors on every call and returns the updated per-layer tensors
as `present.{i}.key/value`: the classic "concat" layout (present = past + new along T).

`TreeMaskKVWrapper` adds a `tree_mask` input [B, S, S] so one run can score a token tree
(speculative tree verification): new token i attends new token j iff tree_mask[b, i, j] == 1,
and every real past token. The wrapper builds the 4-D additive mask itself and hands it to the
HF model, which uses a prepared 4-D mask as-is (transformers' masking_utils early exit).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from specport.core.contract import TREE_MASK


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


def tree_attention_mask(
    attention_mask: torch.Tensor,  # [B, P+S] int64, 1 = real token
    tree_mask: torch.Tensor,  # [B, S, S] int64, 1 = new token i may attend new token j
    dtype: torch.dtype,
    window: int | None = None,
) -> torch.Tensor:  # [B, 1, S, P+S] additive: 0 where allowed, dtype's min elsewhere
    """The 4-D mask HF attention takes instead of building its own causal one.

    Additive float (not bool): eager attention adds the mask to the scores, and a fully masked
    row (a left-pad query) then stays finite instead of turning NaN in SDPA. With a sliding
    `window`, HF's rule `kv_slot > q_slot - window` is applied with node i at the slot a chain
    run of its path would give it, P + depth(i) (depth = its ancestors in tree_mask).
    """
    b, s = tree_mask.shape[0], tree_mask.shape[1]
    past = attention_mask.shape[1] - s
    allowed = torch.cat([tree_mask.new_ones((b, s, past)), tree_mask], dim=2) != 0
    allowed = allowed & (attention_mask[:, None, :] != 0)
    if window is not None:
        slot = past + tree_mask.sum(dim=-1) - 1  # [B, S]
        past_slots = torch.arange(past, dtype=slot.dtype).unsqueeze(0).expand(b, past)
        kv_slot = torch.cat([past_slots, slot], dim=1)  # [B, P+S]
        allowed = allowed & (kv_slot[:, None, :] > slot[:, :, None] - window)
    zero = torch.zeros((), dtype=dtype)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[:, None]


FULL, SLIDING = "full_attention", "sliding_attention"


def sliding_layout(config: Any) -> tuple[int | None, bool]:
    """(window, mixed): the sliding window the model's masks use, and whether only some layers
    slide (HF then takes a dict of masks keyed by layer type). Raises ValueError for layer
    types a tree mask cannot reproduce (chunked, linear attention ...)."""
    window = getattr(config, "sliding_window", None)
    types = set(getattr(config, "layer_types", None) or [])
    if types - {FULL, SLIDING}:
        raise ValueError(f"layer types {sorted(types - {FULL, SLIDING})}")
    if types:
        return (
            (int(window), types == {FULL, SLIDING})
            if window and SLIDING in types
            else (None, False)
        )
    if window and getattr(config, "use_sliding_window", True):
        return int(window), False  # every layer slides (Mistral)
    return None, False


class TreeMaskKVWrapper(FlatKVWrapper):
    """forward(input_ids [B,S], attention_mask [B,P+S], position_ids [B,S], tree_mask [B,S,S],
    *past [B,Hkv,P,D]) -> (logits [B,S,V], *present [B,Hkv,P+S,D]).

    A lower-triangular tree_mask reproduces FlatKVWrapper (plain causal attention, sliding
    windows included); position ids are the caller's (a tree node at depth d sits at P + d).
    """

    def __init__(self, model: torch.nn.Module, num_layers: int) -> None:
        super().__init__(model, num_layers)
        self.window, self.mixed = sliding_layout(getattr(model, "config", None))

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        tree_mask: torch.Tensor,
        *past: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        dtype = next(self.model.parameters()).dtype
        mask: Any = tree_attention_mask(attention_mask, tree_mask, dtype, self.window)
        if self.mixed:
            full = tree_attention_mask(attention_mask, tree_mask, dtype)
            mask = {FULL: full, SLIDING: mask}
        return super().forward(input_ids, mask, position_ids, *past)


def probe_kv_shapes(model: torch.nn.Module, device: str = "cpu") -> list[tuple[int, int, int]]:
    """Per layer (kv_heads, key_dim, value_dim), read off a real forward pass.

    Reading shapes from the cache rather than the config covers MLA (DeepSeek), MQA and any
    family whose config spells head counts differently.
    """
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([[1, 2]], device=device),
            past_key_values=DynamicCache(),
            use_cache=True,
        )
    shapes = []
    for layer in out.past_key_values.layers:
        k, v = layer.keys, layer.values
        shapes.append((int(k.shape[1]), int(k.shape[-1]), int(v.shape[-1])))
    return shapes


def example_inputs(
    vocab_size: int,
    kv: list[tuple[int, int, int]],
    batch: int = 2,
    seq: int = 3,
    past: int = 4,
    tree_mask: bool = False,
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
    if tree_mask:
        tree = torch.tril(torch.ones(seq, seq, dtype=torch.int64)).expand(batch, seq, seq)
        return (ids, mask, pos, tree.contiguous(), *flat)
    return (ids, mask, pos, *flat)


def dynamic_shapes(num_layers: int, tree_mask: bool = False) -> dict[str, Any]:
    from torch.export import Dim

    b, s, p, t = (
        Dim("batch"),
        Dim("sequence_length"),
        Dim("past_sequence_length"),
        Dim("total_sequence_length"),
    )
    kv = tuple({0: b, 2: p} for _ in range(2 * num_layers))
    shapes: dict[str, Any] = {
        "input_ids": {0: b, 1: s},
        "attention_mask": {0: b, 1: t},
        "position_ids": {0: b, 1: s},
    }
    if tree_mask:
        shapes[TREE_MASK] = {0: b, 1: s, 2: s}
    shapes["past"] = kv
    return shapes
