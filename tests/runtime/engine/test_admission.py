"""The reservation rule per preemption mode: what a request holds of the KV space.

What users rely on: by default a request reserves its prompt plus max tokens and is never
preempted; with `recompute` it reserves what it will hold for the next few steps, in whole
blocks, never more than its row can come to write, and a verify step's positions are covered.
"""

from __future__ import annotations

from specport.runtime.engine.admission import BLOCK, HEADROOM_STEPS, Admission


def test_none_reserves_the_worst_case_once():
    rule = Admission("none", max_length=4096)
    assert not rule.preempts
    assert rule.start(fill=300, worst=812) == 812
    assert rule.grow(held=811, reserved=812, worst=812) == 812


def test_recompute_reserves_what_the_next_steps_write_in_blocks():
    rule = Admission("recompute", max_length=4096)
    assert rule.preempts
    first = rule.start(fill=300, worst=812)
    assert first % BLOCK == 0 and 300 + HEADROOM_STEPS <= first < 300 + HEADROOM_STEPS + BLOCK
    assert rule.grow(held=first - 1, reserved=first, worst=812) == first  # the step fits
    grown = rule.grow(held=first, reserved=first, worst=812)
    assert grown % BLOCK == 0 and grown >= first + HEADROOM_STEPS
    assert rule.start(fill=800, worst=812) == 812  # never past what the row can write
    assert Admission("recompute", max_length=810).start(fill=800, worst=812) == 810


def test_a_verify_step_positions_are_covered():
    """With speculation a step writes 1 + drafts positions a row (padding included)."""
    rule = Admission("recompute", max_length=4096, lookahead=6)
    reserved = rule.start(fill=100, worst=200)
    assert reserved >= 100 + HEADROOM_STEPS * 6
    held = reserved - 5  # one position short of a 6-wide step
    assert rule.grow(held, reserved, worst=200) >= held + 6
    assert rule.grow(199, 205, worst=200) == 205  # the last step's padding: up to worst + 5
