"""The prefill budget of a round while rows decode (runtime/engine/prefill_pace.py), from costs
shaped like SmolLM2-135M fp32 on 2 threads: a 36 ms decode step, prefill runs of 45 ms + 3.5 ms
per token."""

from __future__ import annotations

import pytest

from specport.runtime.engine.prefill_pace import FIRST, FLOOR, PrefillPace

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
    expected = int(((stall - 1) * STEP - BASE) / PER_TOKEN)
    assert abs(tokens - max(FLOOR, min(expected, 2 * 64))) <= 1  # the fit's rounding
    # the streams' gap with this round in it: their step plus the run, within `stall` steps
    if tokens > FLOOR:
        assert STEP + _run(tokens) <= stall * STEP * 1.05


def test_one_size_counts_the_whole_run_per_token():
    pace = PrefillPace(4.0)
    pace.observe_decode(STEP)
    pace.observe_prefill(32, _run(32))
    per_token = _run(32) / 32
    assert pace.budget(4096) == int(3 * STEP / per_token)


def test_a_slow_machine_gets_smaller_rounds_and_never_none():
    pace = PrefillPace(4.0)
    pace.observe_decode(STEP)
    for n in (16, 32):
        pace.observe_prefill(n, 10 * _run(n))  # prefill 10x dearer than the step suggests
    assert pace.budget(4096) == FLOOR
