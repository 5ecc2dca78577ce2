"""Suffix drafting: continue the current text the way earlier answers continued it.

Prompt lookup (`ngram.py`) only finds text the current request already contains. Chat models
also repeat themselves across requests: openings ("Sure! Here are three ..."), list
scaffolding, closing sentences, phrases of their house style. `SuffixIndex` keeps earlier
outputs (a corpus shipped with the artifact, and in a server every finished response) and
`SuffixProposer` drafts from whichever source matches the longer suffix, the request's own
text winning ties. The draft follows the most frequent continuation among all the places the
suffix occurred, token by token, and stops when that continuation gets too rare, so a draft
is long where earlier answers agree and short (or empty) where they diverge. Free to run (no
model); deterministic drafts, verified like n-gram drafts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from specport.core.errors import InputError
from specport.runtime.speculative.base import RowProposer
from specport.runtime.speculative.ngram import SuffixLookup, copy_after

logger = logging.getLogger(__name__)

SEPARATOR = -1  # between sequences in the corpus: no n-gram or continuation crosses it
_PRIME = np.int64(1_000_003)  # n-gram keys: a polynomial hash over int64 (wrapping)
_NO_KEY = np.iinfo(np.int64).min  # an n-gram that would cross a separator
_PRIME_INT, _WRAP = int(_PRIME), 1 << 64  # the same keys in Python ints (``longest_match``)


class SuffixIndex:
    """Where every n-gram (n = 1..max_n) of a token corpus ends, for suffix lookups.

    Per n, the corpus positions sorted by a 64-bit hash of the n-gram ending there: a lookup
    is a binary search, the memory 16 bytes per token and n (a Python dict of tuples would
    take ten times that). Sequences are appended (``add``) as they come and indexed at the
    next lookup; the corpus keeps the newest ``max_tokens`` tokens, so a long-running server's
    memory stays bounded. A hash collision can only cost a rejected draft, never a wrong token.
    """

    def __init__(self, max_n: int = 6, max_tokens: int = 500_000, max_matches: int = 512) -> None:
        if max_n < 1 or max_tokens < 2 or max_matches < 1:
            raise InputError("suffix index sizes must be positive")
        self.max_n = max_n
        self.max_tokens = max_tokens
        self.max_matches = max_matches  # the most recent matches a lookup reads
        # whether engines add each finished answer (`learn_answer`); a benchmark that decodes
        # the same prompts every round turns it off, or round 2 would draft round 1's answers
        self.learn = True
        # called with each learned answer too (`suffix_record.SuffixRecorder`: kept on disk)
        self.recorder: Callable[[Sequence[int]], None] | None = None
        self._tokens = np.zeros(0, dtype=np.int64)
        self._pending: list[int] = []
        self._keys: list[np.ndarray] = []  # per n: sorted n-gram keys
        self._order: list[np.ndarray] = []  # per n: corpus end positions in key order

    def __len__(self) -> int:
        return int(self._tokens.shape[0]) + len(self._pending)

    @property
    def sequences(self) -> int:
        return int(np.count_nonzero(self._tokens == SEPARATOR)) + self._pending.count(SEPARATOR)

    def add(self, sequence: Sequence[int]) -> None:
        """Queue one sequence (an earlier answer) for the index."""
        seq = [int(t) for t in sequence]
        if any(t < 0 for t in seq):
            raise InputError("token ids in a suffix corpus must be non-negative")
        if seq:
            self._pending.extend(seq)
            self._pending.append(SEPARATOR)

    def extend(self, sequences: Iterable[Sequence[int]]) -> None:
        for seq in sequences:
            self.add(seq)

    def learn_answer(self, answer: Sequence[int]) -> None:
        """A served request (or chat turn) finished: its answer becomes something later
        requests can draft from (when `learn` is on), and goes to the `recorder` if any."""
        if self.learn:
            self.add(answer)
            if self.recorder is not None:
                self.recorder(answer)

    def tokens(self) -> np.ndarray:
        """The indexed corpus, sequences separated by -1 (what `artifact` files store)."""
        self._build()
        return self._tokens

    def _build(self) -> None:
        """Index the queued sequences: their keys are sorted and merged into each n's sorted
        arrays (a copy, no re-sort: a server adds an answer per finished request). Past
        `max_tokens` the oldest sequences go and the index is rebuilt, down to 3/4 of the
        limit so that happens rarely."""
        if not self._pending:
            return
        tail = np.asarray(self._pending, dtype=np.int64)
        self._pending = []
        if self._tokens.shape[0] + tail.shape[0] > self.max_tokens:
            tokens = np.concatenate([self._tokens, tail])
            budget = max(self.max_tokens * 3 // 4, min(tail.shape[0], self.max_tokens))
            seps = np.flatnonzero(tokens[: tokens.shape[0] - budget] == SEPARATOR)
            cut = int(seps[-1]) + 1 if seps.size else tokens.shape[0] - budget
            self._tokens = np.zeros(0, dtype=np.int64)
            self._keys, self._order = [], []
            tail = tokens[cut:]
        offset = self._tokens.shape[0]
        self._tokens = np.concatenate([self._tokens, tail])
        for n, key in enumerate(_ngram_keys(tail, self.max_n)):
            order = np.argsort(key, kind="stable")  # equal keys stay in corpus order
            new_keys, new_pos = key[order], order + offset
            if n < len(self._keys):  # after the equal keys already there: still oldest first
                at = np.searchsorted(self._keys[n], new_keys, side="right")
                self._keys[n] = np.insert(self._keys[n], at, new_keys)
                self._order[n] = np.insert(self._order[n], at, new_pos)
            else:
                self._keys.append(new_keys)
                self._order.append(new_pos)
        logger.debug("suffix index: %d tokens", self._tokens.shape[0])

    def longest_match(self, context: Sequence[int], min_n: int) -> tuple[int, np.ndarray]:
        """(n, end positions, oldest first) of the longest suffix of ``context`` (n >= min_n)
        that occurs in the corpus; (0, empty) when none does."""
        self._build()
        ctx = [int(t) for t in context[-self.max_n :]]
        if not ctx or not self._keys:
            return 0, np.zeros(0, dtype=np.int64)
        # the last n tokens' keys, n = 1.., in Python ints (``_suffix_key``'s wrapping int64
        # arithmetic, without a numpy scalar operation per token: this runs every step)
        keys, key, scale = [], 0, 1
        for t in reversed(ctx):
            key = (key + t * scale) % _WRAP
            scale = scale * _PRIME_INT % _WRAP
            keys.append(key - _WRAP if key >= _WRAP >> 1 else key)
        for n in range(min(self.max_n, len(ctx)), min_n - 1, -1):
            sorted_keys = self._keys[n - 1]
            lo = int(sorted_keys.searchsorted(keys[n - 1], "left"))
            hi = int(sorted_keys.searchsorted(keys[n - 1], "right"))
            if hi > lo:
                return n, self._order[n - 1][max(lo, hi - self.max_matches) : hi]
        return 0, np.zeros(0, dtype=np.int64)

    def continuation(self, ends: np.ndarray, num_draft: int, min_share: float) -> list[int]:
        """The most frequent continuation after the match ends, token by token, while the
        chosen token follows at least ``min_share`` of all the matches (the path's frequency)."""
        tokens = self._tokens
        total = len(ends)
        pos = np.asarray(ends, dtype=np.int64) + 1
        draft: list[int] = []
        for _ in range(num_draft):
            pos = pos[pos < tokens.shape[0]]
            nxt = tokens[pos]
            pos, nxt = pos[nxt != SEPARATOR], nxt[nxt != SEPARATOR]
            if nxt.size == 0:
                break
            values, counts = np.unique(nxt, return_counts=True)
            best = int(np.argmax(counts))
            if counts[best] < min_share * total:
                break
            draft.append(int(values[best]))
            pos = pos[nxt == values[best]] + 1
        return draft


def _ngram_keys(tokens: np.ndarray, max_n: int) -> list[np.ndarray]:
    """Per n = 1..max_n, the key of the n-gram ending at each position (`_NO_KEY` where it
    would start before the array or cross a separator)."""
    valid = tokens != SEPARATOR
    key = np.where(valid, tokens, _NO_KEY)
    keys = [key]
    with np.errstate(over="ignore"):
        for _ in range(2, max_n + 1):  # key_n(i) = key_{n-1}(i-1) * P + token(i)
            prev = np.concatenate([[_NO_KEY], key[:-1]])
            key = np.where((prev != _NO_KEY) & valid, prev * _PRIME + tokens, _NO_KEY)
            keys.append(key)
    return keys


def _suffix_key(ngram: np.ndarray) -> np.int64:
    """The index's key of one n-gram (oldest token first), as `SuffixIndex._build` computes it."""
    key = np.int64(ngram[0])
    with np.errstate(over="ignore"):
        for t in ngram[1:]:
            key = key * _PRIME + np.int64(t)
    return key


class SuffixProposer(RowProposer):
    """Drafts from the request's own text or from a `SuffixIndex` of earlier outputs,
    whichever matches the longer suffix (the request's own text on ties)."""

    name = "suffix"

    def __init__(
        self,
        index: SuffixIndex,
        min_n: int = 2,
        max_draft: int = 8,
        min_share: float = 0.25,
        context_min_n: int = 1,
    ) -> None:
        if not 1 <= min_n <= index.max_n:
            raise InputError(f"suffix min_n must be in 1..{index.max_n}, got {min_n}")
        self.index = index
        self.min_n = min_n
        self.max_draft = max_draft
        self.min_share = min_share
        self.context_min_n = context_min_n
        self.lookup = SuffixLookup(index.max_n)  # the request's own text

    def start(
        self, sampling: Any = None, stream: int | None = None, budget: int | None = None
    ) -> None:
        self.lookup = SuffixLookup(self.index.max_n)

    def finish(self, answer: Sequence[int]) -> None:
        """A served request's answer joins the corpus later requests draft from."""
        if len(answer):
            self.index.learn_answer(answer)

    def propose_one(self, tokens: Sequence[int], num_draft: int) -> list[int]:
        return self.match(tokens, num_draft)[0]

    def match(self, tokens: Sequence[int], num_draft: int) -> tuple[list[int], str]:
        """(draft, kind of match): ``own-long`` / ``own-short`` (the request's own text, a
        suffix of 3+ tokens or fewer), ``corpus-long`` (a suffix of 4+ tokens in earlier
        answers) or ``corpus-short``; ``none`` with no draft. Their
        drafts are accepted at different rates, which a caller that weighs drafts
        (``hybrid.HybridProposer``) calibrates apart."""
        own = self.lookup.find(tokens, self.context_min_n)
        n, ends = self.index.longest_match(tokens, self.min_n)
        if own is not None and own[1] >= n:
            return copy_after(tokens, own[0], num_draft), "own-long" if own[1] >= 3 else "own-short"
        if ends.size == 0:
            return [], "none"
        # Shorter suffixes match more places, less specifically: ask them for a wider majority.
        share = self.min_share * (1.0 + (self.index.max_n - n) / self.index.max_n)
        draft = self.index.continuation(ends, num_draft, min(share, 0.9))
        return draft, ("corpus-long" if n >= 4 else "corpus-short") if draft else "none"
