"""Progress on stderr: bars only on a terminal, plain lines elsewhere (core/progress.py)."""

from __future__ import annotations

import io
import re
import subprocess
import sys

import pytest

from specport.core import progress


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
    assert list(progress.track(range(3), "work", show=True)) == [0, 1, 2]
    assert ("\r" in stream.getvalue()) is tty


def test_logs_get_a_line_per_tenth_with_elapsed_and_eta(monkeypatch):
    stream = _Stream(False)
    monkeypatch.setattr(sys, "stderr", stream)
    with progress.Loop(30, "train", show=True) as loop:
        for _ in range(30):
            loop.update(note="loss 1.5")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 10
    assert re.fullmatch(r"train: 3/30 \(10%\), \d+\.\ds elapsed, ETA \d+\.\ds, loss 1\.5", lines[0])
    assert lines[-1].startswith("train: 30/30 (100%)") and "done" in lines[-1]


def test_a_resumed_loop_counts_earlier_steps_as_done_but_not_in_its_eta(monkeypatch):
    """A job resumed at half way (train-draft with a larger --minutes) must not promise its
    second half in the time its first new steps took."""
    stream = _Stream(False)
    monkeypatch.setattr(sys, "stderr", stream)
    now = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    with progress.Loop(100, "train", show=True, initial=50) as loop:
        for _ in range(10):
            now[0] += 1.0  # one step per second
            loop.update()
    first = stream.getvalue().splitlines()[0]
    # 10 steps in 10 s: the 40 left take 40 s (counting the 50 resumed steps would say 6.7 s)
    assert first.startswith("train: 60/100 (60%), 10.0s elapsed, ETA 40.0s"), first


def test_logs_get_a_heartbeat_when_a_tenth_takes_long(monkeypatch):
    """A tenth of a long job (an 8B export's layer loop) can take minutes: a line at least
    every HEARTBEAT_S keeps a log from looking hung."""
    stream = _Stream(False)
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.0)
    with progress.Loop(1000, "export", show=True) as loop:
        for _ in range(5):
            loop.update()
    lines = stream.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == [f"export: {i}/1000" for i in range(1, 6)]


def test_library_use_is_quiet_off_a_terminal_unless_asked(monkeypatch):
    stream = _Stream(False)
    monkeypatch.setattr(sys, "stderr", stream)
    list(progress.track(range(20), "quiet"))
    progress.Stages(2).start("quiet stage")
    assert stream.getvalue() == ""
    with progress.shown(True):  # what the CLI sets for a whole command
        list(progress.track(range(20), "loud"))
        progress.Stages(2).start("loud stage")
    out = stream.getvalue()
    assert "loud: 20/20" in out and "[1/2] loud stage ..." in out
    with progress.shown(False):  # `specport -q`
        list(progress.track(range(20), "silent"))
    assert "silent" not in stream.getvalue()


def test_stage_callback_lines(monkeypatch):
    stream = _Stream(False)
    monkeypatch.setattr(sys, "stderr", stream)
    report = progress.stage_callback(True)
    for i in range(1, 21):
        report("calibrate", i, 20)
    report("quantize_weights", 0, 1)
    out = stream.getvalue()
    assert "calibrate: 2/20 (10%)" in out and "calibrate: 20/20 (100%)" in out
    assert "quantize_weights ..." in out


def test_logs_get_a_line_per_tenth(monkeypatch):
    stream = _Stream(False)
    monkeypatch.setattr(sys, "stderr", stream)
    for step in range(30):
        progress.every_tenth(step, 30, "train step", True)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "train step 3/30" and lines[-1] == "train step 30/30" and len(lines) == 10


@pytest.mark.slow
def test_quantize_is_not_silent_in_a_log(tiny_llama_artifact, tmp_path):
    """stderr is a pipe here, as in CI or nohup: stage lines and loop lines still come."""
    args = ["quantize", str(tiny_llama_artifact), "--out", str(tmp_path / "q")]
    args += ["--scheme", "w4a16", "--algo", "rtn"]
    r = subprocess.run(
        [sys.executable, "-m", "specport", *args],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "quantizing weights (rtn): " in r.stderr and "(100%)" in r.stderr
    assert "writing the quantized graph ..." in r.stderr
    quiet = subprocess.run(
        [sys.executable, "-m", "specport", "-q", *args],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert quiet.returncode == 0 and quiet.stderr == ""
