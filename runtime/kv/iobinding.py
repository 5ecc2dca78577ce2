"""Run a shared-KV graph through onnxruntime IO binding with buffers allocated once.

Per step the Python side writes B token ids, B sequence lengths and one scalar into arrays that
are already bound; onnxruntime writes K/V in place into the per-layer buffers, the last
position's logits [B, V] and the greedy token [B] into preallocated outputs. Nothing of size
O(layers x T) is allocated, concatenated or copied in Python.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from specport.artifact.manifest import Manifest
from specport.core.contract import TREE_MASK, causal_tree_mask
from specport.core.errors import ArtifactError, InputError
from specport.runtime.kv.layouts import SharedKV

logger = logging.getLogger(__name__)

# Prompt tokens per run when an int8 KV cache is prefilled (longer prompts than twice this are
# split): measured on SmolLM2-135M, 2 threads, 1,024 / 2,048-token prompts 1.4x / 1.6x faster
# than one run; at 512 tokens one run was faster.
INT8_CHUNK = 256


def runtime_io(manifest: Manifest) -> dict[str, Any]:
    """Names of the shared layout's extra inputs/outputs (defaults = the KVLayout contract)."""
    io = dict(manifest.extra.get("runtime", {}))
    io.setdefault("padding", "right")
    io.setdefault("seqlens_input", "seqlens_k")
    io.setdefault("total_length_input", "total_sequence_length")
    io.setdefault("logits_index_input", "logits_index")
    io.setdefault("next_token_output", "next_token")
    return io


