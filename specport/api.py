"""Deprecated import path: use `specport` itself (`import specport; specport.load(...)`).

`from specport.api import load` keeps working, with a DeprecationWarning, until 2027-03-01,
when this module will be removed. Each name is defined in one module (`specport.loading`,
`specport.build`, `specport.model`, `specport.results`, `specport.text_stream`) and importable
from `specport`.
"""

from __future__ import annotations

import warnings

from specport.build import export, optimize, quantize, train_mtp
from specport.loading import load
from specport.model import Model
from specport.results import GenerationResult
from specport.text_stream import TextStream

warnings.warn(
    "specport.api is deprecated and will be removed on 2027-03-01; import the same names from "
    "specport (e.g. `import specport; specport.load(...)`)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "GenerationResult",
    "Model",
    "TextStream",
    "export",
    "load",
    "optimize",
    "quantize",
    "train_mtp",
]
