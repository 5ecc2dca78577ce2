"""The engine's thread meets the event loop: await a request's events without a thread per request.

The engine pushes events on its own thread (runtime/engine/base.RequestHandle). Each handle gets
a listener that schedules `asyncio.Event.set` on the loop (`call_soon_threadsafe`, never
blocking the engine); the coroutine then takes whatever events are waiting. Several handles (the
`n` choices of one request) share one wake-up, so a request costs one coroutine, not n.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence

from specport.runtime.engine.base import Event, RequestHandle


def _waker(loop: asyncio.AbstractEventLoop, wake: asyncio.Event) -> Callable[[], None]:
    def fire() -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
            loop.call_soon_threadsafe(wake.set)

    return fire


async def merged_events(
    handles: Sequence[RequestHandle], deadline: float | None = None
) -> AsyncIterator[tuple[int, Event]]:
    """(choice index, event) from all `handles` as they arrive, until every one has finished.

    `deadline` (the loop's clock): past it, `asyncio.TimeoutError` is raised instead of
    waiting on. Cancelling the consumer (client gone) leaves the handles as they are: the caller cancels
    them (see app.py), so the engine stops working for nobody."""
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    fire = _waker(loop, wake)
    for handle in handles:
        handle.add_listener(fire)
    open_ = set(range(len(handles)))
    while open_:
        wake.clear()
        got = False
        for i in sorted(open_):
            for event in handles[i].take():
                got = True
                yield i, event
                if event.finish_reason is not None:
                    open_.discard(i)
                    break
        if open_ and not got:
            await _wait(wake, loop, deadline)


async def first_output(handle: RequestHandle, deadline: float | None = None) -> None:
    """Wait (without taking any event) until `handle` has produced a token or finished
    (`asyncio.TimeoutError` past `deadline`)."""
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    handle.add_listener(_waker(loop, wake))
    while handle.first_token_at is None and not handle.done:
        await _wait(wake, loop, deadline)
        wake.clear()


async def _wait(
    wake: asyncio.Event, loop: asyncio.AbstractEventLoop, deadline: float | None
) -> None:
    if deadline is None:
        await wake.wait()
        return
    left = deadline - loop.time()
    if left <= 0:
        raise asyncio.TimeoutError
    await asyncio.wait_for(wake.wait(), left)  # asyncio.TimeoutError when it passes
