"""specport: export decoder-only LLMs to ONNX, rewrite them for fast inference, run them with
onnxruntime.

The public API is small on purpose: `load`, `export`, and the error family in
`specport.errors`. Everything the CLI does goes through `specport.api`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from specport.api import export, load


def __getattr__(name: str) -> Any:
    # Lazy: `import specport` must stay cheap (no torch import) for the CLI's --help.
    if name in {"load", "export", "quantize", "optimize"}:
        from specport import api

        return getattr(api, name)
    raise AttributeError(name)


__all__ = ["__version__", "export", "load"]
