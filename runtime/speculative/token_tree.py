"""The token tree of tree speculative decoding, and its n-gram candidates: pure numpy.

`TokenTree` is the trie of candidate continuations under the last emitted token, flattened
into the run order, depths and ancestor mask the ``--tree-mask`` graph takes;
`ngram_candidates` finds the continuations of earlier occurrences of the context's suffix. Kept
apart from `tree` (the generate loop and verification): they are plain data structures that
tests and the exporter's tree-mask checks use without a session.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specport.core.errors import InputError
from specport.runtime.speculative.ngram import suffix_match_ends


class TokenTree:
    """A trie of candidate continuations under a root token (node 0), capped at ``max_nodes``.

    Nodes are numbered in insertion order, so a parent always precedes its children (the
    flattened order is a valid run order and the ancestor mask is lower-triangular).
    """

    def __init__(self, root: int, max_nodes: int) -> None:
        if max_nodes < 1:
            raise InputError(f"a token tree needs room for its root, got max_nodes={max_nodes}")
        self.max_nodes = int(max_nodes)
        self.tokens: list[int] = [int(root)]
        self.parents: list[int] = [-1]
        self.depths: list[int] = [0]
        self.children: list[dict[int, int]] = [{}]  # per node: token -> child node

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def add(self, path: Sequence[int]) -> int:
        """Insert ``path`` below the root (shared prefixes merge); returns the nodes added.

        Stops early when the tree is full: a candidate is kept as far as it fits.
        """
        node, added = 0, 0
        for tok in path:
            tok = int(tok)
            child = self.children[node].get(tok)
            if child is None:
                if len(self.tokens) >= self.max_nodes:
                    break
                child = len(self.tokens)
                self.tokens.append(tok)
                self.parents.append(node)
                self.depths.append(self.depths[node] + 1)
                self.children.append({})
                self.children[node][tok] = child
                added += 1
            node = child
        return added

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to ``node`` (inclusive)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def flatten(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens [N] int64, depths [N] int64, ancestor mask [N, N] int64).

        mask[i, j] == 1 iff node j is node i or one of its ancestors: what the graph's
        ``tree_mask`` input takes; position ids are ``P + depths``.
        """
        n = len(self.tokens)
        mask = np.zeros((n, n), dtype=np.int64)
        for i, parent in enumerate(self.parents):
            if parent >= 0:
                mask[i] = mask[parent]
            mask[i, i] = 1
        return (
            np.asarray(self.tokens, dtype=np.int64),
            np.asarray(self.depths, dtype=np.int64),
            mask,
        )


def beam_step(
    paths: list[list[int]],  # the beam's n paths so far
    scores: np.ndarray,  # [n] their cumulative log-probabilities
    ids: np.ndarray,  # [n, k] each path's candidate next tokens
    logp: np.ndarray,  # [n, k] their log-probabilities
    width: int,
    min_logp: float,
) -> tuple[np.ndarray, list[list[int]], np.ndarray] | None:
    """One depth of a token-tree beam (MTP heads, an EAGLE head): the ``width`` best
    extensions of ``paths`` by cumulative log-probability, those below ``min_logp`` dropped.
    Returns (the kept extensions' parent rows, their paths, their scores), best first, or
    None when none is left (the tree stops at this depth)."""
    total = scores[:, None] + logp  # [n, k]
    best = np.argsort(-total, axis=None, kind="stable")[:width]
    best = best[total.ravel()[best] >= min_logp]
    if best.size == 0:
        return None
    rows, cols = np.unravel_index(best, total.shape)
    kept = [[*paths[r], int(ids[r, c])] for r, c in zip(rows.tolist(), cols.tolist())]
    return rows, kept, total[rows, cols]


def ngram_candidates(
    tokens: Sequence[int] | np.ndarray,  # [L] the context so far
    length: int,
    max_candidates: int,
    min_n: int = 1,
    max_n: int = 4,
    max_scan: int = 64,
) -> list[list[int]]:
    """Up to ``max_candidates`` distinct continuations (each ``length`` tokens) of earlier
    occurrences of the context's suffix: longest n first, most recent match first within n.

    A copy that runs into the end of the context continues with the match's period, as the
    chain n-gram proposer does, so a loop still yields full-length candidates. At most
    ``max_scan`` matches per n are looked at (a long repetitive context has thousands).
    """
    arr = np.asarray(tokens, dtype=np.int64)
    total = arr.shape[0]
    if length < 1 or max_candidates < 1 or total < min_n + 1:
        return []
    hits_by_n = suffix_match_ends(arr, max_n)
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for n in range(len(hits_by_n), min_n - 1, -1):
        # ends matched by a longer n were visited already (every longer match is one here too)
        longer = set(hits_by_n[n].tolist()) if n < len(hits_by_n) else set()
        for end in hits_by_n[n - 1][::-1][:max_scan].tolist():
            if end in longer:
                continue
            draft: list[int] = []
            for j in range(length):
                src = end + 1 + j
                draft.append(int(arr[src]) if src < total else draft[src - total])
            key = tuple(draft)
            if key not in seen:
                seen.add(key)
                out.append(draft)
                if len(out) >= max_candidates:
                    return out
    return out
