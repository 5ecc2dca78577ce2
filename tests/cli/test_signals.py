"""A command killed with SIGTERM (a job scheduler's timeout, `kill`, a container stopping) ends
like Ctrl-C does: one line, exit 143, and no half-written temp folder left beside --out."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


@pytest.mark.slow
def test_sigterm_during_export_leaves_nothing_behind(tiny_zoo, tmp_path: Path) -> None:
    out = tmp_path / "art"
    proc = subprocess.Popen(
        [sys.executable, "-m", "specport", "export", str(tiny_zoo.source("llama")), "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not list(tmp_path.glob(".art.tmp-*")):  # the export is writing its artifact now
            assert proc.poll() is None, "the export ended before it could be interrupted"
            assert time.monotonic() < deadline
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "terminated" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no artifact, no temp folder


def test_an_error_while_terminating_still_ends_as_terminated(monkeypatch, tmp_path, capsys):
    """A SIGTERM that a library turned into its own error (numpy's shape discovery reports
    "could not determine the shape ..." in its place) ends as a termination, not a bug report."""
    from specport import cli

    monkeypatch.setattr(cli, "_TERMINATING", True)
    assert cli.main(["inspect", str(tmp_path / "missing")]) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "terminated" in err and "bug" not in err
    monkeypatch.setattr(cli, "_TERMINATING", False)
    assert cli.main(["inspect", str(tmp_path / "missing")]) != 128 + signal.SIGTERM
    assert "terminated" not in capsys.readouterr().err
