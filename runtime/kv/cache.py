"""The KV interface every generation path uses: rows x positions with per-row lengths.

A ``KVCache`` holds ``rows`` sequences of up to ``max_length`` positions; ``lengths[r]`` counts
row r's valid positions. Everything a decode step needs is a method:

* ``step(ids [b, S], live [b])``: append S tokens after each of rows [0, b) in one run (a
  plain decode step at S = 1, a batched verification of [last, drafts] at S > 1); live rows
  advance by S, the others (free, halfway through a prefill) get harmless tokens past their
  valid KV and keep their lengths;
* ``step_row(row, ids [S], last_only, tree)``: append S tokens to one row alone (a prompt
  chunk, a verification at batch 1, a token tree scored through the graph's tree mask);
* ``prefill_rows(first, ids [B, S], lengths [B])`` (the in-place cache only): prompt chunks
  of several lengths into a block of consecutive rows in one run (the batching engine's
  prefill groups, ``engine/prefill_plan.py``);
* ``keep(row, n)``: roll a row back to n positions (rejected drafts), ``keep_positions(row,
  index)``: keep exactly these positions (a tree's accepted path), ``copy_prefix(src, dst,
  n)`` / ``swap(a, b)``: the prefix cache, ``free(row)``.
* ``held_bytes()`` / ``commit_bytes(n)`` / ``release(row, keep)`` (the in-place cache only):
  the pages each row holds, what n written positions commit, and handing a row's pages past
  ``keep`` positions back to the system (``kv.memory``; the batching engine's KV space).

The interface itself (``KVCache`` and what a run returns, ``StepOut``) is ``kv.interface``, below
both implementations. Two implementations, chosen by the artifact's layout (``open_kv_cache``). ``SharedKVCache``:
one preallocated buffer [R, Hkv, T, D] per layer (the artifact's ``shared`` layout), written
in place by onnxruntime's fused attention through IO binding (``kv.iobinding.BoundSession``,
its private detail: a batch-b binding of rows [0, b) and a batch-1 binding of each row's own
contiguous view). Rolling back only moves a length; no KV is copied except by
``copy_prefix``, ``swap`` and a tree's ``keep_positions``.

``kv.concat_cache.ConcatKVCache``: the ``concat`` layout (past in, present out) behind the
same interface, rows left-padded in one tensor per layer that the graph's presents replace
each step (a rollback moves a length; the next batched step realigns the rows). Concat stays
a runtime path because some models can only run that way (onnxruntime's fused attention,
which the in-place buffers need, refuses e.g. stories260K's head dim of 8, so ``--kv-layout
auto`` exports it concat) and because Optimum / onnxruntime-genai format artifacts arrive
that way. Measured (SmolLM2-135M fp32, plain greedy decode at batch 1, one thread, both
layouts interleaved, 2026-11-27 on the 2-core AVX2 machine at load average 8-9): CPU time per
new token 53.3 ms shared vs 58.2 ms concat (thread CPU time, robust to the load), wall 3.58 vs
3.10 tok/s (medians of 3 rounds; an earlier wall-only run at load 9 read 2.03 vs 2.61, inside
the noise of that load): the shared layout is the faster path wherever it runs, concat stays
for the models and tools that need it.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from specport.artifact.manifest import Manifest
from specport.core.contract import TREE_MASK
from specport.core.errors import ArtifactError, ContextLengthError
from specport.runtime.kv.concat_cache import ConcatKVCache
from specport.runtime.kv.interface import KVCache, StepOut
from specport.runtime.kv.iobinding import BoundSession
from specport.runtime.kv.layouts import SharedKV
from specport.runtime.kv.memory import row_commit

logger = logging.getLogger(__name__)


class SharedKVCache:
    """``rows`` rows of ``max_length`` positions in the shared layout's in-place buffers."""

    def __init__(
        self,
        session: Any,
        manifest: Manifest,
        rows: int,
        max_length: int,
        small_pages: bool = False,
        buffers: list[np.ndarray] | None = None,
    ) -> None:
        """`small_pages`: buffers committed 4 KiB at a time as written (`kv.memory`);
        `buffers`: existing per-layer arrays of this layout's shapes to run in (another
        graph's cache rows), instead of allocating them."""
        if manifest.kv.layout != "shared":
            raise ArtifactError("the in-place KV cache needs a `shared` KV layout artifact.")
        self.session, self.manifest = session, manifest
        self.rows, self.max_length = rows, max_length
        self.kv = SharedKV(manifest, rows, max_length, buffers=buffers, small_pages=small_pages)
        self.lengths = np.zeros(rows, dtype=np.int64)
        # positions of each row written since its pages were last released (what it commits)
        self.written = np.zeros(rows, dtype=np.int64)
        self._batch: dict[int, BoundSession] = {}  # rows [0, b) bound at batch b
        self._row: dict[int, BoundSession] = {}  # row r's own view bound at batch 1
        self.ort_seconds = 0.0
        # this thread's CPU time inside onnxruntime (the run's own work with one intra-op
        # thread; with more, only the calling thread's share): what a served token costs
        self.ort_cpu_seconds = 0.0
        self.has_tree = TREE_MASK in {i.name for i in session.get_inputs()}  # --tree-mask

    @property
    def buffers(self) -> list[np.ndarray]:
        """The per-layer buffers [R, Hkv, T, D] (keys and values, manifest order)."""
        return self.kv.buffers

    def reset(self) -> None:
        """Every row empty (buffers kept: stale positions are overwritten)."""
        self.lengths[:] = 0
        self.ort_seconds = self.ort_cpu_seconds = 0.0

    # ---- bindings -------------------------------------------------------------------
    def _view(self, start: int, stop: int) -> BoundSession:
        buffers = [b[start:stop] for b in self.kv.buffers]  # contiguous views, no copies
        kv = SharedKV(self.manifest, stop - start, self.max_length, buffers=buffers)
        return BoundSession(self.session, self.manifest, stop - start, self.max_length, kv=kv)

    def _rows(self, batch: int) -> BoundSession:
        if batch not in self._batch:
            self._batch[batch] = self._view(0, batch)
        return self._batch[batch]

    def _one(self, row: int) -> BoundSession:
        if row not in self._row:
            self._row[row] = self._view(row, row + 1)
        return self._row[row]

    # ---- runs -----------------------------------------------------------------------
    def _spent(self, bound: BoundSession, before: tuple[float, float]) -> None:
        """Add a binding's onnxruntime time since `before` (`_clocks`) to the cache's."""
        self.ort_seconds += bound.ort_seconds - before[0]
        self.ort_cpu_seconds += bound.ort_cpu_seconds - before[1]

    def step(self, ids: np.ndarray, live: np.ndarray) -> StepOut:
        """ids [b, S] after the valid positions of rows [0, b), one run; live [b] bool rows
        advance by S. At S > 1 with b > 1 the graph must take batched multi-token steps
        (``takes_batched_steps``)."""
        batch, s = ids.shape
        if s == 1:
            return self._decode(ids[:, 0], live)
        bound = self._rows(batch)
        bound.kv.lengths[:] = self.lengths[:batch]
        self._wrote(slice(0, batch), self.lengths[:batch] + s)  # every row, live or not
        before = _clocks(bound)
        logits, greedy = bound.extend(np.asarray(ids, dtype=np.int64))
        self._spent(bound, before)
        self.lengths[:batch] += np.where(live, s, 0)
        return StepOut(logits, greedy, bound.extra_outputs())

    def _decode(self, ids: np.ndarray, live: np.ndarray) -> StepOut:
        batch = len(ids)
        lengths = self.lengths[:batch]
        full = (~live) & (lengths >= self.max_length)
        if full.any():  # only a free row that cached a full buffer: give up its last position
            lengths[full] = self.max_length - 1
        if int(lengths[live].max(initial=0)) >= self.max_length:
            raise ContextLengthError(f"KV buffer full ({self.max_length} positions).")
        bound = self._rows(batch)
        bound.kv.lengths[:] = lengths
        self._wrote(slice(0, batch), lengths + 1)  # a free row's harmless token is written too
        before = _clocks(bound)
        bound.decode(np.where(live, ids, 0))
        self._spent(bound, before)
        lengths += live
        return _decoded(bound)

    def step_row(
        self, row: int, ids: np.ndarray, last_only: bool = False, tree: Any = None
    ) -> StepOut:
        """ids [S] after row ``row``'s valid positions, at batch 1 on the row's own view.

        ``last_only``: only the last position is scored (a prompt chunk); ``tree`` = (depths
        [S], ancestor mask [S, S]): a token tree through the graph's tree mask. Returns
        logits [1, S or 1, V]; the row advances by S."""
        bound = self._one(row)
        # one row's lengths as ints, not array slices: this runs every batch-1 step, between
        # runs, where each numpy call is slow (caches cold from the weight stream)
        end = int(self.lengths[row]) + len(ids)
        bound.kv.lengths[0] = end - len(ids)  # in place: the binding's own length array
        if end > self.written[row]:
            self.written[row] = min(end, self.max_length)
        before = _clocks(bound)
        if len(ids) == 1 and tree is None:  # a decode step: the one-token binding
            bound.decode(ids)
            self._spent(bound, before)
            self.lengths[row] = end
            return _decoded(bound)
        logits, greedy = bound.extend(
            np.asarray(ids, dtype=np.int64)[None, :], last_only=last_only, tree=tree
        )
        self._spent(bound, before)
        self.lengths[row] = end
        return StepOut(logits, greedy, bound.extra_outputs())

    def prefill_rows(self, first: int, ids: np.ndarray, lengths: np.ndarray) -> StepOut:
        """Prompt chunks into rows [first, first + B) in one run on their contiguous view.

        ids [B, S] right-padded, row b's ``lengths[b]`` (>= 1) tokens after its valid
        positions; returns each row's last real token's logits [B, 1, V] (greedy [B, 1]) and
        the rows advance by their lengths. Rows that are all empty take the graph's prompt
        path (``BoundSession.prefill``, any shared graph); rows that hold KV (a prefix-cache
        hit, a later chunk) need, at B > 1, a graph that takes batched multi-token steps
        (``takes_batched_steps``). A block's view is made per call (1-2 ms beside a run's
        45 ms and more; kept, the bound buffers of every block and width would add up),
        except rows [0, b), which run on the binding the batched steps keep."""
        batch = ids.shape[0]
        lengths = np.asarray(lengths, dtype=np.int64)
        held = self.lengths[first : first + batch]
        self._wrote(slice(first, first + batch), held + ids.shape[1])  # padding is written too
        if batch == 1:
            bound = self._one(first)
        elif first == 0:  # rows [0, b): the binding the batched steps run (kept)
            bound = self._rows(batch)
        else:
            bound = self._view(first, first + batch)
        before = _clocks(bound)
        if not held.any():
            bound.kv.lengths = np.zeros(batch, dtype=np.int64)
            logits, greedy = bound.prefill(np.asarray(ids, dtype=np.int64), lengths)
            out = StepOut(
                logits[:, None], None if greedy is None else greedy[:, None], bound.extra_outputs()
            )
        else:
            bound.kv.lengths = held.copy()
            logits, greedy = bound.extend(np.asarray(ids, dtype=np.int64), last=lengths - 1)
            out = StepOut(logits, greedy, bound.extra_outputs())
        self._spent(bound, before)
        self.lengths[first : first + batch] += lengths
        return out

    # ---- lengths and positions ------------------------------------------------------
    def fits(self, batch: int, s: int) -> bool:
        """Every row of [0, batch) has room for ``s`` more positions."""
        return bool((self.lengths[:batch] + s <= self.max_length).all())

    def keep(self, row: int, positions: int) -> None:
        """Roll row ``row`` back to its first ``positions`` positions (no KV is touched)."""
        self.lengths[row] = min(int(self.lengths[row]), positions)

    def keep_positions(self, row: int, index: np.ndarray) -> None:
        """Keep exactly these positions of ``row``, in this order (a tree's accepted path).

        The kept positions are the past (unchanged, in place) plus a few accepted nodes: only
        those move, within the row, and the length follows. Nothing is reallocated."""
        index = np.asarray(index, dtype=np.int64)
        moved = np.flatnonzero(index != np.arange(index.shape[0]))
        if moved.size:
            first = int(moved[0])
            src = index[first:]
            for buf in self.kv.buffers:  # [R, Hkv, T, D]
                part = buf[row]  # a view; part[:, src] copies before the write
                part[:, first : index.shape[0]] = part[:, src]
        self.lengths[row] = index.shape[0]

    def copy_prefix(self, source: int, target: int, positions: int) -> None:
        """Copy the first ``positions`` positions of row ``source`` into row ``target``."""
        for buf in self.kv.buffers:
            buf[target, :, :positions] = buf[source, :, :positions]
        self.lengths[target] = positions
        self._wrote(slice(target, target + 1), np.array([positions]))

    def swap(self, a: int, b: int) -> None:
        """Exchange the valid positions (and lengths) of rows ``a`` and ``b``."""
        la, lb = int(self.lengths[a]), int(self.lengths[b])
        if la == lb == 0:
            return
        for buf in self.kv.buffers:
            keep = buf[b, :, :lb].copy()
            buf[b, :, :la] = buf[a, :, :la]
            buf[a, :, :lb] = keep
        self.lengths[a], self.lengths[b] = lb, la
        self.written[a], self.written[b] = max(self.written[a], lb), max(self.written[b], la)

    def free(self, row: int) -> None:
        """Forget row ``row`` (its buffer is overwritten by the next request there)."""
        self.lengths[row] = 0

    # ---- memory ---------------------------------------------------------------------
    def _wrote(self, rows: slice, ends: np.ndarray) -> None:
        self.written[rows] = np.maximum(self.written[rows], np.minimum(ends, self.max_length))

    def commit_bytes(self, positions: np.ndarray | int) -> np.ndarray:
        """Bytes a row's pages hold once its first ``positions`` positions are written."""
        return row_commit(self.kv.memory, positions)

    def held_bytes(self) -> np.ndarray:
        """[rows] bytes each row's pages hold now (running or not: a freed row keeps its
        pages, and its KV for the prefix cache, until ``release``)."""
        return self.commit_bytes(self.written)

    def release(self, row: int, keep: int = 0) -> None:
        """Hand row ``row``'s pages past its first ``keep`` positions back to the system; the
        row keeps at most ``keep`` valid positions (the rest reads as zeros)."""
        for buf in self.kv.memory:
            buf.release(row, keep)
        self.lengths[row] = min(int(self.lengths[row]), keep)
        self.written[row] = min(int(self.written[row]), keep)


