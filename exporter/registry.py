"""Architecture registry: one small class per Hugging Face `model_type`, attributes only.

Behaviour lives in `ArchConfig`; an entry overrides attributes (and, rarely, one hook). Nothing
outside this registry branches on an architecture name: the exporter and runtime read the
normalized numbers that `ArchConfig.normalize` produces.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from specport.errors import UnsupportedArchitectureError

_REGISTRY: dict[str, type[ArchConfig]] = {}

T = TypeVar("T", bound="type[ArchConfig]")


def register_arch(*model_types: str) -> Callable[[T], T]:
    """Class decorator: `@register_arch("qwen2") class Qwen2(Llama): ...`."""

    def deco(cls: T) -> T:
        for mt in model_types:
            if mt in _REGISTRY:
                raise ValueError(f"architecture {mt!r} registered twice")
            _REGISTRY[mt] = cls
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
            "sliding_window": getattr(config, "sliding_window", None),
            "bos_token_id": config.bos_token_id,
            "eos_token_ids": eos_ids,
            "pad_token_id": config.pad_token_id,
            "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        }

    @classmethod
    def extra_weights(cls, source_dir: Path | None, config: Any) -> dict[str, Any] | None:
        """Tensors the HF class drops on load but a later stage needs (e.g. MTP modules)."""
        return None


def lookup(model_type: str | None) -> type[ArchConfig]:
    _load_entries()
    if model_type not in _REGISTRY:
        raise UnsupportedArchitectureError(
            f"architecture {model_type!r} is not supported. Supported model_type values: "
            f"{', '.join(supported())}. If your model is a close relative of one of these, "
            "add a registry entry in exporter/archs/ (a few lines)."
        )
    return _REGISTRY[model_type]


def supported() -> list[str]:
    _load_entries()
    return sorted(_REGISTRY)


def _load_entries() -> None:
    # Importing the family modules runs their @register_arch decorators.
    from specport.exporter.archs import deepseek, gemma, gpt2, llama, phi3  # noqa: F401
