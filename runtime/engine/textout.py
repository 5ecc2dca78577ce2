"""Token ids in, Events out, on a thread of its own: detokenization never holds up a decode step.

(With no core to spare beside onnxruntime's threads the same work runs inline instead, as the
plain generator does: a thread then only competes with onnxruntime for the cores.)

The batching engine's loop only hands each new token (and, when it knows, the finish reason)
to `TextOut`; a worker thread turns them into text with one `TextStreams` per request, matches
stop strings, and pushes `Event`s to the request's handle. When several tokens of a request
are waiting it sends them as one event. The loop hands over a step's tokens at once (`flush`,
once per engine round): a queue put per token woke the thread for every token, and that
wake-up (the thread takes the GIL from the loop) was a quarter of the loop's time on a small
model. A stop string is found here, after the loop may have
decoded a step or two more: `stopped` tells the loop to drop the row, and the tokens after the
one that completed the stop string are discarded (as `Model.generate` does).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from specport.runtime.engine.base import Event, RequestHandle, TokenLogprobs
from specport.runtime.streaming import TextStreams

logger = logging.getLogger(__name__)


class Stream:
    """One request's text state. `stopped` (set by the TextOut thread) ends it early."""

    def __init__(self, handle: RequestHandle, tokenizer: Any | None) -> None:
        self.handle = handle
        self.pieces: list[str] = []
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = None if handle.request.logprobs is None else []
        self.text = TextStreams(
            tokenizer, 1, list(handle.request.stop), lambda _row, piece: self.pieces.append(piece)
        )
        self.done = False  # final event pushed (TextOut thread only)
        self.stopped = False  # a stop string matched: the engine should drop the request

    def add(self, token: int, logprob: TokenLogprobs | None = None) -> bool:
        """Feed one token; True when a stop string just matched."""
        self.tokens.append(token)
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)
        return self.text.push_row(0, token)

    def flush_event(self, finish: str | None = None, error: str | None = None) -> None:
        if finish is None and not self.tokens and not self.pieces:
            return
        event = Event("".join(self.pieces), self.tokens, finish, error, self.logprobs)
        self.pieces, self.tokens = [], []
        if self.logprobs is not None:
            self.logprobs = []
        if finish is not None:
            self.done = True
        self.handle.push(event)


# (stream, token or None, finish reason, error, logprobs of the token)
_Item = tuple[Stream, "int | None", "str | None", "str | None", "TokenLogprobs | None"]


class TextOut:
    """The detokenizing thread shared by all requests of an engine."""

    def __init__(
        self, tokenizer: Any | None, threaded: bool = True, name: str = "specport-textout"
    ) -> None:
        self.tokenizer = tokenizer
        self._queue: queue.Queue[list[_Item] | None] = queue.Queue()
        self._pending: list[_Item] = []  # this round's items (the engine thread's only)
        self._thread: threading.Thread | None = None
        self.cpu_seconds = 0.0  # the thread's CPU time delivering (inline: counted by the caller)
        if threaded:
            self._thread = threading.Thread(target=self._work, name=name, daemon=True)
            self._thread.start()

    def open(self, handle: RequestHandle) -> Stream:
        return Stream(handle, self.tokenizer)

    def token(
        self,
        stream: Stream,
        token: int,
        finish: str | None = None,
        logprob: TokenLogprobs | None = None,
    ) -> None:
        """A new token of `stream`; `finish` ("stop", "length", "context") when it is the last."""
        self._put((stream, token, finish, None, logprob))

    def finish(self, stream: Stream, reason: str, error: str | None = None) -> None:
        """End `stream` without a new token ("cancelled", "error")."""
        self._put((stream, None, reason, error, None))

    def flush(self) -> None:
        """Hand the round's tokens to the thread in one put (the engine calls it per round)."""
        if self._pending:
            items, self._pending = self._pending, []
            self._queue.put(items)

    def close(self) -> None:
        """Deliver everything queued, then stop the thread."""
        if self._thread is not None:
            self.flush()
            self._queue.put(None)
            self._thread.join()

    def _put(self, item: _Item) -> None:
        if self._thread is not None:
            self._pending.append(item)
            return
        self._deliver([item])  # inline: no core to spare for a thread

    def _work(self) -> None:
        while True:
            parts = [self._queue.get()]
            while True:  # take what else is waiting: one event per request per round
                try:
                    parts.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            closing = parts[-1] is None
            t0 = time.thread_time()
            self._deliver([item for part in parts if part is not None for item in part])
            self.cpu_seconds += time.thread_time() - t0
            if closing:
                return

    def _deliver(self, items: list[_Item]) -> None:
        touched: dict[int, Stream] = {}
        for stream, token, finish, error, logprob in items:
            try:
                self._apply(stream, token, finish, error, logprob)
            except Exception as exc:  # a broken tokenizer must not kill the thread
                logger.exception("detokenization failed")
                if not stream.done:
                    stream.flush_event("error", f"detokenization failed: {exc}")
            if not stream.done:
                touched[id(stream)] = stream
        for stream in touched.values():
            if not stream.done:
                stream.flush_event()

    @staticmethod
    def _apply(
        stream: Stream,
        token: int | None,
        finish: str | None,
        error: str | None,
        logprob: TokenLogprobs | None = None,
    ) -> None:
        if stream.done:
            return  # tokens decoded after a stop string matched
        if token is not None and stream.add(token, logprob):
            stream.stopped = True
            stream.flush_event("stop")
            return
        if finish is None:
            return
        if finish in ("stop", "length", "context"):
            stream.text.finish()  # release held-back text (no stop string completed)
        stream.flush_event(finish, error)
