"""The prefill budget of a round while rows decode (runtime/engine/prefill_pace.py), from costs
shaped like SmolLM2-135M fp32 on 2 threads: a 36 ms decode step, prefill runs of 45 ms + 3.5 ms
per token."""

from __future__ import annotations

import pytest

from specport.runtime.engine.prefill_pace import FIRST, FIRST_PIECE, FLOOR, PrefillPace

STEP, BASE, PER_TOKEN = 0.036, 0.045, 0.0035


def _run(n: int) -> float:
    return BASE + PER_TOKEN * n


def test_off_and_unmeasured():
    assert PrefillPace(None).budget(512) == 512
    pace = PrefillPace(4.0)
    assert pace.budget(512) == FIRST  # nothing timed yet: a small first round
    assert pace.budget(10) == 10  # never over the fixed budget


@pytest.mark.parametrize("stall", [2.0, 4.0, 8.0])
def test_budget_keeps_the_stall_within_its_multiple(stall):
    pace = PrefillPace(stall)
    for _ in range(5):
        pace.observe_decode(STEP)
    for n in (32, 64, 20, 48):
        pace.observe_prefill(n, _run(n))
    tokens = pace.budget(4096)
    expected = int((FIRST_PIECE * (stall - 1) * STEP - BASE) / PER_TOKEN)
    assert abs(tokens - max(FLOOR, min(expected, 2 * 64))) <= 1  # the fit's rounding
    # the streams' gap with this round in it: their step plus the run, within `stall` steps
    if tokens > FLOOR:
        assert STEP + _run(tokens) <= (1 + FIRST_PIECE * (stall - 1)) * STEP * 1.05


def test_one_size_counts_the_whole_run_per_token():
    pace = PrefillPace(4.0)
    pace.observe_decode(STEP)
    pace.observe_prefill(32, _run(32))
    per_token = _run(32) / 32
    assert pace.budget(4096) == int(FIRST_PIECE * 3 * STEP / per_token)


def test_a_slow_machine_gets_smaller_rounds_and_never_none():
    pace = PrefillPace(4.0)
    pace.observe_decode(STEP)
    for n in (16, 32):
        pace.observe_prefill(n, 10 * _run(n))  # prefill 10x dearer than the step suggests
    assert pace.budget(4096) == FLOOR


def test_rounds_that_ran_long_shrink_the_budget_to_the_stall():
    """The engine's whole rounds correct the prediction: after rounds whose prefill cost 1.5x
    what the runs predicted, a new prompt's first piece costs its share of `stall - 1` usual
    gaps again."""
    stall, usual, miss = 6.0, 0.100, 1.5
    pace = PrefillPace(stall)
    pace.observe_decode(STEP)
    for n in (32, 64, 20, 48):
        pace.observe_prefill(n, _run(n))
    for _ in range(4):
        pace.observe_round(usual, 0)
    for n in (40, 50, 60):
        pace.observe_round(usual + miss * _run(n), n)
    pace.observe_round(usual, 0)  # that prompt is in; the next one starts from the fit
    tokens = pace.budget(4096)
    half = FIRST_PIECE * (stall - 1) * usual  # a first piece asks for part of the stall
    assert miss * _run(tokens) == pytest.approx(half, rel=0.05)


def test_chunks_of_one_size_count_the_whole_run_per_token():
    """A long prompt's chunks (sizes within 2x): no line through them, the run per token."""
    pace = PrefillPace(4.0)
    pace.observe_decode(STEP)
    for n in (40, 44, 48):
        pace.observe_prefill(n, _run(n))
    per_token = sorted(_run(n) / n for n in (40, 44, 48))[1]
    assert pace.budget(4096) == min(int(FIRST_PIECE * 3 * STEP / per_token), 2 * 48)


@pytest.mark.parametrize(
    "cost_ratio, expected", [(1.0, 100), (2.0, 50), (4.0, 50), (0.8, 125), (0.25, 200)]
)
def test_a_prompts_next_piece_follows_what_the_last_cost(cost_ratio, expected):
    """Once a round with prompt tokens was timed, the next takes its size from it: scaled to
    the allowed cost, at most doubled, at least halved."""
    stall, usual = 6.0, 0.040
    pace = PrefillPace(stall)
    pace.observe_decode(STEP)
    pace.observe_prefill(100, _run(100))
    for _ in range(3):
        pace.observe_round(usual, 0)
    pace.observe_round(usual + cost_ratio * (stall - 1) * usual, 100)
    assert abs(pace.budget(4096) - expected) <= 1
    pace.observe_round(usual, 0)  # a round without prompt tokens: the next prompt starts afresh
    assert pace.last is None
