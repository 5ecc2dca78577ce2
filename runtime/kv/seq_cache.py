"""One row of the KV cache seen as a sequence: the batch-1 users' view of either layout.

Scoring a text (`eval`, logprobs), a draft model's own cache and a feature probe need one
sequence that appends tokens, reads their logits and cuts back. That is one row of the one KV
interface (``kv.interface.KVCache``, opened for the artifact's layout by ``open_kv_cache``):
``RowCache`` only adapts its row-level calls (``step_row``, ``keep``, ``keep_positions``) to a
sequence's, so the two layouts keep a single implementation each:

* ``shared``: one preallocated buffer per layer written in place by onnxruntime's
  GroupQueryAttention through IO binding; keeping ``n`` positions only moves the row's length;
* ``concat``: the graph returns present = past + new; the row's presents are its next past,
  and keeping ``n`` positions feeds a view of them (onnxruntime packs the strided view).

``step(tokens) -> StepResult`` gives per-position logits [S, V] for every fed token (or only
the last one) and any extra graph outputs (the MTP branch's, EAGLE features); a token tree
scored by ``step(tokens, tree=...)`` on a ``--tree-mask`` artifact is committed with
``keep_positions(index)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specport.artifact.manifest import Manifest
from specport.runtime.kv.cache import open_kv_cache
from specport.runtime.kv.interface import KVCache


@dataclass
class StepResult:
    """What one run over S appended tokens returns."""

    logits: np.ndarray  # [S, V] (or [1, V] with last_only): scores after each fed token
    outputs: dict[str, np.ndarray] = field(default_factory=dict)  # extra graph outputs by name


class RowCache:
    """Row 0 of a one-row ``KVCache`` as a sequence (see the module docstring)."""

    def __init__(self, kv: KVCache, capacity: int | None) -> None:
        """``kv``: a one-row cache, emptied here (so a caller can reuse one binding);
        ``capacity``: the positions it can hold (None: the context window is the limit)."""
        kv.reset()
        self.bound = kv
        self.capacity = capacity

    @property
    def length(self) -> int:
        """Positions cached (the context minus tokens not fed yet)."""
        return int(self.bound.lengths[0])

    @property
    def ort_seconds(self) -> float:
        return float(self.bound.ort_seconds)

    def step(self, tokens: list[int], last_only: bool = False, tree: Any = None) -> StepResult:
        """Append ``tokens`` (a causal chain, or a token tree: ``tree`` = (depths [S], mask
        [S, S]), on an artifact exported with ``--tree-mask``).

        On the shared layout the returned logits and outputs are views of the bound output
        buffers, valid until the next step of the same width: copy what must outlive it."""
        out = self.bound.step_row(0, np.asarray(tokens, dtype=np.int64), last_only, tree)
        return StepResult(out.logits[0], out.outputs)

    def keep(self, n: int) -> None:
        """Forget positions past ``n``."""
        self.bound.keep(0, n)

    def assume(self, n: int) -> None:
        """Treat the first ``n`` positions as cached: another graph with the same KV shapes
        wrote them into these buffers (a draft running in its target's cache)."""
        self.bound.lengths[0] = n

    def keep_positions(self, index: np.ndarray) -> None:
        """Keep exactly these cached positions, in this order (a tree's accepted path)."""
        self.bound.keep_positions(0, index)


def open_cache(
    session: Any, manifest: Manifest, max_length: int | None = None, bound: Any = None
) -> RowCache:
    """A sequence over the artifact's layout (``max_length``: the positions to reserve on the
    shared layout); ``bound``: a previous cache's ``bound`` one-row cache to reuse when it is
    large enough (its buffers and bindings are kept, its row emptied)."""
    limit = context_limit(manifest)
    length = min(max_length or limit, limit)
    if bound is None or bound.rows != 1 or bound.max_length < length:
        bound = open_kv_cache(session, manifest, 1, length)
    return RowCache(bound, length if manifest.kv.layout == "shared" else None)


def context_limit(manifest: Manifest) -> int:
    """Positions a sequence may reach: the context window, or a shared artifact's buffer."""
    if manifest.kv.layout == "shared" and manifest.kv.max_length:
        return min(manifest.context_length, manifest.kv.max_length)
    return manifest.context_length
