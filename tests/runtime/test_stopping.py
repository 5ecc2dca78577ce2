"""Stop criteria: EOS, length, and stop strings split across streamed pieces."""

from __future__ import annotations

import pytest

from specport.core.errors import InputError
from specport.runtime.stopping import StopCriteria


def _run(criteria: StopCriteria, pieces: list[tuple[int, str]]) -> tuple[str, list[str], object]:
    state = criteria.new_state()
    shown = []
    for tok, text in pieces:
        shown.append(state.update(tok, text))
        if state.done:
            break
    shown.append(state.flush())
    return "".join(shown), shown, state


def test_eos_stops_and_releases_held_text():
    crit = StopCriteria(eos_ids={2}, stop_strings=["END"], max_new_tokens=100)
    text, _, state = _run(crit, [(5, "Hello E"), (6, "N"), (2, ""), (7, "never")])
    assert text == "Hello EN"
    assert state.reason == "eos" and state.num_tokens == 3


def test_length_limit():
    crit = StopCriteria(eos_ids={2}, stop_strings=[], max_new_tokens=3)
    text, _, state = _run(crit, [(5, "a"), (6, "b"), (7, "c"), (8, "d")])
    assert text == "abc" and state.reason == "length" and state.num_tokens == 3
    assert StopCriteria(max_new_tokens=0).new_state().done


def test_stop_string_split_over_pieces_is_trimmed_and_never_shown():
    crit = StopCriteria(eos_ids=set(), stop_strings=["\n\nTHE END"], max_new_tokens=100)
    pieces = [
        (1, "and they lived"),
        (2, " happily.\n"),
        (3, "\nTH"),
        (4, "E E"),
        (5, "ND!"),
        (6, "x"),
    ]
    text, shown, state = _run(crit, pieces)
    assert text == "and they lived happily."
    assert state.reason == "stop_string" and state.matched == "\n\nTHE END"
    assert state.num_tokens == 5
    assert all("\n" not in s for s in shown)  # the held-back prefix never leaked


def test_false_prefix_is_released_later():
    crit = StopCriteria(stop_strings=["STOP"], max_new_tokens=100)
    state = crit.new_state()
    assert state.update(1, "go ST") == "go "
    assert state.update(2, "ONE") == "STONE"
    assert state.update(3, " ST") == " "
    assert state.flush() == "ST"
    assert not state.done


def test_earliest_of_several_stop_strings_wins():
    crit = StopCriteria(stop_strings=["world", "lo w"], max_new_tokens=100)
    text, _, state = _run(crit, [(1, "hello world")])
    assert text == "hel" and state.matched == "lo w"


def test_holdback_is_longest_proper_prefix_suffix():
    crit = StopCriteria(stop_strings=["abcab", "zz"])
    assert crit.holdback("xxabca") == 4
    assert crit.holdback("xxz") == 1
    assert crit.holdback("abcab") == 2  # a full match is not a proper prefix (scan handles it)
    assert crit.holdback("qq") == 0


def test_length_and_stop_string_on_same_token():
    crit = StopCriteria(stop_strings=["!"], max_new_tokens=1)
    text, _, state = _run(crit, [(1, "hi! there")])
    assert text == "hi" and state.reason == "stop_string"


@pytest.mark.parametrize(
    "kwargs", [{"max_new_tokens": -1}, {"stop_strings": [""]}, {"max_new_tokens": 1.5}]
)
def test_validation(kwargs: dict):
    with pytest.raises(InputError):
        StopCriteria(**kwargs)
