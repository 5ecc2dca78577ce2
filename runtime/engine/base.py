"""What an engine promises its callers (the HTTP server, tests): submit a request, read its stream.

An engine owns one loaded `specport.api.Model` and a worker thread that runs onnxruntime; callers
on other threads `submit` requests and consume each request's events from its handle. Two engines
share this contract: `SerialEngine` (any artifact, one request at a time) and `BatchingEngine`
(shared-KV artifacts, continuous batching: requests join and leave the running batch between
decode steps). Keeping the contract this small lets the server stay ignorant of scheduling.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from specport.core.errors import InputError
from specport.runtime.sampler import Sampler, SamplingConfig


@dataclass(frozen=True)
class Request:
    """One generation request, already tokenized.

    `stop` strings end the text (not included); `ignore_eos` keeps going past EOS tokens.
    """

    prompt_ids: Sequence[int]
    max_new_tokens: int = 64
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    request_id: str = ""
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's and the top k's


@dataclass
class Event:
    """A piece of a request's output. The last event has `finish_reason` set.

    `text` is final text (never half a character, never a held-back stop-string prefix);
    `token_ids` are the new tokens since the previous event. finish_reason is one of
    "stop" (EOS or a stop string), "length" (max_new_tokens), "context" (the KV buffer is full),
    "error" (then `error` holds the message), "cancelled".
    """

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    # one per token id when the request asked for logprobs: (chosen logprob, [(id, logprob)...])
    logprobs: list[TokenLogprobs] | None = None


@dataclass(frozen=True)
class TokenLogprobs:
    """The model's log-softmax at one generated position, before any sampling transform
    (temperature, penalties, top-k/p): the chosen token's and the `k` most likely tokens'."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class RequestHandle:
    """The caller's side of one request: iterate events, or wait for the whole result.

    Events are pushed by the engine's worker thread. `cancel()` asks the engine to drop the
    request at its next step (e.g. the HTTP client went away); it then ends with "cancelled".
    A caller of `result()` sleeps until the final event: waking it at every step would take a
    core from onnxruntime's threads on a small machine (one request alone ran 8% slower).
    """

    def __init__(self, request: Request) -> None:
        self.request = request
        self.created = time.perf_counter()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self._items: deque[Event] = deque()
        self._cond = threading.Condition()
        self._done = threading.Event()
        self._cancel = threading.Event()
        self._listeners: list[Callable[[], None]] = []

    # -- engine side --------------------------------------------------------------
    def push(self, event: Event) -> None:
        if event.token_ids and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        final = event.finish_reason is not None
        if final:
            self.finished_at = time.perf_counter()
        with self._cond:
            self._items.append(event)
            if final:
                self._done.set()
            self._cond.notify_all()
            listeners = list(self._listeners)
        for wake in listeners:
            wake()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    # -- caller side --------------------------------------------------------------
    def cancel(self) -> None:
        self._cancel.set()

    def add_listener(self, wake: Callable[[], None]) -> None:
        """Call `wake()` after every event pushed from now on (on the engine's thread; it must
        not block), and once now if events are already waiting. An asyncio server uses it to
        wake its loop (`loop.call_soon_threadsafe`) instead of parking a thread per request."""
        with self._cond:
            self._listeners.append(wake)
            pending = bool(self._items)
        if pending:
            wake()

    def take(self) -> list[Event]:
        """The events waiting now (maybe none), without blocking; the final one ends the list."""
        with self._cond:
            batch = list(self._items)
            self._items.clear()
        return batch

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """Yield events until the final one (inclusive).

        `timeout` bounds each wait (seconds); when it passes with nothing new, `queue.Empty` is
        raised and the caller may call `events()` again to go on where it stopped."""
        while True:
            with self._cond:
                if not self._items and not self._cond.wait_for(lambda: bool(self._items), timeout):
                    raise queue.Empty
                batch = list(self._items)
                self._items.clear()
            for event in batch:
                yield event
                if event.finish_reason is not None:
                    return

    def result(self, timeout: float | None = None) -> Event:
        """Wait for the end; one Event with all text and tokens and the finish reason."""
        if not self._done.wait(timeout):
            raise queue.Empty
        text, tokens = [], []
        last = Event()
        for ev in self.events(0):
            text.append(ev.text)
            tokens.extend(ev.token_ids)
            last = ev
        return Event("".join(text), tokens, last.finish_reason, last.error)


class QueueIntake:
    """The submit side both engines share: requests go on `_intake` for the worker thread.

    The engine sets `_intake`, `_lock`, `_closed` and a `counters` dict with a "requests" key."""

    _intake: queue.Queue[Any]
    _lock: threading.Lock
    _closed: bool
    counters: dict[str, int]

    def submit(self, request: Request) -> RequestHandle:
        handle = RequestHandle(request)
        with self._lock:
            if self._closed:
                raise InputError("the engine is closed; start a new one.")
            self.counters["requests"] += 1
            self._intake.put(handle)
        return handle

    def queued(self) -> int:
        """Requests submitted and not yet running (cheap: the server asks on every request)."""
        return self._intake.qsize()

    @property
    def closed(self) -> bool:
        return self._closed


class Engine(Protocol):
    """Thread-safe request intake over one model. `close()` finishes or cancels what is queued."""

    def submit(self, request: Request) -> RequestHandle: ...

    def queued(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    def close(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...


def check_request(
    request: Request, vocab: int, max_length: int
) -> tuple[np.ndarray, int, Sampler | None]:
    """A request's prompt [P] int64, its new-token budget within `max_length` KV positions, and
    its sampler (None: plain greedy, the graph's argmax); InputError with what to fix."""
    prompt = np.asarray([int(t) for t in request.prompt_ids], dtype=np.int64)
    if prompt.size == 0:
        raise InputError("the prompt has no tokens; give at least one.")
    if prompt.min() < 0 or prompt.max() >= vocab:
        raise InputError(f"prompt token ids must be in 0..{vocab - 1}.")
    if len(prompt) >= max_length:
        raise InputError(
            f"the prompt has {len(prompt)} tokens but the engine's context is "
            f"{max_length}; shorten it to at most {max_length - 1} tokens."
        )
    if request.max_new_tokens < 1:
        raise InputError("max_new_tokens must be at least 1.")
    config = request.sampling.validate()
    plain_greedy = config.greedy and config.plain
    sampler = None if plain_greedy else Sampler(config, vocab)
    return prompt, min(request.max_new_tokens, max_length - len(prompt)), sampler
