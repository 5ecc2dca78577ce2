"""The Python API: everything the CLI does, callable from code.

import specport
model = specport.load("out/llama")           # checks schema and hashes
result = model.generate("Once upon a time", max_new_tokens=32)
print(result.text, result.metrics["decode_tok_per_s"])
for piece in model.generate("Once upon a time", stream=True):   # text as it is produced
    print(piece, end="", flush=True)

Errors are `specport.SpecportError` subclasses whose messages name these keyword arguments.

This module is the public face only: `load` lives in `specport.loading`, `Model` in
`specport.model`, the build steps in `specport.build`; their names are re-exported here so
`from specport.api import ...` keeps one stable path.
"""

from __future__ import annotations

from specport.build import export, optimize, quantize, train_mtp
from specport.loading import load
from specport.model import Model
from specport.results import GenerationResult
from specport.text_stream import TextStream

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
