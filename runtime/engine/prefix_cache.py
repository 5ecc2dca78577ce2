"""Prefix caching over KV rows: a finished request's KV stays in its row until the row is reused.

Each row remembers the token ids whose KV it holds. A new request goes to the free row whose
ids share the longest prefix with its prompt, and only the rest of the prompt is prefilled on
top (repeated system prompts, multi-turn chats whose next prompt starts with the previous
exchange). No KV is copied: the row is simply reused with its length cut to the shared prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class PrefixCache:
    """Token ids per row; `lengths` (the slots' valid positions) says how many are still valid.

    At least one prompt token is always left to prefill: its logits choose the first new token.
    """

    def __init__(self, rows: int, enabled: bool = True) -> None:
        self.ids: list[np.ndarray] = [np.zeros(0, dtype=np.int64) for _ in range(rows)]
        self.enabled = enabled
        self.hits = 0
        self.lookups = 0
        self.saved_tokens = 0

    def set(self, row: int, ids: Sequence[int] | np.ndarray) -> None:
        """Row `row` now holds (at most) the KV of `ids`, in order."""
        self.ids[row] = np.asarray(ids, dtype=np.int64)

    def choose(
        self, prompt: np.ndarray, free: Sequence[int], lengths: np.ndarray
    ) -> tuple[int, int]:
        """(row, reusable prefix length) for `prompt` among the `free` rows.

        Longest shared prefix wins (ties: lowest row, so decode batches stay short). Without a
        hit the lowest row holding nothing is taken, else the lowest free row.
        """
        self.lookups += 1
        best_row, best = -1, 0
        if self.enabled:
            for row in free:
                valid = self.ids[row][: int(lengths[row])]
                n = min(common_prefix(valid, prompt), len(prompt) - 1)
                if n > best:
                    best_row, best = row, n
        if best_row >= 0:
            self.hits += 1
            self.saved_tokens += best
            return best_row, best
        empty = [r for r in free if int(lengths[r]) == 0 or len(self.ids[r]) == 0]
        return (empty or list(free))[0], 0

    def stats(self) -> dict[str, int]:
        return {
            "prefix_cache_lookups": self.lookups,
            "prefix_cache_hits": self.hits,
            "prefix_cache_saved_tokens": self.saved_tokens,
        }
