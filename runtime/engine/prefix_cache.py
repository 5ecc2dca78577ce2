"""Prefix caching over KV rows: a finished request's KV stays in a row until that row is needed.

Each row remembers the token ids whose KV it holds. A new request runs in the lowest free row
(so decode batches stay short: a request alone decodes at batch 1); its prompt's longest prefix
held by any free row is copied into that row (numpy, per layer: far cheaper than recomputing it)
and only the rest is prefilled (repeated system prompts, multi-turn chats whose next prompt
starts with the previous exchange). Before the row's own cached ids are overwritten they are
moved to an empty free row, or to the least recently used one, so a cache survives while rows
are free to hold it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


@dataclass(frozen=True)
class Plan:
    """Where a request runs and what to copy first.

    1. if `save_to` is set: copy row `row`'s cached positions there (they would be overwritten);
    2. if `source` != `row`: copy the first `reuse` positions of `source` into `row`;
    3. prefill `prompt[reuse:]` on top.
    """

    row: int
    source: int
    reuse: int
    save_to: int | None


class PrefixCache:
    """Token ids per row; the slots' `lengths` say how many of them still have valid KV.

    At least one prompt token is always left to prefill: its logits choose the first new token.
    """

    def __init__(self, rows: int, enabled: bool = True) -> None:
        self.ids: list[np.ndarray] = [np.zeros(0, dtype=np.int64) for _ in range(rows)]
        self.used = [0] * rows  # admission counter at the last use: least recently used first
        self.enabled = enabled
        self.clock = 0
        self.hits = 0
        self.lookups = 0
        self.saved_tokens = 0
        self.copied_tokens = 0

    def set(self, row: int, ids: Sequence[int] | np.ndarray) -> None:
        """Row `row` now holds (at most) the KV of `ids`, in order."""
        self.ids[row] = np.asarray(ids, dtype=np.int64)

    def swap(self, a: int, b: int) -> None:
        """Rows `a` and `b` exchanged their KV (see `SharedKVCache.swap`)."""
        self.ids[a], self.ids[b] = self.ids[b], self.ids[a]
        self.used[a], self.used[b] = self.used[b], self.used[a]

    def plan(
        self,
        prompt: np.ndarray,
        free: Sequence[int],
        lengths: np.ndarray,
        live: Mapping[int, np.ndarray] | None = None,
        max_save: int | None = None,
        committed: np.ndarray | None = None,
    ) -> Plan:
        """Place `prompt` in the lowest of the `free` rows (see `Plan`).

        `live` maps busy rows to the ids whose KV they hold: a row still generating can be the
        source of a copy too (its first positions do not change), which is how the `n` choices
        of one request, or requests arriving with the same long system prompt, share a prompt
        that another row has just prefilled.

        `max_save`: the most positions worth copying into memory not yet committed to keep
        the row's cached KV (None: any), `committed` the positions each row's pages already
        hold. The engine passes them while other rows decode, since the copy runs inside their
        gap: a 2,500-token prefix of SmolLM2 fp32 KV is 115 MB, ~58 ms into fresh pages (8-9x
        a 4-stream gap) and ~6 ms into committed ones. A row that takes the copy into committed
        pages is chosen where one can; where none can within `max_save`, the cache is dropped.
        (Putting the prompt in a free row that loses nothing instead keeps the cache but widens
        every decode step to that row: 26-40 ms against 7 at 5 live rows spread over 10-14. A
        prefix the prompt reuses is still copied: that saves its whole prefill.)"""
        self.lookups += 1
        self.clock += 1
        row = min(free)
        if not self.enabled:
            self.used[row] = self.clock
            return Plan(row, row, 0, None)
        held = {r: min(len(self.ids[r]), int(lengths[r])) for r in free}
        source, reuse = row, 0
        for r in sorted(free, key=lambda r: (r != row, r)):  # the row itself wins ties
            n = min(common_prefix(self.ids[r][: held[r]], prompt), len(prompt) - 1)
            if n > reuse:
                source, reuse = r, n
        for r, ids in (live or {}).items():
            n = min(common_prefix(ids[: int(lengths[r])], prompt), len(prompt) - 1)
            if n > reuse:
                source, reuse = r, n
        save_to: int | None = None
        if self._loses(row, prompt, free, held):
            others = [r for r in free if r not in (row, source)]
            empty = [r for r in others if held[r] == 0]
            older = [r for r in others if self.used[r] < self.used[row]]
            older.sort(key=self.used.__getitem__)
            targets = empty + older
            if max_save is not None:  # rows decode: only a copy that faults few fresh pages
                done = committed if committed is not None else np.zeros(len(self.ids), np.int64)
                targets = [r for r in targets if held[row] - int(done[r]) <= max_save]
                targets.sort(key=lambda r: (held[row] > int(done[r]), r not in empty))
            save_to = targets[0] if targets else None
        if reuse:
            self.hits += 1
            self.saved_tokens += reuse
            self.used[source] = self.clock
        if save_to is not None:
            self.copied_tokens += held[row]
            self.ids[save_to] = self.ids[row][: held[row]]
            self.used[save_to] = self.used[row]
        if source != row:
            self.copied_tokens += reuse
        self.used[row] = self.clock
        return Plan(row, source, reuse, save_to)

    def _loses(
        self, row: int, prompt: np.ndarray, free: Sequence[int], held: dict[int, int]
    ) -> bool:
        """Would placing `prompt` in `row` lose cached KV: ids the prompt does not rewrite
        identically, held by no other free row?"""
        mine = self.ids[row][: held[row]]
        return held[row] > common_prefix(mine, prompt) and not any(
            held[r] >= held[row] and common_prefix(self.ids[r], mine) == held[row]
            for r in free
            if r != row
        )

    def stats(self) -> dict[str, int]:
        return {
            "prefix_cache_lookups": self.lookups,
            "prefix_cache_hits": self.hits,
            "prefix_cache_saved_tokens": self.saved_tokens,
            "prefix_cache_copied_tokens": self.copied_tokens,
        }
