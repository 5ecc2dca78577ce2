"""The prompt profile behind ``--speculative auto``'s per-request choice: own-text drafting
replayed over the prompt, per kind of match and draft position; what it makes the hybrid
start from and how long it lets a request's drafts be."""

from __future__ import annotations

import numpy as np
import pytest

from specport.runtime.speculative.hybrid import HybridProposer
from specport.runtime.speculative.prompt_profile import (
    COPY_RATE,
    OPEN_DRAFT,
    PASSAGE_TOKENS,
    PSEUDO,
    profile_prompt,
)
from specport.runtime.speculative.suffix import SuffixIndex, SuffixProposer

CHEAP = [1.0 + 0.03 * k for k in range(17)]  # verifying k = 0..16 drafts


def _random(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 49_152, n)]


def _passage(n: int) -> list[int]:
    """A 40-token sentence written again and again (code, a table, a chant): every match
    continues as before."""
    sentence = _random(40, seed=1)
    return (sentence * (n // 40 + 1))[:n]


def test_random_tokens_measure_nothing_and_leave_the_estimates_as_they_were():
    profile = profile_prompt(_random(300))
    assert profile.matches["own-long"] == 0 and profile.matches["own-short"] <= 2
    assert not profile.copy_heavy
    assert profile.rates("own-long", [0.5, 0.4]) == pytest.approx([0.5, 0.4])


def test_a_prompt_that_repeats_itself_measures_long_matches_that_come_true():
    profile = profile_prompt(_passage(200))
    assert profile.matches["own-long"] > 100 and profile.copy_rate == 1.0
    assert profile.copy_heavy
    rates = profile.rates("own-long", [0.5] * 8)
    assert min(rates) > 0.9  # a hundred tests outweigh the prior's PSEUDO
    tested = profile.tested["own-long"][0]
    assert rates[0] == pytest.approx((tested + 0.5 * PSEUDO) / (tested + PSEUDO))


def _article(n: int) -> list[int]:
    """Random tokens in which one three-token phrase recurs six times, each time followed by
    something new (a name in an article): matches that do not come true."""
    ids, phrase = _random(n), [7, 8, 9]
    for at in range(n - 200, n - 10, 30):
        ids[at : at + 3] = phrase
    return ids


@pytest.mark.parametrize(
    ("prompt", "heavy"),
    [
        (_article(PASSAGE_TOKENS - 1), False),
        (_article(PASSAGE_TOKENS), True),
        (_random(2 * PASSAGE_TOKENS), False),  # long, but nothing in it recurs
    ],
)
def test_a_long_prompt_with_recurring_phrases_carries_a_passage(prompt, heavy):
    profile = profile_prompt(prompt)
    assert profile.copy_heavy == heavy
    assert profile.copy_rate < COPY_RATE  # heavy or not, its matches themselves did not pay


def _hybrid() -> HybridProposer:
    hybrid = HybridProposer(SuffixProposer(SuffixIndex(), max_draft=16), None, CHEAP)
    hybrid.start(None)
    return hybrid


@pytest.mark.parametrize(
    ("prompt", "cap"), [(_passage(200), 16), (_random(60) + _random(5, seed=1) * 2, OPEN_DRAFT)]
)
def test_only_a_request_that_copies_well_drafts_past_the_open_cap(prompt, cap):
    hybrid = _hybrid()
    for ctl in hybrid.state.sources.values():
        ctl.rate = [0.99] * 16  # every draft pays: the cap alone bounds its length
    drafts = hybrid.propose([prompt], 16).row(0)
    assert hybrid.cap == cap and len(drafts) == cap
    assert hybrid.propose([[*prompt, *drafts]], 16).row(0)  # later steps keep the cap
    assert hybrid.cap == cap


def test_the_replay_joins_the_request_estimates_before_its_first_step():
    hybrid = _hybrid()
    before = list(hybrid.state.sources["own-long"].rate)
    hybrid.propose([_passage(200)], 16)
    after = hybrid.state.sources["own-long"].rate
    assert after[0] > 0.9 > before[0]
    hybrid.propose([_passage(201)], 16)  # profiled once per request
    assert hybrid.profile is not None and hybrid.profile.tokens == 200
    hybrid.start(None)
    assert hybrid.profile is None and hybrid.cap == 16
