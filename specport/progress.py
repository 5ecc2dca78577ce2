"""Progress for long work, on stderr, off under --json or when stderr is not a terminal."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def enabled(requested: bool | None = None) -> bool:
    if requested is not None:
        return requested
    return sys.stderr.isatty()


def bar_enabled(requested: bool | None = None) -> bool:
    """Bars redraw with carriage returns: in a log file that is one line per refresh, so a bar
    shows only on a terminal even when progress was asked for (stage lines still print)."""
    return requested is not False and sys.stderr.isatty()


def every_tenth(step: int, total: int, message: str, requested: bool | None = None) -> None:
    """Where a bar cannot show (progress asked for, stderr not a terminal): one plain line per
    tenth of the work, so logs of long jobs still say how far they got."""
    if not requested or sys.stderr.isatty() or total <= 0:
        return
    if (step + 1) % max(1, total // 10) == 0 or step + 1 == total:
        print(f"{message} {step + 1}/{total}", file=sys.stderr, flush=True)


class Stages:
    """Numbered stage lines ("[2/5] exporting to ONNX ... 4.1s") for multi-step commands."""

    def __init__(self, total: int, show: bool | None = None) -> None:
        self.total = total
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
            print(f"[{self.index}/{self.total}] {name} ...", file=sys.stderr, flush=True)

    def _finish(self) -> None:
        if self._name:
            dt = time.perf_counter() - self._t0
            self.timings[self._name] = round(dt, 3)
            if self.show:
                print(f"      {self._name}: {dt:.1f}s", file=sys.stderr, flush=True)
            self._name = ""

    def done(self) -> dict[str, float]:
        self._finish()
        return self.timings


def bar(
    items: Iterable[T], desc: str, total: int | None = None, show: bool | None = None
) -> Iterator[T]:
    """tqdm on stderr when shown, the bare iterable otherwise."""
    if not bar_enabled(show):
        yield from items
        return
    from tqdm.auto import tqdm

    yield from tqdm(items, desc=desc, total=total, file=sys.stderr, leave=False)
