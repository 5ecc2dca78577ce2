"""KV-cache state per layout, behind one small interface the generator uses.

`concat`: the graph returns present = past + new; we feed it back as the next past.
Other layouts (a shared preallocated buffer written in place) plug in here.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from specport.artifact import Manifest


class KVState(Protocol):
    def feeds(self) -> dict[str, Any]: ...

    def update(self, outputs: list[Any]) -> None: ...


class ConcatKV:
    """Past tensors [B, Hkv, P, D] per layer; outputs[1:] are the presents in manifest order."""

    def __init__(self, manifest: Manifest, batch: int) -> None:
        kv = manifest.kv
        self.names = [name for pair in kv.inputs for name in pair]
        dtype = np.dtype(kv.dtype)
        self.past: list[np.ndarray] = []
        for heads, kd, vd in zip(kv.num_heads, kv.key_dim, kv.value_dim):
            self.past.append(np.zeros((batch, heads, 0, kd), dtype))
            self.past.append(np.zeros((batch, heads, 0, vd), dtype))

    def feeds(self) -> dict[str, Any]:
        return dict(zip(self.names, self.past))

    def update(self, outputs: list[Any]) -> None:
        self.past = list(outputs[1 : 1 + len(self.names)])


def make_kv_state(manifest: Manifest, batch: int) -> KVState:
    layout = manifest.kv.layout
    if layout == "concat":
        return ConcatKV(manifest, batch)
    from specport.errors import ArtifactError

    raise ArtifactError(f"KV layout {layout!r} is not supported by this runtime; upgrade specport.")
