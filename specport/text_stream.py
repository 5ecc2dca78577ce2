"""`Model.generate(..., stream=True)`: the text as an iterator, for a `for` loop.

The runtime reports text through a callback; a worker thread runs the generation and hands
the pieces over a queue, so the caller just iterates. Leaving the loop early (break, an
exception, `close()`) stops the generation at its next piece. Once the iteration ends,
`stream.result` is the `GenerationResult` (tokens, finish reason, metrics).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

_END = object()


class _Closed(Exception):
    """Raised inside the worker's callback once the reader has gone."""


class TextStream:
    """Iterate to get text pieces as they are generated; then read `.result`."""

    def __init__(self, run: Callable[[Callable[[str], None]], Any]) -> None:
        self._run = run
        self._queue: queue.Queue[Any] = queue.Queue()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._finished = False
        self.result: Any = None

    def _work(self) -> None:
        def on_text(piece: str) -> None:
            if self._closed.is_set():
                raise _Closed
            self._queue.put(piece)

        try:
            self.result = self._run(on_text)
        except _Closed:
            pass
        except BaseException as e:  # noqa: BLE001 - re-raised in the reader's thread
            self._error = e
        finally:
            self._queue.put(_END)

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        if self._finished:
            raise StopIteration
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="specport-stream", daemon=True)
            self._thread.start()
        item = self._queue.get()
        if item is _END:
            self._finished = True
            self._thread.join()
            if self._error is not None:
                raise self._error
            raise StopIteration
        return str(item)

    @property
    def text(self) -> str:
        """The whole text (iterates to the end if needed)."""
        for _ in self:
            pass
        return str(self.result.text) if self.result is not None else ""

    def close(self) -> None:
        """Stop the generation (at its next piece) and wait for the worker."""
        self._closed.set()
        if self._thread is not None and not self._finished:
            while self._queue.get() is not _END:
                pass
            self._finished = True
            self._thread.join()

    def __enter__(self) -> TextStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
