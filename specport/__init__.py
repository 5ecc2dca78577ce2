"""specport: export decoder-only LLMs to ONNX, rewrite them for fast inference, run them with
onnxruntime.

The public API is small on purpose: `load`, `export`, `quantize`, `optimize`, `train_mtp`,
`Model` and its results, and the error family (`SpecportError` and its subclasses, defined in
`specport.core.errors`). Everything the CLI does goes through these names. They live in
`specport.loading` (load), `specport.build` (export, quantize, optimize, train_mtp),
`specport.model`, `specport.results` and `specport.text_stream`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from specport.core.errors import (
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
    from specport.build import export, optimize, quantize, train_mtp
    from specport.drafting import train_draft
    from specport.loading import load
    from specport.model import Model
    from specport.results import GenerationResult
    from specport.text_stream import TextStream

# name -> the module that defines it
_API = {
    "load": "specport.loading",
    "export": "specport.build",
    "quantize": "specport.build",
    "optimize": "specport.build",
    "train_mtp": "specport.build",
    "train_draft": "specport.drafting",
    "Model": "specport.model",
    "GenerationResult": "specport.results",
    "TextStream": "specport.text_stream",
}


def __getattr__(name: str) -> Any:
    # Lazy: `import specport` must stay cheap (no torch import) for the CLI's --help.
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    if name == "errors":
        import importlib

        return importlib.import_module("specport.errors")  # a deprecated path: it warns
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
    "train_draft",
    "train_mtp",
]
