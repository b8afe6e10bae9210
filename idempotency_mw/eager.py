"""An eagerly started task, on Python 3.11 too: how the middleware settles a request (``IdempotentRequest._settle``)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any


def start_eagerly(coroutine: Coroutine[Any, Any, None]) -> asyncio.Future[None]:
    """Run ``coroutine`` in the calling task up to its first wait, then on in a task of its own; what Python 3.12
    calls an eagerly started task, for 3.11 too.

    The settlement must not be interrupted by a cancellation of the request, so whatever waits has to go on in a
    task of its own. Started as a task from the beginning, it cost two turns of the event loop even when it never
    waits (``MemoryStore``), measured at 35 µs per request (benchmarks/fixes.py); started here, a settlement that
    never waits costs no task at all, and one that waits for the database has already sent its statement when its
    task takes over. Nothing can cancel the part that runs here: a cancellation reaches a task only where it waits.
    """
    loop = asyncio.get_running_loop()
    try:
        waiting_on = coroutine.send(None)
    except StopIteration:
        done = loop.create_future()
        done.set_result(None)
        return done
    except BaseException as error:
        failed = loop.create_future()
        failed.set_exception(error)
        return failed
    return loop.create_task(_go_on(_Resumed(coroutine, waiting_on)))


async def _go_on(resumed: _Resumed) -> None:
    await resumed


class _Resumed:
    """A coroutine that has already run up to a wait, as an awaitable: the task that awaits it waits for what the
    coroutine was waiting on, then drives the coroutine on, exactly as if it had started it (results, errors and
    cancellations go through)."""

    def __init__(self, coroutine: Coroutine[Any, Any, None], waiting_on: Any) -> None:
        self.coroutine = coroutine
        self.waiting_on = waiting_on

    def __await__(self) -> Generator[Any, Any, None]:
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
                except StopIteration:
                    return
            else:
                try:
                    waiting_on = coroutine.send(sent)
                except StopIteration:
                    return
