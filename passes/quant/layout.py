"""Calibration feeds for artifacts in the `shared` KV layout (passes/shared_kv.py).

Quantizing the shared artifact itself (rather than a concat twin lowered afterwards) keeps the
graph the fast runtime loop binds (packed QKV, folded rotary, selected logits) and quantizes
exactly the weights it runs. Calibration then runs the shared graph as a batch-1 prefill: the
KV buffers are as long as the sequence, `seqlens_k` = S - 1, `total_sequence_length` = S and,
when the graph selects logits, every position is kept (so the LM head sees every row too).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from specport.core.errors import InputError


def calibration_context(manifest: Any) -> int:
    """Longest calibration sequence: the model's context, capped by a shared artifact's KV
    buffer length (its rotary caches and `--max-length` stop there)."""
    context = int(manifest.config.get("context_length") or 512)
    if manifest.kv.layout == "shared" and manifest.kv.max_length:
        context = min(context, int(manifest.kv.max_length))
    return context


def shared_prefill_feeds(session: Any, ids: np.ndarray) -> dict[str, np.ndarray]:
    """Feeds for one sequence ids [S], batch 1, empty cache, shared KV layout."""
    s = ids.shape[0]
    feeds: dict[str, np.ndarray] = {}
    for inp in session.get_inputs():
        if inp.name == "input_ids":
            feeds[inp.name] = ids[None, :].astype(np.int64)
        elif inp.name == "position_ids":
            feeds[inp.name] = np.arange(s, dtype=np.int64)[None, :]
        elif inp.name == "seqlens_k":
            feeds[inp.name] = np.array([s - 1], dtype=np.int32)
        elif inp.name == "total_sequence_length":
            feeds[inp.name] = np.array(s, dtype=np.int32)
        elif inp.name == "tree_mask":  # a --tree-mask artifact: plain causal attention
            feeds[inp.name] = np.tri(s, dtype=np.int64)[None]
        elif inp.name == "logits_index":
            feeds[inp.name] = np.arange(s, dtype=np.int64)[None, :]
        elif inp.name.startswith("past_key_values."):
            shape = inp.shape
            if len(shape) != 4 or not isinstance(shape[1], int) or not isinstance(shape[3], int):
                raise InputError(f"cannot build a KV buffer for input {inp.name} with {shape}")
            dtype = (
                np.int8
                if "int8" in inp.type
                else np.float16
                if "float16" in inp.type
                else np.float32
            )
            feeds[inp.name] = np.zeros((1, shape[1], s, shape[3]), dtype=dtype)
        else:
            raise InputError(
                f"model input {inp.name!r} is not part of the shared-layout contract; "
                "quantize the concat export instead"
            )
    return feeds