def _clocks(bound: BoundSession) -> tuple[float, float]:
    """A binding's onnxruntime (wall, CPU) seconds so far."""
    return bound.ort_seconds, bound.ort_cpu_seconds


def _decoded(bound: BoundSession) -> StepOut:
    """A one-token run's outputs: the binding's decode buffers as they are ([b, 1, V], [b, 1])."""
    return StepOut(bound.logits, bound.next_token if bound.has_next else None, bound.extra)


def open_kv_cache(session: Any, manifest: Manifest, rows: int, max_length: int) -> KVCache:
    """The KV cache for the artifact's layout: ``shared`` in-place buffers or ``concat``."""
    layout = manifest.kv.layout
    if layout == "shared":
        return SharedKVCache(session, manifest, rows, max_length)
    if layout == "concat":
        return ConcatKVCache(session, manifest, rows, max_length)
    raise ArtifactError(f"KV layout {layout!r} is not supported by this runtime; upgrade specport.")


def takes_batched_steps(model_file: Path) -> bool:
    """Does the graph take several new tokens on a past at batch > 1? Only when every
    GroupQueryAttention is fed `query_seqlens` (input 16); graphs exported before that refuse
    it. Read from the graph's structure (weights stay on disk): a trial run would print
    onnxruntime's refusal on the user's terminal."""
    import onnx

    graph = onnx.load(str(model_file), load_external_data=False).graph
    attention = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    return bool(attention) and all(len(n.input) > 16 and n.input[16] for n in attention)


_BATCHED: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def session_takes_batched_steps(session: Any, model_file: Path) -> bool:
    """``takes_batched_steps`` for the graph ``session`` runs, read once per session (a
    session's graph does not change; reading the graph's structure took milliseconds on every
    batched speculative call)."""
    try:
        return _BATCHED[session]
    except (KeyError, TypeError):
        pass
    fed = takes_batched_steps(model_file)
    with contextlib.suppress(TypeError):  # not weakly referenceable: read again next time
        _BATCHED[session] = fed
    return fed
