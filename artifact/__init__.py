"""The artifact's format: what every writer (the exporter, quantization, draft training,
`eval --record`) writes and the runtime reads, so the package sits below all of them and imports
only the core.

- `manifest`: `specport.json` (schema, `Manifest`, `read_manifest`), atomic writes, hash checks;
- `files`: `write_artifact_manifest`, which writes the files other runtimes read with it:
  `genai_config` (and `genai_graph` for onnxruntime-genai), `optimum_config` (Optimum's
  config.json and tokenizer_config.json) and `model_card` (README.md);
- `eval_record`: a measured perplexity recorded in the manifest and the card.

Deprecated: `specport.artifact` was the manifest module itself; its names
(`specport.artifact.read_manifest`, `Manifest`, ...) keep working from here with a
DeprecationWarning until 2027-03-01; import them from `specport.artifact.manifest`.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

# the names the former module `specport.artifact` defined, now in `specport.artifact.manifest`
_MOVED = {
    "SCHEMA_VERSION",
    "MANIFEST_NAME",
    "MODEL_NAME",
    "DATA_NAME",
    "KVLayout",
    "Manifest",
    "sha256_file",
    "hash_files",
    "write_manifest",
    "atomic_artifact_dir",
    "read_manifest",
    "refuse_hard_linked_weights",
    "weight_files",
    "verify_files",
}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        warnings.warn(
            f"specport.artifact.{name} is deprecated and will be removed on 2027-03-01; import "
            f"it from specport.artifact.manifest",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module("specport.artifact.manifest"), name)
    raise AttributeError(f"module 'specport.artifact' has no attribute {name!r}")
