"""The concat layout behind the KV interface: rows x positions over past-in, present-out graphs.

A concat graph takes each layer's past [B, Hkv, W, D] with ``attention_mask`` [B, W+S] and
explicit ``position_ids`` [B, S], and returns the presents [B, Hkv, W+S, D] (past + new). Rows
of different lengths share one run by left padding: row r's ``lengths[r]`` positions lie
right-aligned at [W - lengths[r], W) and the mask hides the rest, so the new tokens of every
row land at [W, W+S) and the presents are directly the next step's past. Left padding keeps
the distances between a row's positions those of a run of its own (sliding windows count
slots), which a mask with holes in the middle would not.

What costs a copy, and when:

* a batched step where every live row is right-aligned (plain decoding, every draft
  accepted): none; the presents become the cache;
* a rollback (``keep``) only moves the row's length: its kept positions then end before the
  others', and the next batched step realigns them, in one slice (every live row ends at the
  same slot: onnxruntime packs the strided view it is fed) or one copy per row and tensor
  into a fresh left-padded tensor (the copy the former batched loop, ``PaddedKV.compact``,
  made after every step); padding common to every row (``MAX_SLACK``) is dropped the same way;
* a row run alone (``step_row``: a prompt, a token tree) is fed its own positions and keeps its
  presents apart until the next batched step merges it.

A step runs only its live rows: the tensor holds exactly the rows of the last run, in order,
and a row that drops out (finished, waiting) is parked apart with one copy, so it costs
nothing in later runs (the rows' scores are returned at their own indices). Pad slots hold
finite stale values: every fed query attends to at least itself, so nothing NaN is ever
computed into them.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from specport.artifact.manifest import Manifest
from specport.core.contract import TREE_MASK, causal_tree_mask, row_position_feeds
from specport.core.errors import ArtifactError, ContextLengthError, InputError
from specport.runtime.kv.interface import StepOut

# the common left padding a batched step may carry before the cache is rebuilt without it
MAX_SLACK = 32


class ConcatKVCache:
    """``rows`` rows of up to ``max_length`` positions over a concat-layout session (see the
    module docstring). Implements ``kv.interface.KVCache``."""

    def __init__(self, session: Any, manifest: Manifest, rows: int, max_length: int) -> None:
        if manifest.kv.layout != "concat":
            raise ArtifactError("the concat KV cache needs a `concat` KV layout artifact.")
        kv = manifest.kv
        self.session, self.manifest = session, manifest
        self.rows, self.max_length = rows, max_length
        self.names = [name for pair in kv.inputs for name in pair]
        self.n_kv = len(self.names)
        self.output_names = [o.name for o in session.get_outputs()]
        self._extra = self.output_names[1 + self.n_kv :]
        io = manifest.extra.get("runtime", {}) if isinstance(manifest.extra, dict) else {}
        greedy = io.get("next_token_output", "next_token")
        self._greedy = greedy if greedy in self._extra else None
        self.has_tree = TREE_MASK in {i.name for i in session.get_inputs()}  # --tree-mask
        self._empty: list[np.ndarray] = []  # [0, Hkv, 0, D] per tensor (shapes and dtypes)
        for heads, kd, vd, dt in zip(kv.num_heads, kv.key_dim, kv.value_dim, kv.dtypes()):
            self._empty += [np.zeros((0, heads, 0, kd), dt), np.zeros((0, heads, 0, vd), dt)]
        self.lengths = np.zeros(rows, dtype=np.int64)
        self.ort_seconds = 0.0
        self.reset()

    def reset(self) -> None:
        """Every row empty."""
        self.lengths[:] = 0
        self.ort_seconds = 0.0
        self._past: list[np.ndarray] = list(self._empty)  # [n, Hkv, W, D] per tensor
        self._slots: list[int] = []  # the rows _past holds, in its order
        self._slot: dict[int, int] = {}  # row -> its index in _past
        self._start = np.zeros(self.rows, dtype=np.int64)  # row r's first slot in _past
        self._apart: dict[int, list[np.ndarray]] = {}  # rows held outside _past [1, Hkv, >=L, D]

    @property
    def width(self) -> int:
        """W: the slots per row of the batched tensor."""
        return int(self._past[0].shape[2])

    # ---- runs -----------------------------------------------------------------------
    def step(self, ids: np.ndarray, live: np.ndarray) -> StepOut:
        """ids [b, S] after the valid positions of rows [0, b), one run over the live rows,
        which advance by S; the others keep their positions (their ids are not run, their
        scores in the result are zeros)."""
        ids = np.asarray(ids, dtype=np.int64)
        batch, s = ids.shape
        rows = np.flatnonzero(live)
        if rows.size == 0:
            return StepOut(np.zeros((batch, s, self.manifest.vocab_size), np.float32), None, {})
        every = rows.size == batch
        order = rows.tolist()
        lengths = self.lengths[:batch] if every else self.lengths[rows]
        if s == 1 and int(lengths.max()) >= self.max_length:
            raise ContextLengthError(f"KV cache full ({self.max_length} positions).")
        if order != self._slots or not self._aligned(order, lengths):
            self._rebuild(order, lengths)
        w = self.width
        mask = np.ones((rows.size, w + s), dtype=np.int64)
        mask[:, :w] = np.arange(w)[None, :] >= (w - lengths)[:, None]
        last = self.manifest.context_length - 1  # padding past the window: the last slot
        positions = np.minimum(lengths[:, None] + np.arange(s)[None, :], last)
        feeds = {
            "input_ids": ids if every else ids[rows],
            "attention_mask": mask,
            "position_ids": positions,
        }
        feeds.update(zip(self.names, self._past))
        if self.has_tree:
            feeds[TREE_MASK] = causal_tree_mask(rows.size, s)
        out = self._run(feeds)
        self._past = out[1 : 1 + self.n_kv]  # [n, Hkv, W+S, D]: every row ends at W+S
        if every:
            self._start[:batch] = w - lengths
            self.lengths[:batch] += s
            return self._out(out)
        self._start[rows] = w - lengths
        self.lengths[rows] += s
        return self._scatter(self._out(out), rows, batch)

    def step_row(
        self, row: int, ids: np.ndarray, last_only: bool = False, tree: Any = None
    ) -> StepOut:
        """ids [S] after row ``row``'s valid positions, alone at batch 1 (a prompt, a token
        tree through the graph's tree mask: ``tree`` = (depths [S], ancestor mask [S, S])).
        Returns logits [1, S or 1, V]; the row advances by S."""
        ids = np.asarray(ids, dtype=np.int64)
        s, n = int(ids.shape[0]), int(self.lengths[row])
        feeds: dict[str, np.ndarray] = {
            "input_ids": ids[None, :],
            "attention_mask": np.ones((1, n + s), dtype=np.int64),
        }
        feeds.update(zip(self.names, self._row(row)))
        if tree is not None and not self.has_tree:
            raise InputError(
                "token-tree verification needs an artifact exported with --tree-mask; "
                "re-export with `specport export MODEL --out DIR --tree-mask`."
            )
        feeds.update(row_position_feeds(n, s, tree, self.has_tree))
        out = self._run(feeds)
        self._apart[row] = out[1 : 1 + self.n_kv]  # [1, Hkv, n+S, D]
        self.lengths[row] = n + s
        result = self._out(out)
        if last_only:
            greedy = None if result.greedy is None else result.greedy[:, -1:]
            return StepOut(result.logits[:, -1:], greedy, result.outputs)
        return result

    def _run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        t0 = time.perf_counter()
        out = self.session.run(self.output_names, feeds)
        self.ort_seconds += time.perf_counter() - t0
        return list(out)

    def _out(self, out: list[np.ndarray]) -> StepOut:
        extra = dict(zip(self._extra, out[1 + self.n_kv :]))
        greedy = extra.pop(self._greedy) if self._greedy is not None else None
        return StepOut(out[0], greedy, extra)

    # ---- where each row's positions are ---------------------------------------------
    def _scatter(self, out: StepOut, rows: np.ndarray, batch: int) -> StepOut:
        """The live rows' results at their own row indices of [b, ...] (zeros elsewhere)."""

        def spread(a: np.ndarray) -> np.ndarray:
            full = np.zeros((batch, *a.shape[1:]), a.dtype)
            full[rows] = a
            return full

        greedy = None if out.greedy is None else spread(out.greedy)
        return StepOut(spread(out.logits), greedy, {k: spread(v) for k, v in out.outputs.items()})

    def _aligned(self, order: list[int], lengths: np.ndarray) -> bool:
        """Can these rows (the tensor's, in its order) run on it as it is? Each must end at
        W (or be empty) and none be held apart; the common padding must stay small."""
        if self._apart and any(r in self._apart for r in order):
            return False
        w = self.width
        ends = self._start[order] + lengths
        if not bool(((ends == w) | (lengths == 0)).all()):
            return False
        return w - int(lengths.max()) <= MAX_SLACK

    def _row(self, row: int) -> list[np.ndarray]:
        """Row ``row``'s valid positions, [1, Hkv, L, D] per tensor (views)."""
        n = int(self.lengths[row])
        if row in self._apart:
            return [p[:, :, :n] for p in self._apart[row]]
        i = self._slot.get(row)
        if i is None or n == 0:
            return self._zeros(1)
        a = int(self._start[row])
        return [p[i : i + 1, :, a : a + n] for p in self._past]

    def _zeros(self, batch: int, width: int = 0) -> list[np.ndarray]:
        return [np.zeros((batch, e.shape[1], width, e.shape[3]), e.dtype) for e in self._empty]

    def _rebuild(self, order: list[int], lengths: np.ndarray) -> None:
        """A tensor of exactly these rows, in this order, left-padded and right-aligned at
        W = the longest (rows held apart merged); rows it held that are not among them
        move apart (one copy each).

        When the rows are the tensor's own and all end at the same slot (rows that accepted
        as many drafts), the new tensor is one view of the old one; otherwise one copy per
        row and tensor."""
        keep = set(order)
        for r in self._slots:
            if r not in keep and self.lengths[r] > 0 and r not in self._apart:
                self._apart[r] = [np.array(p) for p in self._row(r)]
        w = int(lengths.max())
        if order == self._slots and not any(r in self._apart for r in order):
            ends = {int(e) for e, n in zip(self._start[order] + lengths, lengths) if n}
            if len(ends) == 1:
                end = ends.pop()
                self._past = [p[:, :, end - w : end] for p in self._past]
                self._start[order] -= end - w
                return
        past = self._zeros(len(order), w)
        for i, (r, n) in enumerate(zip(order, lengths.tolist())):
            if n:
                for dst, src in zip(past, self._row(r)):
                    dst[i, :, w - n :] = src[0]
            self._apart.pop(r, None)
        self._past = past
        self._slots = order
        self._slot = {r: i for i, r in enumerate(order)}
        self._start[order] = w - lengths

    # ---- lengths and positions ------------------------------------------------------
    def fits(self, batch: int, s: int) -> bool:
        """Every row of [0, batch) has room for ``s`` more positions."""
        return bool((self.lengths[:batch] + s <= self.max_length).all())

    def keep(self, row: int, positions: int) -> None:
        """Roll row ``row`` back to its first ``positions`` positions (no KV is copied here;
        the next batched step realigns the row)."""
        self.lengths[row] = min(int(self.lengths[row]), positions)

    def keep_positions(self, row: int, index: np.ndarray) -> None:
        """Keep exactly these positions of ``row``, in this order (a tree's accepted path):
        a gather of the row's positions, held apart until the next batched step."""
        index = np.asarray(index, dtype=np.int64)
        self._apart[row] = [np.take(p, index, axis=2) for p in self._row(row)]
        self.lengths[row] = index.shape[0]

    def copy_prefix(self, source: int, target: int, positions: int) -> None:
        """Copy the first ``positions`` positions of row ``source`` into row ``target``."""
        self._apart[target] = [np.array(p[:, :, :positions]) for p in self._row(source)]
        self.lengths[target] = positions

    def swap(self, a: int, b: int) -> None:
        """Exchange the valid positions (and lengths) of rows ``a`` and ``b``."""
        rows_a = [np.array(p) for p in self._row(a)]
        rows_b = [np.array(p) for p in self._row(b)]
        self._apart[a], self._apart[b] = rows_b, rows_a
        self.lengths[a], self.lengths[b] = self.lengths[b], self.lengths[a]

    def free(self, row: int) -> None:
        """Forget row ``row``."""
        self.lengths[row] = 0
        self._apart.pop(row, None)
