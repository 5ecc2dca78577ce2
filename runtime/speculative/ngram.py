"""Prompt-lookup (n-gram) drafting: copy what followed the last time this suffix appeared.

Free to run (no model) and strong whenever the output repeats the prompt or itself: code
edits, summaries, retrieval answers, and a small model's loops. The draft is deterministic, so
it carries no probabilities (``Drafts.probs is None``) and the verifier treats it as one-hot.

A proposer drafts for one growing context (the loops append each step's tokens to the same
list), so it keeps a dict from every n-gram (n <= max_n) to where it last ended
(``SuffixLookup``): a step indexes only the tokens added since the last one and looks up the
context's final n-grams, a few dict operations instead of vectorised passes over the whole
context (the proposer runs between target runs, where host work is slow: caches are cold from
the weight stream). A context it has not seen twice (a caller building a new list per call) is
searched with ``find_suffix_match``, O(L * max_n) vectorised numpy, which gives the same match.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from specport.core.errors import InputError
from specport.runtime.speculative.base import RowProposer

logger = logging.getLogger(__name__)


class NgramProposer(RowProposer):
    """Drafts the continuation of the most recent earlier match of the longest suffix n-gram.

    The match is searched with n from ``max_n`` down to ``min_n``; the first n that matches
    anywhere wins and, among its matches, the most recent one. If the copied span runs into
    the end of the context, the copy continues into the draft itself (the text is assumed to
    keep repeating with the same period), so a loop of period 1 still drafts ``max_draft``.
    """

    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4, max_draft: int = 5) -> None:
        if not (1 <= min_n <= max_n):
            raise InputError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        if max_draft < 1:
            raise InputError(f"max_draft must be >= 1, got {max_draft}")
        self.min_n = min_n
        self.max_n = max_n
        self.max_draft = max_draft
        self.lookup = SuffixLookup(max_n)

    def start(
        self, sampling: Any = None, stream: int | None = None, budget: int | None = None
    ) -> None:
        self.lookup = SuffixLookup(self.max_n)

    def propose_one(self, tokens: list[int] | np.ndarray, num_draft: int) -> list[int]:
        """Draft for one sequence."""
        match = self.lookup.find(tokens, self.min_n)
        if match is None:
            return []
        return copy_after(tokens, match[0], num_draft)


class SuffixLookup:
    """``find_suffix_match`` for a context that grows by appending: every n-gram (n <= max_n)
    mapped to the last position it ended at, kept up to date from the tokens appended since
    the previous call. Built on the second call with the same list (a list seen once, or any
    other sequence, is searched by ``find_suffix_match``); a list whose indexed tokens changed
    (a copy of them is kept and compared, one C-level list comparison) is indexed again. Either
    way the match is ``find_suffix_match``'s."""

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self.seen: Any = None  # the list indexed (or seen once)
        self.indexed: list[int] | None = None  # the tokens whose ends are in ``last``
        self.last: dict[tuple[int, ...], int] = {}

    def find(self, tokens: Sequence[int] | np.ndarray, min_n: int) -> tuple[int, int] | None:
        if not isinstance(tokens, list) or tokens is not self.seen:
            if isinstance(tokens, list):
                self.seen, self.indexed, self.last = tokens, None, {}
            return find_suffix_match(np.asarray(tokens, dtype=np.int64), min_n, self.max_n)
        length, top = len(tokens), self.max_n
        indexed, last = self.indexed, self.last
        if indexed is None or tokens[: len(indexed)] != indexed:  # new, or edited in place
            indexed, last = [], {}
            self.indexed, self.last = indexed, last
        for end in range(len(indexed), length - 1):  # each new end position, every n that fits
            for n in range(1, min(top, end + 1) + 1):
                last[tuple(tokens[end - n + 1 : end + 1])] = end
        indexed.extend(tokens[len(indexed) : length - 1])
        for n in range(min(top, length - 1), min_n - 1, -1):
            found = last.get(tuple(tokens[length - n :]))
            if found is not None:
                return found, n
        return None


def copy_after(tokens: Sequence[int] | np.ndarray, end: int, num_draft: int) -> list[int]:
    """The ``num_draft`` tokens that followed position ``end`` of ``tokens``. Token j continues
    at source position end+1+j; positions past the context map back into the draft with the
    match's period, so a loop keeps repeating."""
    length = len(tokens)
    draft: list[int] = []
    for j in range(num_draft):
        src = end + 1 + j
        draft.append(int(tokens[src]) if src < length else draft[src - length])
    return draft


def suffix_match_ends(tokens: np.ndarray, max_n: int) -> list[np.ndarray]:
    """Entry n-1: every position ``end < L-1`` where the context's final n tokens also end, for
    n = 1, 2, ... up to ``max_n`` or the first n with no match (one vectorised pass per n)."""
    length = tokens.shape[0]
    if length < 2:
        return []
    # cand[e] is True while tokens[e-j] == tokens[L-1-j] for all j < n (e in [0, L-2]).
    cand = tokens[: length - 1] == tokens[length - 1]
    ends: list[np.ndarray] = []
    for n in range(1, min(max_n, length - 1) + 1):
        if n > 1:
            cand[n - 1 :] &= tokens[: length - n] == tokens[length - n]
            cand[n - 2] = False  # the n-gram would start before position 0
        hits = np.flatnonzero(cand)
        if hits.size == 0:
            break
        ends.append(hits)
    return ends


def find_suffix_match(
    tokens: np.ndarray,  # [L] int64
    min_n: int,
    max_n: int,
) -> tuple[int, int] | None:
    """(end, n): the last position ``end < L-1`` where the context's final n tokens also end,
    for the largest n in [min_n, max_n] that occurs; None if no suffix of length min_n recurs.

    ``suffix_match_ends`` narrowed to what a chain draft needs (one end, not every end per n):
    the proposer runs it every step, so it skips the per-n index lists."""
    length = tokens.shape[0]
    if length < min_n + 1:
        return None
    cand = tokens[: length - 1] == tokens[length - 1]  # as in suffix_match_ends
    found, last = 0, -1
    for n in range(1, min(max_n, length - 1) + 1):
        if n > 1:
            cand[n - 1 :] &= tokens[: length - n] == tokens[length - n]
            cand[n - 2] = False
        if not cand.any():
            break
        found = n
        last = length - 2 - int(np.argmax(cand[::-1]))
    if found < min_n:
        return None
    return last, found
