"""Eagerly started tasks, on Python 3.11 too: how the middleware sends its claim and settles a request, so that a
cancellation of the request cannot interrupt them (``IdempotentRequest._run`` and ``_settle``)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any, Generic, TypeVar, cast

T = TypeVar("T")


def start_eagerly(coroutine: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
    """Run ``coroutine`` in the calling task up to its first wait, then on in a task of its own; what Python 3.12
    calls an eagerly started task, for 3.11 too.

    The claim and the settlement must not be interrupted by a cancellation of the request, so whatever waits has to
    go on in a task of its own. Started as a task from the beginning, each cost two turns of the event loop even
    when it never waits (``MemoryStore``), measured at 35 µs per request (benchmarks/fixes.py); started here, one
    that never waits costs no task at all, and one that waits for the database has already sent its statement
    when its task takes over. Nothing can cancel the part that runs here: a cancellation reaches a task only where
    it waits.
    """
    loop = asyncio.get_running_loop()
    try:
        waiting_on = coroutine.send(None)
    except StopIteration as finished:
        done: asyncio.Future[T] = loop.create_future()
        done.set_result(cast(T, finished.value))
        return done
    except BaseException as error:
        failed: asyncio.Future[T] = loop.create_future()
        failed.set_exception(error)
        return failed
    return loop.create_task(_go_on(_Resumed(coroutine, waiting_on)))


async def _go_on(resumed: _Resumed[T]) -> T:
    return await resumed


class _Resumed(Generic[T]):
    """A coroutine that has already run up to a wait, as an awaitable: the task that awaits it waits for what the
    coroutine was waiting on, then drives the coroutine on, exactly as if it had started it (results, errors and
    cancellations go through)."""

    def __init__(self, coroutine: Coroutine[Any, Any, T], waiting_on: Any) -> None:
        self.coroutine = coroutine
        self.waiting_on = waiting_on

    def __await__(self) -> Generator[Any, Any, T]:
        coroutine, waiting_on = self.coroutine, self.waiting_on
        while True:
            try:
                sent = yield waiting_on
            except GeneratorExit:
                coroutine.close()
                raise
            except BaseException as error:  # thrown in by the task: a cancellation, or the awaited future's error
                try:
                    waiting_on = coroutine.throw(error)
                except StopIteration as finished:
                    return cast(T, finished.value)
            else:
                try:
                    waiting_on = coroutine.send(sent)
                except StopIteration as finished:
                    return cast(T, finished.value)
