"""The shared layout's KV buffers (`SharedKV`) and the checks every KV allocation shares.

`shared`: one preallocated buffer [B, Hkv, T, Dh] per layer, bound as both past and present, so
the fused attention writes the new positions in place (`kv.iobinding.BoundSession`). The state
is then just the per-row lengths; `rollback(n)` (rejected draft tokens) only moves lengths back:
the stale slots are overwritten by the next step. The `concat` layout's tensors live in
`kv.concat_cache.ConcatKVCache`, the one cache over that layout.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from specport.artifact.manifest import KVLayout, Manifest
from specport.core.errors import ArtifactError, ContextLengthError
from specport.runtime.kv.memory import KVBuffer

logger = logging.getLogger(__name__)


# onnxruntime's input type -> numpy's name (what KVLayout.dtype holds)
_ORT_TYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(bfloat16)": "bfloat16",
    "tensor(int8)": "int8",
}


def check_runtime_dtype(manifest: Manifest, where: Any = "the artifact") -> None:
    """Refuse an artifact whose cache this runtime cannot feed (before a session is made)."""
    if "bfloat16" in (manifest.dtype, manifest.kv.dtype):
        raise ArtifactError(
            f"{where} is a bfloat16 artifact (exported for CUDA): specport's runtime feeds numpy "
            "arrays, which have no bfloat16, and onnxruntime's CPU provider has no bfloat16 "
            "MatMul; re-export with --dtype fp16 (CUDA or CPU) or fp32."
        )


def align_kv_dtype(session: Any, manifest: Manifest) -> str:
    """Set `manifest.kv.dtype` to the type the graph's first past input takes; return it.

    The graph is the truth: every KV allocation (concat pasts, shared buffers, engine slots,
    drafts) reads `manifest.kv.dtype`, so a graph changed after export (e.g. an older manifest
    without the field, or a tool converting the model) still gets buffers it accepts.
    """
    first = manifest.kv.inputs[0][0] if manifest.kv.inputs else None
    graph = _ORT_TYPES.get(next((i.type for i in session.get_inputs() if i.name == first), ""))
    if graph is not None and graph != manifest.kv.dtype:
        logger.warning(
            "the graph's KV inputs are %s, the manifest says %s: using %s",
            graph,
            manifest.kv.dtype,
            graph,
        )
        manifest.kv.dtype = graph
    return manifest.kv.dtype


class SharedKV:
    """Preallocated per-layer buffers [B, Hkv, T, D] plus per-row lengths (tokens in cache).

    The buffers are numpy arrays wrapped (not copied) as OrtValues, so `bind(binding)` makes
    onnxruntime read past and write present in the same memory. `lengths[b]` counts row b's
    valid slots; the graph derives slot positions from `seqlens_k = lengths_after_step - 1`.
    """

    def __init__(
        self,
        manifest: Manifest | KVLayout,
        batch: int,
        max_length: int,
        buffers: list[np.ndarray] | None = None,
        small_pages: bool = False,
    ) -> None:
        """`buffers` wraps existing arrays (e.g. row views of a larger batch's buffers, so a
        request engine can prefill one row in place) instead of allocating new ones.
        `small_pages`: allocate on 4 KiB pages, committed as positions are written, instead of
        2 MiB pages (`kv.memory`). A bare `KVLayout` (a graph that is not the artifact's
        target, e.g. the EAGLE head's one layer) is limited by its own `max_length`."""
        if isinstance(manifest, KVLayout):
            kv, limit = manifest, manifest.max_length or max_length
        else:
            kv = manifest.kv
            limit = kv.max_length or manifest.context_length
        if max_length > limit:
            raise ContextLengthError(
                f"a KV buffer of {max_length} positions exceeds the artifact's limit of {limit}; "
                "shorten the prompt or --max-new-tokens."
            )
        self.batch, self.max_length = batch, max_length
        self.input_names = [n for pair in kv.inputs for n in pair]
        self.output_names = [n for pair in kv.outputs for n in pair]
        self.buffers: list[np.ndarray] = []
        self.memory: list[KVBuffer] = []  # what this object allocated (none for given buffers)
        # Each layer in its own dtype: an int8 cache may keep some layers float32.
        for heads, kd, vd, name in zip(kv.num_heads, kv.key_dim, kv.value_dim, kv.dtypes()):
            dtype = np.dtype(name)
            for dim in (kd, vd):
                shape = (batch, heads, max_length, dim)
                if buffers is None:
                    self.memory.append(KVBuffer.allocate(shape, dtype, small_pages))
                    self.buffers.append(self.memory[-1].array)
                    continue
                given = buffers[len(self.buffers)]
                if given.shape != shape or given.dtype != dtype or not given.flags.c_contiguous:
                    raise ArtifactError(
                        f"KV buffer {len(self.buffers)} must be a C-contiguous {dtype} array "
                        f"of shape {shape}, got {given.dtype} {given.shape}."
                    )
                self.buffers.append(given)
        self.lengths = np.zeros(batch, dtype=np.int64)
        self._ortvalues: list[Any] = []

    # -- binding ---------------------------------------------------------------------
    def bind(self, binding: Any) -> None:
        """Bind every buffer as input past and output present (same OrtValue, written in place)."""
        import onnxruntime as ort

        if not self._ortvalues:
            self._ortvalues = [ort.OrtValue.ortvalue_from_numpy(b) for b in self.buffers]
        for name_in, name_out, value in zip(self.input_names, self.output_names, self._ortvalues):
            binding.bind_ortvalue_input(name_in, value)
            binding.bind_ortvalue_output(name_out, value)

    # -- lengths ---------------------------------------------------------------------
    def step_lengths(self, new_tokens: np.ndarray | int) -> tuple[np.ndarray, int]:
        """(seqlens_k int32 [B], total_sequence_length) for a step adding `new_tokens` per row."""
        after = self.lengths + new_tokens
        if int(after.max()) > self.max_length:
            raise ContextLengthError(
                f"KV buffer full ({self.max_length} positions); generation ran past its budget."
            )
        return (after - 1).astype(np.int32), int(after.max())

    def advance(self, new_tokens: np.ndarray | int) -> None:
        self.lengths += new_tokens  # in place: no array per step

    def rollback(self, n: np.ndarray | int) -> None:
        """Forget the last `n` positions per row (e.g. rejected draft tokens); data is overwritten later."""
        self.lengths = np.maximum(self.lengths - n, 0)
