"""Architecture registry: one small class per Hugging Face `model_type`, attributes only.

Behaviour lives in `ArchConfig`; an entry overrides attributes (and, rarely, one hook). Nothing
outside this registry branches on an architecture name: the exporter and runtime read the
normalized numbers that `ArchConfig.normalize` produces.

The entries live in `exporter/archs/` (one module per family) on the base in `archs/base.py`;
this module looks them up, importing the family modules on first use, so the entries import the
base and never this module.
"""

from __future__ import annotations

from typing import Any

from specport.core.errors import UnsupportedArchitectureError
from specport.exporter.archs.base import ENTRIES, ArchConfig


def lookup(model_type: str | None) -> type[ArchConfig]:
    _load_entries()
    if model_type not in ENTRIES:
        raise UnsupportedArchitectureError(
            f"architecture {model_type!r} is not supported. Supported model_type values: "
            f"{', '.join(supported())}. If your model is a close relative of one of these, "
            "add a registry entry in exporter/archs/ (a few lines)."
        )
    return ENTRIES[model_type]


def check_supported(arch: type[ArchConfig], config: Any) -> None:
    """Refuse, before any export work, a config option the registry entry does not implement."""
    missing = arch.missing_features(config)
    if missing:
        raise UnsupportedArchitectureError(
            f"{config.model_type!r} is supported, but not with: {'; '.join(missing)}. "
            "Exporting it would not match PyTorch. Use a checkpoint without these options, "
            "or extend the entry in exporter/archs/ (and its test fixture)."
        )


def supported() -> list[str]:
    _load_entries()
    return sorted(ENTRIES)


def _load_entries() -> None:
    # Importing the family modules runs their @register_arch decorators.
    from specport.exporter.archs import deepseek, gemma, gpt2, llama, phi3  # noqa: F401
