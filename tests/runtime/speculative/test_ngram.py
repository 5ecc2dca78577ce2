"""N-gram proposer: token lists -> expected drafts."""

from __future__ import annotations

import time

import numpy as np
import pytest

from specport.core.errors import InputError
from specport.runtime.speculative.base import Drafts, Proposer
from specport.runtime.speculative.ngram import NgramProposer, SuffixLookup, find_suffix_match


@pytest.mark.parametrize(
    ("context", "expected"),
    [
        # suffix [1, 2] seen at the start: propose what followed it
        ([1, 2, 3, 4, 5, 9, 1, 2], [3, 4, 5, 9, 1]),
        # longest n wins over a more recent shorter match: [7, 1, 2] -> 3 (not the 8 after [2])
        ([7, 1, 2, 3, 4, 2, 8, 6, 7, 1, 2], [3, 4, 2, 8, 6]),
        # most recent occurrence among equal-length matches
        ([5, 6, 1, 5, 6, 2, 0, 5, 6], [2, 0, 5, 6, 2]),
        # no earlier occurrence of the last token at all
        ([1, 2, 3, 4], []),
        # copy runs into the end of the context and continues with the same period
        ([3, 1, 2, 1, 2], [1, 2, 1, 2, 1]),
        ([4, 4], [4, 4, 4, 4, 4]),
        ([], []),
        ([9], []),
    ],
)
def test_expected_drafts(context: list[int], expected: list[int]):
    assert NgramProposer(min_n=1, max_n=4, max_draft=5).propose([context], 5).row(0) == expected


def test_min_n_and_num_draft_limits():
    ctx = [1, 2, 3, 4, 2]  # only a 1-gram [2] recurs
    assert NgramProposer(min_n=2).propose([ctx], 5).row(0) == []
    assert NgramProposer(min_n=1).propose([ctx], 2).row(0) == [3, 4]
    assert NgramProposer(max_draft=3).propose([ctx], 10).row(0) == [3, 4, 2]
    assert NgramProposer().propose([ctx], 0).width == 0


def test_batch_padding_and_protocol():
    proposer = NgramProposer(max_draft=4)
    assert isinstance(proposer, Proposer)
    drafts = proposer.propose([[1, 2, 3, 1, 2], [5, 6], [8, 8, 8]], 4)
    assert isinstance(drafts, Drafts) and drafts.probs is None
    assert drafts.lengths.tolist() == [4, 0, 4]
    assert drafts.tokens.tolist() == [[3, 1, 2, 3], [-1, -1, -1, -1], [8, 8, 8, 8]]


def test_find_suffix_match_against_bruteforce():
    rng = np.random.default_rng(0)
    for _ in range(300):
        toks = rng.integers(0, 4, size=int(rng.integers(0, 30)))
        got = find_suffix_match(toks, 1, 3)
        ref = None
        for n in range(3, 0, -1):
            ends = [
                e
                for e in range(n - 1, len(toks) - 1)
                if len(toks) > n and np.array_equal(toks[e - n + 1 : e + 1], toks[len(toks) - n :])
            ]
            if ends:
                ref = (ends[-1], n)
                break
        assert got == ref, (toks.tolist(), got, ref)


@pytest.mark.parametrize(("vocab", "max_n", "min_n"), [(3, 4, 1), (6, 4, 2), (2, 6, 1)])
def test_suffix_lookup_equals_find_suffix_match_on_a_growing_context(vocab, max_n, min_n):
    """The proposer's kept index gives ``find_suffix_match``'s match at every step of a
    context that grows by appending (the loops' use), and after an edit in place."""
    rng = np.random.default_rng(vocab * 10 + max_n)
    for _ in range(20):
        lookup = SuffixLookup(max_n)
        context: list[int] = rng.integers(0, vocab, size=int(rng.integers(0, 6))).tolist()
        for step in range(40):
            want = find_suffix_match(np.asarray(context, dtype=np.int64), min_n, max_n)
            assert lookup.find(context, min_n) == want, (context, step)
            if step == 25 and len(context) > 3:  # an edit, not an append: indexed again
                context[len(context) // 2] = vocab
                del context[-2:]
            context.extend(rng.integers(0, vocab, size=int(rng.integers(1, 5))).tolist())
        other = list(context)  # another list: searched, same match
        assert lookup.find(other, min_n) == find_suffix_match(np.asarray(other), min_n, max_n)


def test_long_context_is_fast():
    rng = np.random.default_rng(1)
    contexts = [rng.integers(0, 32000, size=2048).tolist() for _ in range(8)]
    proposer = NgramProposer()
    proposer.propose(contexts, 5)
    start = time.perf_counter()
    for _ in range(20):
        proposer.propose(contexts, 5)
    per_step = (time.perf_counter() - start) / 20
    assert per_step < 0.05, f"{per_step * 1e3:.1f} ms per batch step of 8 x 2048 tokens"


def test_bad_settings():
    with pytest.raises(InputError):
        NgramProposer(min_n=3, max_n=2)
    with pytest.raises(InputError):
        NgramProposer(max_draft=0)
