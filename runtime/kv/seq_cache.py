"""One sequence's KV cache that can append tokens and cut back: the speculative loops' only view of KV.

Speculative decoding appends ``[last token, drafts]`` in one run and then keeps a prefix. The
two layouts do that differently, and nothing above this module needs to know how:

* ``ConcatCache`` (``concat`` layout): the graph returns present = past + new; keeping ``n``
  positions keeps a view of the presents (onnxruntime packs a strided past while it reads it,
  the one copy a cut needs);
* ``SharedCache`` (``shared`` layout): one preallocated buffer per layer, written in place by
  onnxruntime's GroupQueryAttention through IO binding; keeping ``n`` positions only moves the
  sequence length back. The rejected drafts' keys and values stay in the buffer and the next
  step overwrites them: no KV is copied, ever.

Both give ``step(tokens) -> StepResult`` (per-position logits [S, V] for every fed token, or
only the last one, and any extra graph outputs such as the MTP branch's), ``keep(n)`` and, for
a token tree scored by ``step(tokens, tree=...)`` on a ``--tree-mask`` artifact,
``keep_positions(index)``: the accepted path's positions made contiguous (a gather of the
presents on concat; on shared an in-place move of those few positions within the buffer).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from specport.artifact import Manifest
from specport.contract import TREE_MASK, row_position_feeds
from specport.errors import InputError


@dataclass
class StepResult:
    """What one run over S appended tokens returns."""

    logits: np.ndarray  # [S, V] (or [1, V] with last_only): scores after each fed token
    outputs: dict[str, np.ndarray] = field(default_factory=dict)  # extra graph outputs by name


class SequenceCache(Protocol):
    """Batch-1 KV cache over a session: append tokens, read their logits, keep a prefix."""

    length: int  # positions cached (the context minus tokens not fed yet)
    ort_seconds: float  # time inside onnxruntime so far
    capacity: int | None  # positions the cache can hold (a shared buffer), None: unbounded
    bound: Any  # the shared layout's bound session (reused by the next cache), or None

    def step(
        self, tokens: list[int], last_only: bool = False, tree: Any = None, logits: bool = True
    ) -> StepResult: ...

    def keep(self, n: int) -> None: ...

    def keep_positions(self, index: np.ndarray) -> None: ...


class ConcatCache:
    """Concat-layout cache for one sequence: past [1, Hkv, P, D] per tensor, cut by slicing."""

    def __init__(self, session: Any, manifest: Manifest) -> None:
        kv = manifest.kv
        self.session = session
        self.names = [name for pair in kv.inputs for name in pair]
        self.output_names = [o.name for o in session.get_outputs()]
        self.n_kv = len(self.names)
        self.tree_mask = any(i.name == TREE_MASK for i in session.get_inputs())
        self._past: list[np.ndarray] = []
        for heads, kd, vd, dt in zip(kv.num_heads, kv.key_dim, kv.value_dim, kv.dtypes()):
            self._past.append(np.zeros((1, heads, 0, kd), dt))
            self._past.append(np.zeros((1, heads, 0, vd), dt))
        self.ort_seconds = 0.0
        self.capacity: int | None = None
        self.bound: Any = None  # nothing bound: the concat layout feeds arrays per run
        self._keep: int | None = None  # positions to keep of _past, applied at the next read

    @property
    def length(self) -> int:
        if self._keep is not None:
            return self._keep
        return int(self._past[0].shape[2]) if self._past else 0

    @property
    def past(self) -> list[np.ndarray]:
        """The cache, [1, Hkv, length, D] per tensor in manifest order."""
        if self._keep is not None:
            n, self._keep = self._keep, None
            self._past = [p[:, :, :n] for p in self._past]
        return self._past

    def step(
        self, tokens: list[int], last_only: bool = False, tree: Any = None, logits: bool = True
    ) -> StepResult:
        """Append ``tokens`` (a causal chain, or a token tree: ``tree`` = (depths [S], mask [S, S]))."""
        start, s = self.length, len(tokens)
        feeds: dict[str, np.ndarray] = {
            "input_ids": np.asarray([tokens], dtype=np.int64),  # [1, S]
            "attention_mask": np.ones((1, start + s), dtype=np.int64),  # [1, P+S]
            **dict(zip(self.names, self.past)),  # [1, Hkv, P, D] each
        }
        if tree is not None and not self.tree_mask:
            raise InputError(
                "token-tree verification needs a --tree-mask artifact on the concat layout."
            )
        feeds.update(row_position_feeds(start, s, tree, self.tree_mask))
        names = self.output_names if logits else self.output_names[1:]
        t0 = time.perf_counter()
        out = self.session.run(names, feeds)
        self.ort_seconds += time.perf_counter() - t0
        if not logits:  # the lean path (greedy MTP trusts the graph): no [S, V] copy out
            out = [np.zeros((0, 0), np.float32), *out]
        self._past = list(out[1 : 1 + self.n_kv])
        scores = out[0][0, -1:] if last_only and logits else (out[0][0] if logits else out[0])
        extra = dict(zip(self.output_names[1 + self.n_kv :], out[1 + self.n_kv :]))
        return StepResult(scores, extra)

    def keep(self, n: int) -> None:
        """Keep the first ``n`` positions (the cut is a view, taken at the next step)."""
        if n < self.length:
            self._keep = n

    def keep_positions(self, index: np.ndarray) -> None:
        """Keep exactly these cached positions, in this order (a tree's accepted path)."""
        self._past = [np.take(p, index, axis=2) for p in self.past]


class SharedCache:
    """One row of a ``kv.cache.SharedKVCache`` seen as a sequence: in-place buffers, cut by
    the row's length (the shared layout's view for the batch-1 loops)."""

    def __init__(
        self, session: Any, manifest: Manifest, max_length: int, bound: Any = None
    ) -> None:
        """``bound``: an existing one-row ``SharedKVCache`` to reuse (its row is emptied)."""
        from specport.runtime.kv.cache import SharedKVCache

        if bound is None or bound.rows != 1 or bound.max_length < max_length:
            bound = SharedKVCache(session, manifest, 1, max_length)
        bound.reset()
        self.bound = bound

    @property
    def length(self) -> int:
        return int(self.bound.lengths[0])

    @property
    def ort_seconds(self) -> float:
        return float(self.bound.ort_seconds)

    @property
    def capacity(self) -> int:
        return int(self.bound.max_length)

    def step(
        self, tokens: list[int], last_only: bool = False, tree: Any = None, logits: bool = True
    ) -> StepResult:
        """``logits=False`` is accepted for symmetry; the bound logits are cheap to keep.

        The returned logits and outputs are views of the bound output buffers: valid until the
        next step of the same width, which overwrites them. Copy what must outlive it.

        ``tree`` = (depths [S], mask [S, S]): a token tree through the fused attention's bias
        (an artifact exported with ``--kv-layout shared --tree-mask``).
        """
        if tree is not None and not self.bound.has_tree:
            raise InputError(
                "token-tree verification needs an artifact exported with --tree-mask; re-export "
                "with `specport export MODEL --out DIR --tree-mask` (either KV layout)."
            )
        out = self.bound.step_row(0, np.asarray(tokens, dtype=np.int64), last_only, tree)
        return StepResult(out.logits[0], out.outputs)

    def keep(self, n: int) -> None:
        """Forget positions past ``n``: the length moves, the buffers are not touched."""
        self.bound.keep(0, n)

    def keep_positions(self, index: np.ndarray) -> None:
        """Keep exactly these cached positions, in this order (a tree's accepted path)."""
        self.bound.keep_positions(0, index)


def open_cache(
    session: Any, manifest: Manifest, max_length: int | None = None, bound: Any = None
) -> ConcatCache | SharedCache:
    """The sequence cache for the artifact's layout (``max_length``: shared buffer positions)."""
    if manifest.kv.layout == "shared":
        limit = manifest.kv.max_length or manifest.context_length
        return SharedCache(session, manifest, min(max_length or limit, limit), bound)
    return ConcatCache(session, manifest)


def context_limit(manifest: Manifest) -> int:
    """Positions a sequence may reach: the context window, or a shared artifact's buffer."""
    if manifest.kv.layout == "shared" and manifest.kv.max_length:
        return min(manifest.context_length, manifest.kv.max_length)
    return manifest.context_length
