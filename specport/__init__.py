"""specport: export decoder-only LLMs to ONNX, rewrite them for fast inference, run them with
onnxruntime.

The public API is small on purpose: `load`, `export`, `quantize`, `optimize`, and the error
family (`SpecportError` and its subclasses, see `specport.errors`). Everything the CLI does
goes through `specport.api`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from specport.errors import (
    ArtifactError,
    ContextLengthError,
    ExportError,
    InputError,
    InvalidModelError,
    ModelNotFoundError,
    OutputError,
    PassError,
    ProviderError,
    QuantizationError,
    SpecportError,
    UnsupportedArchitectureError,
    UsageError,
)

__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from specport.api import GenerationResult, Model, TextStream, export, load, optimize, quantize

_API = {"load", "export", "quantize", "optimize", "Model", "GenerationResult", "TextStream"}


def __getattr__(name: str) -> Any:
    # Lazy: `import specport` must stay cheap (no torch import) for the CLI's --help.
    if name in _API:
        from specport import api

        return getattr(api, name)
    raise AttributeError(f"module 'specport' has no attribute {name!r}")


__all__ = [
    "ArtifactError",
    "ContextLengthError",
    "ExportError",
    "GenerationResult",
    "InputError",
    "InvalidModelError",
    "Model",
    "ModelNotFoundError",
    "OutputError",
    "PassError",
    "ProviderError",
    "QuantizationError",
    "SpecportError",
    "TextStream",
    "UnsupportedArchitectureError",
    "UsageError",
    "__version__",
    "export",
    "load",
    "optimize",
    "quantize",
]
