"""The base of the architecture registry: `ArchConfig` (the behaviour every entry shares) and the
`register_arch` decorator that files an entry under its `model_type` values.

The family modules beside this one (`llama.py`, `gemma.py`, ...) import it; `exporter.registry`
looks entries up. Kept apart from the lookup so that an entry and the lookup that imports the
entries do not import each other.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

ENTRIES: dict[str, type[ArchConfig]] = {}  # model_type -> entry, filled by @register_arch

T = TypeVar("T", bound="type[ArchConfig]")


def register_arch(*model_types: str) -> Callable[[T], T]:
    """Class decorator: `@register_arch("qwen2") class Qwen2(Llama): ...`."""

    def deco(cls: T) -> T:
        for mt in model_types:
            if mt in ENTRIES:
                raise ValueError(f"architecture {mt!r} registered twice")
            ENTRIES[mt] = cls
        cls.model_types = tuple(model_types)
        return cls

    return deco


class ArchConfig:
    """Defaults fit Llama-style configs (attribute names of transformers' LlamaConfig)."""

    model_types: ClassVar[tuple[str, ...]] = ()
    # Keyword arguments for `from_pretrained` / `from_config` (e.g. an export-friendly kernel).
    load_kwargs: ClassVar[dict[str, Any]] = {}
    # Config attribute names, overridden by families that spell them differently (GPT-2).
    layers_attr: ClassVar[str] = "num_hidden_layers"
    heads_attr: ClassVar[str] = "num_attention_heads"
    kv_heads_attr: ClassVar[str | None] = "num_key_value_heads"
    context_attr: ClassVar[str] = "max_position_embeddings"
    # Rotary layout of the family (informational; fusion reads the graph, not this).
    rope: ClassVar[str] = "rotate_half"
    # Tolerance for export verification (max-abs logits error), scaled by max |logit|.
    atol: ClassVar[float] = 1e-4
    rtol: ClassVar[float] = 1e-4
    # Options checked before export (`missing_features`): what is outside these sets is refused
    # with its name, never exported. Rope scaling types whose frequencies are fixed at load
    # time (or, like longrope, chosen per call inside the graph) trace exactly; "dynamic"
    # recomputes them from the sequence length and is not among them.
    rope_types: ClassVar[frozenset[str]] = frozenset({"default"})
    layer_types: ClassVar[frozenset[str]] = frozenset({"full_attention", "sliding_attention"})
    # Config attributes naming a feature the entry does not implement: refused when truthy.
    refused: ClassVar[dict[str, str]] = {}
    # Trace attention through torch.onnx.ops.attention (exporter/onnx_attention.py): for
    # features transformers runs eagerly (soft-capping) that Attention-23 has.
    trace_onnx_attention: ClassVar[bool] = False

    @classmethod
    def normalize(cls, config: Any) -> dict[str, Any]:
        """The config numbers the runtime and passes need, under one set of names."""
        heads = int(getattr(config, cls.heads_attr))
        kv_heads = getattr(config, cls.kv_heads_attr, None) if cls.kv_heads_attr else None
        hidden = int(config.hidden_size)
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        eos = config.eos_token_id
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        rope_params = getattr(config, "rope_parameters", None) or {}
        by_type = _rope_by_layer_type(rope_params)
        return {
            "model_type": config.model_type,
            "num_layers": int(getattr(config, cls.layers_attr)),
            "num_heads": heads,
            "num_kv_heads": int(kv_heads or heads),
            "head_dim": int(head_dim),
            "hidden_size": hidden,
            "vocab_size": int(config.vocab_size),
            "context_length": int(getattr(config, cls.context_attr)),
            "rope_theta": rope_params.get("rope_theta", getattr(config, "rope_theta", None)),
            **({"rope_theta_by_layer_type": by_type} if by_type else {}),
            "rope_types": sorted(rope_types(config)),
            "sliding_window": getattr(config, "sliding_window", None),
            **({"layer_types": list(config.layer_types)} if _layer_types(config) else {}),
            "bos_token_id": config.bos_token_id,
            "eos_token_ids": eos_ids,
            "pad_token_id": config.pad_token_id,
            "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        }

    @classmethod
    def missing_features(cls, config: Any) -> list[str]:
        """What this config asks for that the entry does not implement (empty: supported)."""
        missing = [
            f"rope scaling {t!r} (supported: {', '.join(sorted(cls.rope_types))})"
            for t in sorted(rope_types(config) - cls.rope_types)
        ]
        other = sorted(_layer_types(config) - cls.layer_types)
        if other:
            missing.append(f"layer types {other} (supported: {', '.join(sorted(cls.layer_types))})")
        missing += [
            f"{what} ({attr}={getattr(config, attr)!r})"
            for attr, what in cls.refused.items()
            if getattr(config, attr, None)
        ]
        return missing

    @classmethod
    def extra_weights(cls, source_dir: Path | None, config: Any) -> dict[str, Any] | None:
        """Tensors the HF class drops on load but a later stage needs (e.g. MTP modules)."""
        return None


def rope_types(config: Any) -> set[str]:
    """The rope scaling types a config uses (one per layer type for Gemma 3), "default" = none."""
    params = getattr(config, "rope_parameters", None) or {}
    nested = _rope_by_layer_type(params)
    if nested:
        return {str(p.get("rope_type", "default")) for p in params.values()}
    if not params:
        return set()
    return {str(params.get("rope_type", params.get("type", "default")))}


def _rope_by_layer_type(params: Any) -> dict[str, Any]:
    """{layer type: rope_theta} when rope parameters are given per layer type, else {}."""
    if not isinstance(params, dict) or not params:
        return {}
    if all(isinstance(v, dict) for v in params.values()):
        return {k: v.get("rope_theta") for k, v in params.items()}
    return {}


def _layer_types(config: Any) -> set[str]:
    return set(getattr(config, "layer_types", None) or [])