class BoundSession:
    """One generation's worth of bound buffers for a batch of `batch` rows and KV length `max_length`.

    `prefill(ids [B, S], lengths [B])` and `decode(ids [B])` run one step and return
    (logits [B, V] view, greedy ids [B] view or None); both views are overwritten by the next step.
    """

    def __init__(
        self,
        session: Any,
        manifest: Manifest,
        batch: int,
        max_length: int,
        kv: SharedKV | None = None,
    ) -> None:
        """`kv` binds existing buffers (see SharedKV's `buffers`) instead of allocating new ones."""
        import onnxruntime as ort

        if manifest.kv.layout != "shared":
            raise ArtifactError("IO binding with in-place KV needs a `shared` KV layout artifact.")
        self.session = session
        self.io = runtime_io(manifest)
        self.kv = kv if kv is not None else SharedKV(manifest, batch, max_length)
        self.batch = batch
        self.ort_seconds = 0.0  # time inside onnxruntime since the last reset
        self.ort_cpu_seconds = 0.0  # the calling thread's CPU time inside it (intra-op threads: 1)
        self.input_names = {i.name for i in session.get_inputs()}
        self.output_names = [o.name for o in session.get_outputs()]
        for needed in (self.io["seqlens_input"], self.io["total_length_input"]):
            if needed not in self.input_names:
                raise ArtifactError(
                    f"shared-layout graph has no {needed!r} input; re-export the artifact."
                )
        self.binding = session.io_binding()
        self.kv.bind(self.binding)
        self._ov = ort.OrtValue.ortvalue_from_numpy
        self._values: dict[str, Any] = {}  # bound OrtValues must outlive the binding
        # Inputs that keep one shape for the whole generation: bound once, updated in place.
        self.seqlens = np.zeros(batch, dtype=np.int32)
        self.total = np.zeros((), dtype=np.int32)
        self.decode_ids = np.zeros((batch, 1), dtype=np.int64)
        self._bind_in("input_ids", self.decode_ids)  # decode() may come before any prefill
        self._bind_in(self.io["seqlens_input"], self.seqlens)
        self._bind_in(self.io["total_length_input"], self.total)
        self.logits_index = np.zeros((batch, 1), dtype=np.int64)
        self.has_index = self.io["logits_index_input"] in self.input_names
        if self.has_index:
            self._bind_in(self.io["logits_index_input"], self.logits_index)
        # Graphs that rotate outside the attention op (passes/shared_kv.py) take positions.
        self.has_positions = "position_ids" in self.input_names
        self.decode_pos = np.zeros((batch, 1), dtype=np.int64)
        if self.has_positions:
            self._bind_in("position_ids", self.decode_pos)
        # --tree-mask artifacts (passes/tree_bias.py): causal unless a step scores a tree
        self.has_tree = TREE_MASK in self.input_names
        self.decode_tree = np.ones((batch, 1, 1), dtype=np.int64)
        if self.has_tree:
            self._bind_in(TREE_MASK, self.decode_tree)
        vocab = manifest.vocab_size
        self.has_next = self.io["next_token_output"] in self.output_names
        self.logits = np.zeros((batch, 1, vocab), dtype=np.float32)
        self.next_token = np.zeros((batch, 1), dtype=np.int64)
        self._bind_out("logits", self.logits)
        if self.has_next:
            self._bind_out(self.io["next_token_output"], self.next_token)
        # Any other output (the MTP branch's accepted/bonus/drafts): preallocated [B, ...] and
        # bound once; onnxruntime computes every node whatever is fetched, so leaving them
        # unbound would save nothing. One per scored position ([B, S, fixed...], e.g. the LM
        # head's input a token tree's MTP heads start from) is bound per step like the logits.
        known = {"logits", self.io["next_token_output"], *self.kv.output_names}
        self.extra: dict[str, np.ndarray] = {}
        self.per_position: dict[str, np.ndarray] = {}  # name -> its [B, 1, ...] decode buffer
        for out in session.get_outputs():
            if out.name in known:
                continue
            dims = list(out.shape)[1:]
            dtype = _numpy_dtype(out.type)
            if dims and not isinstance(dims[0], int) and all(isinstance(d, int) for d in dims[1:]):
                self.per_position[out.name] = np.zeros((batch, 1, *dims[1:]), dtype=dtype)
                self.extra[out.name] = self.per_position[out.name]
            elif all(isinstance(d, int) for d in dims):
                self.extra[out.name] = np.zeros((batch, *dims), dtype=dtype)
            else:
                raise ArtifactError(
                    f"output {out.name!r} has shape {out.shape}; IO binding needs "
                    "[batch, fixed...] or [batch, positions, fixed...]"
                )
            self._bind_out(out.name, self.extra[out.name])
        self._wides: dict[tuple[int, int, int], _Wide] = {}  # multi-token step buffers by width
        self._bound_width: _Wide | None = None  # whose buffers are bound (None: one-token)

    def extra_outputs(self) -> dict[str, np.ndarray]:
        """The other outputs of the last run (views, overwritten by the next one)."""
        return self.extra

    def _decode_extras(self) -> None:
        """A one-token run writes the per-position outputs into their decode buffers."""
        for name, decode_buf in self.per_position.items():
            self.extra[name] = decode_buf

    def _bind_in(self, name: str, arr: np.ndarray) -> None:
        value = self._ov(arr)
        self._values[f"in:{name}"] = (value, arr)
        self.binding.bind_ortvalue_input(name, value)

    def _bind_out(self, name: str, arr: np.ndarray) -> None:
        value = self._ov(arr)
        self._values[f"out:{name}"] = (value, arr)
        self.binding.bind_ortvalue_output(name, value)

    def reset(self) -> None:
        """Empty the cache for a new generation (buffers are kept; stale slots get overwritten)."""
        self.kv.lengths[:] = 0
        self.ort_seconds = 0.0
        self.ort_cpu_seconds = 0.0

    def _run(self, binding: Any = None) -> tuple[np.ndarray, np.ndarray | None]:
        t0, c0 = time.perf_counter(), time.thread_time()
        self.session.run_with_iobinding(self.binding if binding is None else binding)
        self.ort_seconds += time.perf_counter() - t0
        self.ort_cpu_seconds += time.thread_time() - c0
        return self.logits[:, 0, :], (self.next_token[:, 0] if self.has_next else None)

    def prefill(self, ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """ids [B, S] right-padded, lengths [B] real tokens per row (cache must be empty)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        if self.kv.lengths.any():
            raise ArtifactError(
                "prefill on a non-empty KV state; use extend() for chunked prompts."
            )
        self._leave_wide()
        seqlens, total = self.kv.step_lengths(lengths)
        if total != ids.shape[1]:
            raise ArtifactError("prefill ids must be padded exactly to the longest prompt.")
        if (
            self.batch == 1
            and any(b.dtype == np.int8 for b in self.kv.buffers)
            and total > 2 * INT8_CHUNK
        ):
            return self._prefill_chunks(ids)
        self.seqlens[:] = seqlens
        self.total[...] = total
        self.logits_index[:, 0] = lengths - 1
        self._bind_in("input_ids", ids)
        if self.has_positions:  # right padding: every row starts at position 0
            self._bind_in(
                "position_ids", np.ascontiguousarray(np.broadcast_to(np.arange(total), ids.shape))
            )
        if self.has_tree:
            self._bind_in(TREE_MASK, causal_tree_mask(*ids.shape))
        if self.has_index:
            out = self._run()
            self._decode_extras()
        else:  # the graph returns logits for all S positions: pick each row's last real one
            full = np.zeros((self.batch, total, self.logits.shape[-1]), dtype=np.float32)
            self._bind_out("logits", full)
            for name, buf in self.per_position.items():
                self.extra[name] = np.zeros((self.batch, total, *buf.shape[2:]), buf.dtype)
                self._bind_out(name, self.extra[name])
            self._run()
            self._bind_out("logits", self.logits)
            for name, buf in self.per_position.items():
                self._bind_out(name, buf)
            self.logits[:, 0] = full[np.arange(self.batch), lengths - 1]
            out = (self.logits[:, 0, :], None)
        self.kv.advance(lengths)
        self._bind_decode_inputs()
        self.logits_index[:, 0] = 0
        return out

    def _prefill_chunks(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """A long batch-1 prompt on an int8 cache, INT8_CHUNK tokens per run. The int8 cache
        reads every position through the cache whatever the split, so the logits are those of
        one run; onnxruntime 1.32's CPU GroupQueryAttention attends over an int8 cache ~4x
        slower than over fp32 in one long run, and shorter runs roughly halve that (README)."""
        return self.continue_prompt(ids, chunk=INT8_CHUNK)

    def continue_prompt(
        self, ids: np.ndarray, chunk: int | None = None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The rest of a prompt, ids [B, S], after each row's cached positions (a prefix kept
        from an earlier call), ``chunk`` tokens per run; returns what `prefill` returns: the
        last token's logits [B, V] and the graph's greedy id [B] (None without it), in the
        decode buffers. An int8 cache takes INT8_CHUNK runs past 2 * INT8_CHUNK tokens (see
        `_prefill_chunks`)."""
        width = ids.shape[1]
        if chunk is None:
            int8 = any(b.dtype == np.int8 for b in self.kv.buffers)
            chunk = INT8_CHUNK if int8 and width > 2 * INT8_CHUNK else width
        for start in range(0, width, chunk):
            logits, next_ids = self.extend(ids[:, start : start + chunk], last_only=True)
        self.logits[:, 0] = logits[:, -1]
        if next_ids is not None:
            self.next_token[:, 0] = next_ids[:, -1]
        return self.logits[:, 0, :], (self.next_token[:, 0] if self.has_next else None)

    def _bind_decode_inputs(self) -> None:
        """The one-token inputs again, after a prefill bound its own."""
        self._bind_in("input_ids", self.decode_ids)
        if self.has_positions:
            self._bind_in("position_ids", self.decode_pos)
        if self.has_tree:
            self._bind_in(TREE_MASK, self.decode_tree)

    def extend(
        self,
        ids: np.ndarray,
        last_only: bool = False,
        tree: Any = None,
        last: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """ids [B, S] appended after each row's cache (e.g. draft tokens to verify).

        ``tree`` = (depths [S], ancestor mask [S, S]) scores a token tree instead of a chain
        (batch 1, a --tree-mask artifact): token i at position length + depths[i], attending
        the cache and the tokens its mask row allows.

        Returns logits [B, S, V] and greedy ids [B, S] for every position; with `last_only` (a
        chunk of a prompt) only the last position's are computed and returned ([B, 1, V],
        [B, 1]). ``last`` [B] (right-padded prompt chunks of several lengths): like
        `last_only`, each row scoring its own position ``last[b]``; every row still advances by
        S (the caller sets the lengths of rows it padded). Both are views of buffers bound for
        steps of this width, overwritten by the
        next step of the same width (use them before the next run, as every loop does). Undo
        rejected positions with `self.kv.rollback(n)`. onnxruntime's CPU GroupQueryAttention
        takes several new tokens on a non-empty cache only at batch 1.

        Each width's buffers have an IO binding of their own, made once (with the KV buffers
        and the shared inputs): binding an OrtValue costs ~10 us, and a step used to bind eight
        and restore seven (about 0.15 ms per step, more than the whole budget of a cheap
        model's step); rebinding one binding on each width change still cost five or more
        binds per switch, which a chain's drafts make almost every step. Switching widths, or
        back to ``decode``, now binds nothing.
        """
        ids = np.asarray(ids, dtype=np.int64)
        batch, s = ids.shape
        if batch == 1 and tree is None and not last_only and last is None:
            return self._verify_one(ids, s)
        if tree is not None and (not self.has_tree or batch != 1):
            raise InputError(
                "token-tree verification needs batch 1 and an artifact exported with "
                "--tree-mask; re-export with `specport export MODEL --out DIR --tree-mask`."
            )
        seqlens, total = self.kv.step_lengths(s)
        self.seqlens[:] = seqlens
        self.total[...] = total
        kept = 1 if (last_only or last is not None) and self.has_index else s
        wide = self._wide_buffers(batch, s, kept)
        wide.ids[...] = ids
        if kept == 1 and self.has_index:  # bound once per width: each call says its own
            wide.index[:, 0] = s - 1 if last is None else last
        if tree is not None:
            depths, mask = tree
            offsets = np.asarray(depths, dtype=np.int64)
            wide.tree[0] = mask
            wide.causal = False
        else:
            offsets = wide.arange
            if self.has_tree and not wide.causal:
                wide.tree[...] = causal_tree_mask(batch, s)
                wide.causal = True
        if self.has_positions:
            np.add(self.kv.lengths[:, None], offsets[None, :], out=wide.positions)
        if self._bound_width is not wide:
            self.extra.update(wide.extra)
            self._bound_width = wide
        self._run(wide.binding)
        self.kv.advance(s)
        logits, next_token = wide.logits, wide.next_token
        if last is not None and kept != 1:  # the graph scored every position: each row's own
            rows = np.arange(batch)
            logits, next_token = logits[rows, last][:, None], next_token[rows, last][:, None]
        elif last_only and kept != 1:  # the graph scored every position: keep the last
            logits, next_token = logits[:, -1:], next_token[:, -1:]
        return logits, (next_token if self.has_next else None)

    def _verify_one(self, ids: np.ndarray, s: int) -> tuple[np.ndarray, np.ndarray | None]:
        """``extend`` of one row's chain (a batch-1 verify step): the lengths written as
        scalars, as ``_decode_one`` does."""
        length = int(self.kv.lengths[0])
        if length + s > self.kv.max_length:
            self.kv.step_lengths(s)  # raises the context error with its message
        self.seqlens[0] = length + s - 1
        self.total[()] = length + s
        wide = self._wide_buffers(1, s, s)
        wide.ids[...] = ids
        if s == 1 and self.has_index:  # shared with a one-token prompt chunk's buffers
            wide.index[0, 0] = 0
        if self.has_tree and not wide.causal:
            wide.tree[...] = causal_tree_mask(1, s)
            wide.causal = True
        if self.has_positions:
            np.add(wide.arange, length, out=wide.positions[0])
        if self._bound_width is not wide:
            self.extra.update(wide.extra)
            self._bound_width = wide
        self._run(wide.binding)
        self.kv.lengths[0] = length + s
        return wide.logits, (wide.next_token if self.has_next else None)

    def _wide_buffers(self, batch: int, s: int, kept: int) -> _Wide:
        """The bound buffers of steps of ``s`` tokens (``kept`` scored) per row, made once."""
        key = (batch, s, kept)
        wide = self._wides.get(key)
        if wide is None:
            if len(self._wides) >= MAX_WIDTHS:  # e.g. prompt chunks of many lengths
                old = next(iter(self._wides))
                if self._bound_width is self._wides[old]:
                    self._leave_wide()
                self._wides.pop(old)
            wide = _Wide(self, batch, s, kept)
            self._wides[key] = wide
        return wide

    def _leave_wide(self) -> None:
        """Back to the one-token buffers after steps of several tokens: each width runs its own
        binding, so only the per-position outputs' views change."""
        if self._bound_width is not None:
            self._decode_extras()
            self._bound_width = None

    def _shared_values(self) -> list[tuple[str, str, Any]]:
        """(in/out, name, OrtValue) of what every width's binding shares with the one-token
        binding: the lengths inputs and the fixed-shape outputs (an MTP branch's verdict)."""
        shared = [f"in:{self.io['seqlens_input']}", f"in:{self.io['total_length_input']}"]
        shared += [f"out:{n}" for n in self.extra if n not in self.per_position]
        return [
            (key[: key.index(":")], key[key.index(":") + 1 :], self._values[key][0])
            for key in shared
        ]

    def decode(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """ids [B]: one new token per row (finished rows may pass anything)."""
        lengths = self.kv.lengths
        if self.batch == 1:  # a row's own view: its inputs as scalars, no ufunc per step
            return self._decode_one(int(ids[0]), int(lengths[0]))
        total = int(lengths.max()) + 1
        if total > self.kv.max_length:
            self.kv.step_lengths(1)  # raises the context error with its message
        self._leave_wide()
        self.decode_ids[:, 0] = ids
        self.decode_pos[:, 0] = lengths
        np.copyto(self.seqlens, lengths, casting="unsafe")  # seqlens_k = length after - 1
        self.total[...] = total
        out = self._run()
        self._decode_extras()
        self.kv.advance(1)
        return out

    def _decode_one(self, token: int, length: int) -> tuple[np.ndarray, np.ndarray | None]:
        """``decode`` at batch 1 (every batch-1 step): the same inputs written as scalars.
        Between runs each numpy call is slow (caches cold from the weight stream), and a
        reduction or a ``copyto`` costs more there than an item assignment."""
        if length + 1 > self.kv.max_length:
            self.kv.step_lengths(1)  # raises the context error with its message
        self._leave_wide()
        self.decode_ids[0, 0] = token
        self.decode_pos[0, 0] = length
        self.seqlens[0] = length  # seqlens_k = length after - 1
        self.total[()] = length + 1
        out = self._run()
        self._decode_extras()
        self.kv.lengths[0] = length + 1
        return out


def _numpy_dtype(ort_type: str) -> Any:
    """numpy dtype of an onnxruntime type string such as 'tensor(float16)'."""
    return {"tensor(int64)": np.int64, "tensor(float16)": np.float16}.get(ort_type, np.float32)


MAX_WIDTHS = 8  # multi-token step widths whose bound buffers a session keeps


class _Wide:
    """The bound buffers of one multi-token step width: [B, S] inputs, [B, kept, ...] outputs.

    Written in place each step; the OrtValues wrapping them are made once (and kept alive here
    while the binding refers to them)."""

    def __init__(self, bound: BoundSession, batch: int, s: int, kept: int) -> None:
        ov = bound._ov
        self.ids = np.zeros((batch, s), dtype=np.int64)
        self.arange = np.arange(s, dtype=np.int64)
        self.positions = np.zeros((batch, s), dtype=np.int64)
        self.tree = causal_tree_mask(batch, s).astype(np.int64, copy=True)
        self.causal = True
        self.logits = np.zeros((batch, kept, bound.logits.shape[-1]), dtype=np.float32)
        self.next_token = np.zeros((batch, kept), dtype=np.int64)
        index = np.broadcast_to(np.arange(s - kept, s, dtype=np.int64), (batch, kept))
        self.index = np.array(index)  # a writable copy: extend() writes each row's position
        io = bound.io
        ins: dict[str, np.ndarray] = {"input_ids": self.ids}
        if bound.has_positions:
            ins["position_ids"] = self.positions
        if bound.has_tree:
            ins[TREE_MASK] = self.tree
        if bound.has_index:
            ins[io["logits_index_input"]] = self.index
        outs: dict[str, np.ndarray] = {"logits": self.logits}
        if bound.has_next:
            outs[io["next_token_output"]] = self.next_token
        self.extra = {
            name: np.zeros((batch, kept, *buf.shape[2:]), buf.dtype)
            for name, buf in bound.per_position.items()
        }
        outs.update(self.extra)
        self.inputs = {name: (ov(arr), arr) for name, arr in ins.items()}
        self.outputs = {name: (ov(arr), arr) for name, arr in outs.items()}
        # A binding of its own (the KV buffers, the shared inputs and outputs, these), made
        # once: switching widths then rebinds nothing (about 10 us per OrtValue bound, five or
        # more per switch, where a chain's width changes with its drafts almost every step).
        self.binding = bound.session.io_binding()
        bound.kv.bind(self.binding)
        for kind, name, value in bound._shared_values():
            if kind == "in":
                self.binding.bind_ortvalue_input(name, value)
            else:
                self.binding.bind_ortvalue_output(name, value)
        for name, (value, _) in self.inputs.items():
            self.binding.bind_ortvalue_input(name, value)
        for name, (value, _) in self.outputs.items():
            self.binding.bind_ortvalue_output(name, value)
