"""One exception family for everything a user can get wrong.

Every error carries the fix in its message, because the CLI prints exactly that message and
exits 1: a user who reads it should know what to do next without reading a traceback.
"""

from __future__ import annotations


class SpecportError(Exception):
    """Base class: anything raised on purpose by specport."""

    exit_code = 1


class ModelNotFoundError(SpecportError):
    """A source model path or hub id that cannot be found locally."""


class UnsupportedArchitectureError(SpecportError):
    """A `model_type` with no registry entry."""


class InvalidModelError(SpecportError):
    """A source model whose files are present but unreadable (corrupt config, truncated weights)."""


class ArtifactError(SpecportError):
    """An artifact directory that is missing, tampered, truncated or from a newer specport."""


class ExportError(SpecportError):
    """Export failed or its verification against PyTorch was over tolerance."""


class ContextLengthError(SpecportError):
    """A prompt (plus the requested new tokens) that does not fit the context window."""


class ProviderError(SpecportError):
    """An execution provider that is unknown, not installed, or has no device."""


class InputError(SpecportError):
    """Bad option values or inputs (empty prompt, bad ids, bad sampling settings)."""


class PassError(SpecportError):
    """A graph pass that cannot run on the given model."""


class QuantizationError(SpecportError):
    """Quantization settings that cannot be applied (bad group size, missing calibration)."""
