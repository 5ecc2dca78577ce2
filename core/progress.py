"""Progress for long work, on stderr: a bar on a terminal, plain lines anywhere else.

A minute of silence reads as a hang, and CI logs, `nohup` and pipes are not terminals, so
progress has two forms. On a terminal: tqdm bars that redraw in place. Elsewhere: one line
per stage ("[2/5] exporting to ONNX ...") and, for loops, one line per tenth of the work with
the elapsed time and an estimate of what is left, or sooner when `HEARTBEAT_S` pass without one
(a tenth of an 8B export can take minutes). A bar in a log file would be one line per
refresh, which is why bars stay on terminals.

Whether progress shows at all: an explicit `show`/`requested` argument wins; else the
ambient setting (`shown(True)`, which the CLI sets for a whole command so that code deep in a
pass need not thread a flag through); else only on a terminal (library use stays quiet).
"""

from __future__ import annotations

import contextvars
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")

HEARTBEAT_S = 30.0  # off a terminal, a loop says something at least this often

_AMBIENT: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "specport_progress", default=None
)


@contextmanager
def shown(flag: bool | None) -> Iterator[None]:
    """Within the block, progress shows (True), stays quiet (False) or follows the terminal."""
    token = _AMBIENT.set(flag)
    try:
        yield
    finally:
        _AMBIENT.reset(token)


def enabled(requested: bool | None = None) -> bool:
    """Should progress show at all (bar or lines)?"""
    if requested is not None:
        return requested
    ambient = _AMBIENT.get()
    if ambient is not None:
        return ambient
    return sys.stderr.isatty()


def bar_enabled(requested: bool | None = None) -> bool:
    """Bars redraw with carriage returns: in a log file that is one line per refresh, so a bar
    shows only on a terminal even when progress was asked for (lines print instead)."""
    return enabled(requested) and sys.stderr.isatty()


def duration(seconds: float) -> str:
    """12.3s, 4m05s, 1h02m: short enough for a log line."""
    s = round(seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Loop:
    """Progress of a loop of `total` steps: a tqdm bar on a terminal; elsewhere one line per
    tenth ("train-mtp: 60/600 (10%), 12.0s elapsed, ETA 1m48s, loss 2.31"), and at least one
    every `HEARTBEAT_S` seconds while steps complete."""

    def __init__(
        self,
        total: int,
        desc: str,
        show: bool | None = None,
        every_step: bool = False,
        initial: int = 0,
    ) -> None:
        self.total = max(0, int(total))
        self.desc = desc
        self.every_step = every_step  # a line per step (few long steps: model layers)
        # steps done before this run (a resumed job): counted as done, not in the rate, so a
        # job resumed at 50% does not promise its second half in the time its first minute took
        self.initial = max(0, int(initial))
        self.done = self.initial
        self._show = enabled(show)
        self._t0 = time.perf_counter()
        self._last_line_t = self._t0
        self._next_line = self._tenth()
        self._bar: Any = None
        if self._show and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=self.total or None,
                initial=self.initial,
                desc=desc,
                file=sys.stderr,
                leave=False,
            )

    def _tenth(self) -> int:
        """The step count of the next line: the next tenth of `total` above what is done."""
        if self.total <= 0 or self.every_step:
            return self.done + 1
        k = self.done * 10 // self.total + 1
        return max(self.done + 1, -(-self.total * k // 10))

    def update(self, n: int = 1, note: str = "") -> None:
        """`n` more steps done; `note` (e.g. the loss) goes on the bar or the next line."""
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            if note:
                self._bar.set_postfix_str(note, refresh=False)
            return
        if not self._show or self.total <= 0:
            return
        now = time.perf_counter()
        due = now - self._last_line_t >= HEARTBEAT_S
        if self.done >= self._next_line or self.done >= self.total or due:
            self._next_line = self._tenth()
            self._last_line_t = now
            self._line(note)

    def set_total(self, total: int) -> None:
        """The loop turned out longer or shorter (e.g. a time budget)."""
        self.total = max(0, int(total))
        self._next_line = self._tenth()
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.refresh()

    def _line(self, note: str) -> None:
        elapsed = time.perf_counter() - self._t0
        pct = 100 * self.done / self.total
        ran = self.done - self.initial
        left = elapsed * (self.total - self.done) / ran if ran > 0 else 0.0
        eta = "done" if self.done >= self.total else (f"ETA {duration(left)}" if ran > 0 else "")
        tail = f", {note}" if note else ""
        _say(
            f"{self.desc}: {self.done}/{self.total} ({pct:.0f}%), {duration(elapsed)} elapsed"
            + (f", {eta}" if eta else "")
            + tail
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Loop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def track(
    items: Iterable[T],
    desc: str,
    total: int | None = None,
    show: bool | None = None,
    every_step: bool = False,
) -> Iterator[T]:
    """Iterate `items` with a `Loop` (total from len() when not given)."""
    if total is None:
        try:
            total = len(items)  # type: ignore[arg-type]
        except TypeError:
            total = 0
    with Loop(total, desc, show, every_step) as loop:
        for item in items:
            yield item
            loop.update()


class Stages:
    """Numbered stage lines ("[2/5] exporting to ONNX ... 4.1s") for multi-step commands."""

    def __init__(self, total: int, show: bool | None = None, label: str = "") -> None:
        self.total = total
        self.label = f"{label} " if label else ""
        self.show = enabled(show)
        self.index = 0
        self._t0 = 0.0
        self.timings: dict[str, float] = {}
        self._name = ""

    def start(self, name: str) -> None:
        self._finish()
        self.index += 1
        self._name = name
        self._t0 = time.perf_counter()
        if self.show:
            _say(f"[{self.label}{self.index}/{self.total}] {name} ...")

    def _finish(self) -> None:
        if self._name:
            dt = time.perf_counter() - self._t0
            self.timings[self._name] = round(dt, 3)
            if self.show:
                _say(f"      {self._name}: {duration(dt)}")
            self._name = ""

    def done(self) -> dict[str, float]:
        self._finish()
        return self.timings


def stage_callback(show: bool | None = None) -> Callable[[str, int, int], None]:
    """A `progress(stage, i, n)` callback (the quantizer's and evaluator's protocol) that
    opens a `Loop` per stage name and reports through it."""
    state: dict[str, Any] = {"name": None, "loop": None}

    def report(stage: str, i: int, n: int) -> None:
        if stage != state["name"]:
            if state["loop"] is not None:
                state["loop"].close()
            state["name"] = stage
            state["loop"] = Loop(n, stage, show) if n > 1 else None
            if n <= 1 and enabled(show):
                _say(f"{stage} ...")
        loop = state["loop"]
        if loop is not None and i > loop.done:
            loop.update(i - loop.done)
            if i >= n:
                loop.close()

    return report


def every_tenth(step: int, total: int, message: str, requested: bool | None = None) -> None:
    """Where a bar cannot show (progress asked for, stderr not a terminal): one plain line per
    tenth of the work. Prefer `Loop`, which adds elapsed time and ETA."""
    if not enabled(requested) or sys.stderr.isatty() or total <= 0:
        return
    if (step + 1) % max(1, total // 10) == 0 or step + 1 == total:
        _say(f"{message} {step + 1}/{total}")
