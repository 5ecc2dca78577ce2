"""Progress on stderr: bars only on a terminal, plain lines in logs (specport/progress.py)."""

from __future__ import annotations

import io
import sys

import pytest

from specport import progress


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


@pytest.mark.parametrize("tty", [False, True])
def test_bar_only_on_a_terminal(monkeypatch, tty):
    stream = _Stream(tty)
    monkeypatch.setattr(sys, "stderr", stream)
    assert progress.bar_enabled(True) is tty
    assert progress.bar_enabled(None) is tty
    assert progress.bar_enabled(False) is False
    assert list(progress.bar(range(3), "work", show=True)) == [0, 1, 2]
    assert ("\r" in stream.getvalue()) is tty


def test_logs_get_a_line_per_tenth(monkeypatch):
    stream = _Stream(False)
    monkeypatch.setattr(sys, "stderr", stream)
    for step in range(30):
        progress.every_tenth(step, 30, "train step", True)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "train step 3/30" and lines[-1] == "train step 30/30" and len(lines) == 10
    stream.truncate(0)
    progress.every_tenth(0, 1, "quiet", False)  # not asked for: nothing
    assert stream.getvalue().strip("\x00") == ""
