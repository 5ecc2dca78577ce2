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

from specport.artifact import Manifest
from specport.contract import TREE_MASK, causal_tree_mask
from specport.errors import ArtifactError, InputError
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

    def _run(self) -> tuple[np.ndarray, np.ndarray | None]:
        t0 = time.perf_counter()
        self.session.run_with_iobinding(self.binding)
        self.ort_seconds += time.perf_counter() - t0
        return self.logits[:, 0, :], (self.next_token[:, 0] if self.has_next else None)

    def prefill(self, ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """ids [B, S] right-padded, lengths [B] real tokens per row (cache must be empty)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        if self.kv.lengths.any():
            raise ArtifactError(
                "prefill on a non-empty KV state; use extend() for chunked prompts."
            )
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
        for start in range(0, ids.shape[1], INT8_CHUNK):
            logits, next_ids = self.extend(ids[:, start : start + INT8_CHUNK], last_only=True)
        self.logits[:, 0] = logits[:, -1]
        if next_ids is not None:
            self.next_token[:, 0] = next_ids[:, -1]
        return self.logits[:, 0, :], (self.next_token[:, 0] if self.has_next else None)

    def _bind_decode_inputs(self) -> None:
        """Back to the one-token decode binding after a step of several tokens."""
        self._bind_in("input_ids", self.decode_ids)
        if self.has_positions:
            self._bind_in("position_ids", self.decode_pos)
        if self.has_tree:
            self._bind_in(TREE_MASK, self.decode_tree)

    def extend(
        self, ids: np.ndarray, last_only: bool = False, tree: Any = None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """ids [B, S] appended after each row's cache (e.g. draft tokens to verify).

        ``tree`` = (depths [S], ancestor mask [S, S]) scores a token tree instead of a chain
        (batch 1, a --tree-mask artifact): token i at position length + depths[i], attending
        the cache and the tokens its mask row allows.

        Returns logits [B, S, V] and greedy ids [B, S] for every position (fresh arrays, bound
        for this call only); with `last_only` (a chunk of a prompt) only the last position's
        are computed and returned ([B, 1, V], [B, 1]). Undo rejected positions with
        `self.kv.rollback(n)`. onnxruntime's CPU GroupQueryAttention takes several new tokens
        on a non-empty cache only at batch 1.
        """
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        batch, s = ids.shape
        seqlens, total = self.kv.step_lengths(s)
        self.seqlens[:] = seqlens
        self.total[...] = total
        kept = 1 if last_only and self.has_index else s
        index = np.ascontiguousarray(
            np.broadcast_to(np.arange(s - kept, s, dtype=np.int64), (batch, kept))
        )
        logits = np.zeros((batch, kept, self.logits.shape[-1]), dtype=np.float32)
        next_token = np.zeros((batch, kept), dtype=np.int64)
        self._bind_in("input_ids", ids)
        if tree is not None:
            if not self.has_tree or batch != 1:
                raise InputError(
                    "token-tree verification needs batch 1 and an artifact exported with "
                    "--tree-mask; re-export with `specport export MODEL --out DIR --tree-mask`."
                )
            depths, mask = tree
            offsets = np.asarray(depths, dtype=np.int64)
            self._bind_in(TREE_MASK, np.ascontiguousarray(np.asarray(mask, dtype=np.int64)[None]))
        else:
            offsets = np.arange(s, dtype=np.int64)
            if self.has_tree:
                self._bind_in(TREE_MASK, causal_tree_mask(batch, s))
        if self.has_positions:
            self._bind_in("position_ids", self.kv.lengths[:, None] + offsets[None, :])
        if self.has_index:
            self._bind_in(self.io["logits_index_input"], index)
        self._bind_out("logits", logits)
        if self.has_next:
            self._bind_out(self.io["next_token_output"], next_token)
        for name, decode_buf in self.per_position.items():
            self.extra[name] = np.zeros((batch, kept, *decode_buf.shape[2:]), decode_buf.dtype)
            self._bind_out(name, self.extra[name])
        try:
            self._run()
        finally:  # back to the one-token decode binding
            self._bind_decode_inputs()
            if self.has_index:
                self._bind_in(self.io["logits_index_input"], self.logits_index)
            self._bind_out("logits", self.logits)
            if self.has_next:
                self._bind_out(self.io["next_token_output"], self.next_token)
            for name, decode_buf in self.per_position.items():
                self._bind_out(name, decode_buf)
        self.kv.advance(s)
        if last_only and kept != 1:  # the graph scored every position: keep the last
            logits, next_token = logits[:, -1:], next_token[:, -1:]
        return logits, (next_token if self.has_next else None)

    def decode(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """ids [B]: one new token per row (finished rows may pass anything)."""
        lengths = self.kv.lengths
        total = int(lengths.max()) + 1
        if total > self.kv.max_length:
            self.kv.step_lengths(1)  # raises the context error with its message
        self.decode_ids[:, 0] = ids
        self.decode_pos[:, 0] = lengths
        np.copyto(self.seqlens, lengths, casting="unsafe")  # seqlens_k = length after - 1
        self.total[...] = total
        out = self._run()
        self._decode_extras()
        self.kv.advance(1)
        return out


def _numpy_dtype(ort_type: str) -> Any:
    """numpy dtype of an onnxruntime type string such as 'tensor(float16)'."""
    return {"tensor(int64)": np.int64, "tensor(float16)": np.float16}.get(ort_type, np.float32)
