"""KV slots for continuous batching: one set of batch buffers, bound many ways, no KV copies.

The batch buffers are [R, Hkv, T, D] per layer (R = max_batch rows, T = max_length). Two
families of IO bindings wrap numpy views of the same memory:

- decode at batch b (1 <= b <= R) binds rows [0, b): a step runs only up to the highest
  occupied row, so one request alone decodes at batch 1, like `Model.generate`;
- prefill of row r binds row r alone at batch 1: a batch-1 binding of the row's own view writes
  the prompt's KV in place, on top of whatever prefix the row already holds (prefix caching), so
  nothing is ever copied between buffers. (Speculative verification of several rows at once
  uses the decode binding with several tokens per row: `verify_rows`.)

Rows that take part in a decode step without a request in them (free rows, rows halfway
through a chunked prefill) get a dummy token written at their current length: past their valid
KV, so it is harmless, and their length is not advanced (`decode(..., live=...)`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from specport.artifact import Manifest
from specport.errors import ContextLengthError
from specport.runtime.kv.iobinding import BoundSession
from specport.runtime.kv.layouts import SharedKV

logger = logging.getLogger(__name__)


class KVSlots:
    """`rows` KV rows of `max_length` positions; `lengths[r]` = valid positions of row r."""

    def __init__(self, session: Any, manifest: Manifest, rows: int, max_length: int) -> None:
        self.session, self.manifest = session, manifest
        self.rows, self.max_length = rows, max_length
        self.kv = SharedKV(manifest, rows, max_length)  # owns the buffers
        self.lengths = np.zeros(rows, dtype=np.int64)
        self._decode: dict[int, BoundSession] = {}
        self._prefill: dict[int, BoundSession] = {}
        self.ort_seconds = 0.0

    def _view(self, start: int, stop: int) -> BoundSession:
        buffers = [b[start:stop] for b in self.kv.buffers]  # contiguous views, no copies
        kv = SharedKV(self.manifest, stop - start, self.max_length, buffers=buffers)
        return BoundSession(self.session, self.manifest, stop - start, self.max_length, kv=kv)

    def decode_session(self, batch: int) -> BoundSession:
        if batch not in self._decode:
            self._decode[batch] = self._view(0, batch)
        return self._decode[batch]

    def prefill_session(self, row: int) -> BoundSession:
        if row not in self._prefill:
            self._prefill[row] = self._view(row, row + 1)
        return self._prefill[row]

    def copy(self, source: int, target: int, positions: int) -> None:
        """Copy the first `positions` KV positions of row `source` into row `target`."""
        for buf in self.kv.buffers:  # [R, Hkv, T, D]
            buf[target, :, :positions] = buf[source, :, :positions]
        self.lengths[target] = positions

    def swap(self, a: int, b: int) -> None:
        """Exchange the valid KV positions (and lengths) of rows `a` and `b`."""
        la, lb = int(self.lengths[a]), int(self.lengths[b])
        for buf in self.kv.buffers:
            keep = buf[b, :, :lb].copy()
            buf[b, :, :la] = buf[a, :, :la]
            buf[a, :, :lb] = keep
        self.lengths[a], self.lengths[b] = lb, la

    def extend(self, row: int, ids: np.ndarray) -> tuple[np.ndarray, int | None]:
        """Append ids [S] to row `row` after its `lengths[row]` valid positions.

        Returns the last position's logits [V] (a fresh array) and its greedy id (None when the
        graph has no in-graph argmax).
        """
        bound = self.prefill_session(row)
        bound.kv.lengths = self.lengths[row : row + 1].copy()
        before = bound.ort_seconds
        logits, next_ids = bound.extend(np.asarray(ids, dtype=np.int64)[None, :], last_only=True)
        self.ort_seconds += bound.ort_seconds - before
        self.lengths[row] += len(ids)
        return logits[0, -1].copy(), (int(next_ids[0, -1]) if next_ids is not None else None)

    def verify(self, row: int, ids: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Feed ids [S] (last token + drafts) to row `row` at batch 1 and score every position.

        Returns logits [S, V] and the run's other outputs (the MTP branch, [1, ...]): views
        overwritten by the row's next run of the same width (`BoundSession.extend`). The row's length moves past all S
        positions; `keep` moves it back to the accepted prefix (no KV is copied).
        """
        bound = self.prefill_session(row)
        bound.kv.lengths = self.lengths[row : row + 1].copy()
        before = bound.ort_seconds
        logits, _ = bound.extend(np.asarray(ids, dtype=np.int64)[None, :])
        self.ort_seconds += bound.ort_seconds - before
        self.lengths[row] += len(ids)
        return logits[0], bound.extra_outputs()

    def verify_rows(self, ids: np.ndarray, live: np.ndarray) -> np.ndarray:
        """Feed ids [b, S] after the valid positions of each of rows [0, b) in one run and
        score every position: logits [b, S, V] (a view overwritten by the next run of this
        width).

        Live rows' lengths move past all S positions (`keep` moves each back to what it
        accepted); the other rows (free, halfway through a prefill) get their S tokens past
        their valid KV, harmless, and keep their lengths. The graph feeds GroupQueryAttention
        `query_seqlens`, which is what lets it take several new tokens on a past at batch > 1.
        Call only when `fits(b, S)`.
        """
        batch, s = ids.shape
        bound = self.decode_session(batch)
        bound.kv.lengths = self.lengths[:batch].copy()
        before = bound.ort_seconds
        logits, _ = bound.extend(np.asarray(ids, dtype=np.int64))
        self.ort_seconds += bound.ort_seconds - before
        self.lengths[:batch] += np.where(live, s, 0)
        return logits

    def fits(self, batch: int, s: int) -> bool:
        """Every row of [0, batch) has room for `s` more positions."""
        return bool((self.lengths[:batch] + s <= self.max_length).all())

    def keep(self, row: int, positions: int) -> None:
        """Roll row `row` back to its first `positions` KV positions (rejected drafts)."""
        self.lengths[row] = min(int(self.lengths[row]), positions)

    def decode(self, ids: np.ndarray, live: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """One step over rows [0, b), b = len(ids); only `live` rows [b] bool advance.

        Returns logits [b, V] and greedy ids [b] (views, overwritten by the next step). A row
        that is not live must have room for the dummy position (lengths < max_length).
        """
        batch = len(ids)
        full = (~live) & (self.lengths[:batch] >= self.max_length)
        if full.any():  # only a free row that cached a full buffer: give up its last position
            self.lengths[:batch][full] = self.max_length - 1
        if int(self.lengths[:batch][live].max(initial=0)) >= self.max_length:
            raise ContextLengthError(f"KV buffer full ({self.max_length} positions).")
        bound = self.decode_session(batch)
        bound.kv.lengths = self.lengths[:batch].copy()
        before = bound.ort_seconds
        logits, next_ids = bound.decode(np.where(live, ids, 0))
        self.ort_seconds += bound.ort_seconds - before
        self.lengths[:batch] += live
        return logits, next_ids


def takes_batched_steps(model_file: Path) -> bool:
    """Does the graph take several new tokens on a past at batch > 1? Only when every
    GroupQueryAttention is fed `query_seqlens` (input 16); graphs exported before that refuse
    it. Read from the graph's structure (weights stay on disk): a trial run would print
    onnxruntime's refusal on the user's terminal."""
    import onnx

    graph = onnx.load(str(model_file), load_external_data=False).graph
    attention = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    return bool(attention) and all(len(n.input) > 16 and n.input[16] for n in attention)
