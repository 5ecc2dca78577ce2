"""One exception family for everything a user can get wrong.

Every error carries the fix in its message, because the CLI prints exactly that message (one
line, never a traceback): a user who reads it should know what to do next. The classes are
importable from the package root (`specport.SpecportError`, ...), so code that calls the API
can catch the family or one member::

    SpecportError                     anything raised on purpose by specport (CLI exit 1)
    ├── ModelNotFoundError            a source model path or hub id that is not there
    ├── UnsupportedArchitectureError  a `model_type` with no registry entry
    ├── InvalidModelError             source files present but unreadable (also bad ONNX input)
    ├── ArtifactError                 an artifact that is missing, tampered, truncated or newer
    ├── OutputError                   an output path that must not or cannot be written
    ├── ExportError                   export failed or disagrees with PyTorch
    ├── ContextLengthError            a prompt (+ new tokens) longer than the context window
    ├── ProviderError                 an execution provider that is unknown or unavailable
    ├── InputError                    bad input values (prompts, ids, sampling settings)
    │   └── UsageError                arguments that cannot work, alone or together (CLI exit 2)
    ├── PassError                     a graph pass that cannot run on the given model
    └── QuantizationError             quantization settings that cannot be applied
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
    """A source model whose files are present but unreadable (corrupt config, truncated weights,
    an ONNX file that is not ONNX or fails the checker)."""


class ArtifactError(SpecportError):
    """An artifact directory that is missing, tampered, truncated or from a newer specport."""


class OutputError(SpecportError):
    """An output path specport must not replace (a user's file, a non-artifact directory) or
    cannot write (no permission, a parent that is a file)."""


class ExportError(SpecportError):
    """Export failed or its verification against PyTorch was over tolerance."""


class ContextLengthError(SpecportError):
    """A prompt (plus the requested new tokens) that does not fit the context window."""


class ProviderError(SpecportError):
    """An execution provider that is unknown, not installed, or has no device."""


class InputError(SpecportError):
    """Bad option values or inputs (empty prompt, bad ids, bad sampling settings)."""


class UsageError(InputError):
    """Arguments that cannot work, before any work starts: a value out of range, two options
    that exclude each other, an output that would overwrite the input. The CLI exits 2."""

    exit_code = 2


class PassError(SpecportError):
    """A graph pass that cannot run on the given model."""


class QuantizationError(SpecportError):
    """Quantization settings that cannot be applied (bad group size, missing calibration)."""


__all__ = [
    "ArtifactError",
    "ContextLengthError",
    "ExportError",
    "InputError",
    "InvalidModelError",
    "ModelNotFoundError",
    "OutputError",
    "PassError",
    "ProviderError",
    "QuantizationError",
    "SpecportError",
    "UnsupportedArchitectureError",
    "UsageError",
]
