"""The concat I/O contract in code: feeds for a full-sequence pass with an empty KV cache.

Used by calibration (passes) and perplexity evaluation (runtime), which both run whole
documents through an artifact; it lives here so neither package imports the other.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from specport.core.errors import InputError

# Optional input of artifacts exported with --tree-mask: int64 [B, S, S], 1 = new token i may
# attend new token j. Plain runs feed `causal_tree_mask` (exporter/wrapper.py builds the mask).
TREE_MASK = "tree_mask"

# The target graph's output an EAGLE head reads (passes/eagle_features.py adds it; the runtime's
# proposer and the drafter's training read it): three layers' hidden states, [B, S, 3H].
EAGLE_FEATURES = "eagle_features"
# The EAGLE draft graph's attention lengths, named as the shared layout's: seqlens_k [B] int32
# (each row's KV length after the run - 1) and total_sequence_length [] int32 (the longest);
# fed, not derived from the past's shape, so the head's KV can be one buffer written in place
EAGLE_LENGTH_INPUTS = ("seqlens_k", "total_sequence_length")

# The widest token tree a run takes (--tree-width), and so the TopK width W of the MTP heads
# graph (exporter/mtp_heads_graph.py) that fills it: a run takes its first columns.
MAX_TREE_WIDTH = 16


def causal_tree_mask(batch: int, s: int) -> np.ndarray:  # [B, S, S] int64, lower-triangular
    """The tree_mask that makes a tree-mask artifact run plain causal attention.

    Small shapes (decode steps, which repeat them every token) come from a read-only cache.
    """
    if batch * s * s <= 4096:
        return _small_causal_tree_mask(batch, s)
    return np.ascontiguousarray(np.broadcast_to(np.tri(s, dtype=np.int64), (batch, s, s)))


def row_position_feeds(
    start: int, s: int, tree: tuple[Any, Any] | None, takes_tree: bool
) -> dict[str, np.ndarray]:
    """``position_ids`` (and ``tree_mask`` when the graph takes one) for one row's ``s`` new tokens
    after ``start`` cached positions: a token tree's (depths, ancestor mask), or plain causal.

    One builder for every concat-layout cache that feeds a row alone (callers refuse a tree on a
    graph without the mask first, with their own message)."""
    if tree is not None:
        depths, ancestors = tree
        return {
            "position_ids": (start + np.asarray(depths, dtype=np.int64))[None, :],
            TREE_MASK: np.asarray(ancestors, dtype=np.int64)[None],
        }
    feeds = {"position_ids": np.arange(start, start + s, dtype=np.int64)[None, :]}
    if takes_tree:
        feeds[TREE_MASK] = causal_tree_mask(1, s)
    return feeds


def with_causal_tree_mask(session: Any, feeds: dict[str, Any]) -> dict[str, Any]:
    """``feeds`` plus a causal tree_mask sized from input_ids [B, S] when ``session`` takes one.

    One line for any feed builder that may meet a --tree-mask artifact (no-op otherwise).
    """
    if any(i.name == TREE_MASK for i in session.get_inputs()):
        b, s = feeds["input_ids"].shape
        feeds[TREE_MASK] = causal_tree_mask(int(b), int(s))
    return feeds


@functools.lru_cache(maxsize=256)
def _small_causal_tree_mask(batch: int, s: int) -> np.ndarray:
    mask = np.ascontiguousarray(np.broadcast_to(np.tri(s, dtype=np.int64), (batch, s, s)))
    mask.flags.writeable = False
    return mask


_KV_DTYPES: dict[str, Any] = {"tensor(float16)": np.float16, "tensor(int8)": np.int8}


def prefill_feeds(session: Any, ids: np.ndarray) -> dict[str, np.ndarray]:
    """Feeds for one sequence ids [S], batch 1, past length 0 (concat KV layout)."""
    s = ids.shape[0]
    feeds: dict[str, np.ndarray] = {}
    for inp in session.get_inputs():
        if inp.name == "input_ids":
            feeds[inp.name] = ids[None, :]
        elif inp.name == "attention_mask":
            feeds[inp.name] = np.ones((1, s), dtype=np.int64)
        elif inp.name == "position_ids":
            feeds[inp.name] = np.arange(s, dtype=np.int64)[None, :]
        elif inp.name == TREE_MASK:
            feeds[inp.name] = causal_tree_mask(1, s)
        elif inp.name.startswith("past_key_values."):
            shape = inp.shape
            if len(shape) != 4 or not isinstance(shape[1], int) or not isinstance(shape[3], int):
                raise InputError(
                    f"cannot build an empty KV cache for input {inp.name} with shape {shape}"
                )
            dtype = _KV_DTYPES.get(inp.type, np.float32)  # int8: an int8 KV cache
            feeds[inp.name] = np.zeros((1, shape[1], 0, shape[3]), dtype=dtype)
        else:
            raise InputError(
                f"model input {inp.name!r} is not part of the concat artifact contract "
                "(export with the default --kv-layout concat)"
            )
    return feeds
