"""The KV interface: ``KVCache`` (rows x positions with per-row lengths) and ``StepOut``, what
one run over new tokens returns. ``kv.cache``'s docstring describes the methods and the two
implementations (``kv.cache.SharedKVCache``, ``kv.concat_cache.ConcatKVCache``); both import
this module, so neither imports the other.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import numpy as np


class StepOut(NamedTuple):
    """What a run over S new tokens per row returns (views of bound buffers, overwritten by
    the next run of the same shape: copy what must outlive it)."""

    logits: np.ndarray  # [b, S, V] (S = 1 with last_only)
    greedy: np.ndarray | None  # [b, S] the graph's argmax, None when it has none
    outputs: dict[str, np.ndarray]  # the graph's other outputs ([b, ...]), e.g. the MTP branch


class KVCache(Protocol):
    """Rows x positions with per-row lengths (see ``kv.cache``'s docstring)."""

    rows: int
    max_length: int
    lengths: np.ndarray  # [rows] int64
    ort_seconds: float  # time inside onnxruntime so far
    session: Any  # the session it runs
    has_tree: bool  # the graph takes a tree mask (token trees through ``step_row``)

    def reset(self) -> None: ...

    def step(self, ids: np.ndarray, live: np.ndarray) -> StepOut: ...

    def step_row(
        self, row: int, ids: np.ndarray, last_only: bool = False, tree: Any = None
    ) -> StepOut: ...

    def keep(self, row: int, positions: int) -> None: ...

    def keep_positions(self, row: int, index: np.ndarray) -> None: ...

    def copy_prefix(self, source: int, target: int, positions: int) -> None: ...

    def swap(self, a: int, b: int) -> None: ...

    def free(self, row: int) -> None: ...

    def fits(self, batch: int, s: int) -> bool: ...
