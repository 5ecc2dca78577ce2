"""Reading a line at an interactive prompt so that Ctrl-C always ends the wait.

`input()` blocks in `read()` and relies on SIGINT interrupting that call. A Ctrl-C that lands
between the prompt being written and `read()` starting (the process was descheduled, as happens
on a busy machine), or one the kernel hands to one of onnxruntime's threads, runs the handler
but leaves the main thread blocked: the chat then ignores Ctrl-C until the next Enter. Here
the C-level signal handler also writes to a wake-up pipe (`signal.set_wakeup_fd`), and the
prompt waits on stdin and that pipe together, so a Ctrl-C pressed at any moment is seen.
"""

from __future__ import annotations

import os
import select
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager


class LineReader:
    """Reads one line at a time from a terminal; Ctrl-C raises KeyboardInterrupt, Ctrl-D EOFError."""

    def __init__(self, wake_fd: int) -> None:
        self._wake_fd = wake_fd

    def read(self, prompt: str) -> str:
        self._drain()  # a Ctrl-C that stopped the last answer is not one for this prompt
        sys.stderr.write(prompt)
        sys.stderr.flush()
        while True:
            ready, _, _ = select.select([sys.stdin, self._wake_fd], [], [])
            if self._wake_fd in ready and signal.SIGINT in self._drain():
                # Python's handler normally raises first, at the next bytecode; this covers
                # a SIGINT whose handler ran in the main thread before select() started.
                raise KeyboardInterrupt
            if sys.stdin in ready:
                line = sys.stdin.readline()  # a terminal in line mode hands over whole lines
                if not line:
                    raise EOFError
                return line.rstrip("\n")

    def _drain(self) -> bytes:
        """The signal numbers written since the last drain, one byte each."""
        seen = b""
        try:
            while chunk := os.read(self._wake_fd, 512):
                seen += chunk
        except BlockingIOError:
            pass
        return seen


@contextmanager
def line_reader() -> Iterator[LineReader | None]:
    """A LineReader while SIGINT is wired to its wake-up pipe; None where that cannot be done
    (no POSIX select on stdin, or not the main thread), and the caller falls back to input()."""
    if os.name != "posix":
        yield None
        return
    try:
        # Ctrl-C must reach us even when we were started with SIGINT ignored (a parent that
        # ignores it, `nohup`, some job runners): exec keeps an ignored disposition, and then
        # no handler would run and nothing would be written to the pipe.
        previous_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:  # not the main thread
        yield None
        return
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    os.set_blocking(write_end, False)
    try:
        previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    except ValueError:  # not the main thread
        os.close(read_end)
        os.close(write_end)
        signal.signal(signal.SIGINT, previous_handler)
        yield None
        return
    try:
        yield LineReader(read_end)
    finally:
        signal.set_wakeup_fd(previous)
        signal.signal(signal.SIGINT, previous_handler)
        os.close(read_end)
        os.close(write_end)
