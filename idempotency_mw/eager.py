"""The claim and the settlement of a request run in tasks of their own, which a cancellation of the request cannot
stop, started eagerly where Python can.

Both must outlive a cancellation of the request (a server shutting down, an outer timeout), so whatever waits goes
on in a task of its own (started in ``IdempotentRequest._claim`` and ``PlainRun.start_settling``), and the request
waits for it through :func:`outlasting`. On Python 3.12 and later the task starts eagerly: it runs in the caller's
turn of the event loop up to its first wait, so one that never waits (``MemoryStore``) is done at once, and one that
waits for the database has already sent its statement. Python 3.11 has no eager tasks; there the task starts at the
loop's next turn.

Why not emulate eager start on 3.11 by driving the coroutine by hand until it first waits: code that captures the
current task before that wait (``asyncio.timeout``, which the store's pool uses while waiting for a connection)
would then cancel the request's task instead of its own. A real eager task is current while it runs.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from functools import partial
from typing import Any, TypeVar

T = TypeVar("T")


def start_eagerly(coroutine: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
    """A task running ``coroutine``: started eagerly on Python 3.12+, at the loop's next turn on 3.11."""
    loop = asyncio.get_running_loop()
    if sys.version_info >= (3, 12):
        return asyncio.Task(coroutine, loop=loop, name=name, eager_start=True)
    return asyncio.Task(coroutine, loop=loop, name=name)


def outlasting(task: asyncio.Future[T]) -> asyncio.Future[T]:
    """What ``task`` ends with, to wait for: cancelling the wait leaves ``task`` running (``asyncio.shield``, minus
    its argument checks and its second turn of the loop). An error nobody reads after a cancelled wait is marked
    read, so that asyncio does not log it as lost."""
    if task.done():
        return task
    follower: asyncio.Future[T] = task.get_loop().create_future()
    task.add_done_callback(partial(_pass_on, follower))
    return follower


def _pass_on(follower: asyncio.Future[T], task: asyncio.Future[T]) -> None:
    if follower.cancelled():  # the waiter was cancelled: the outcome is the task's owner's to read
        if not task.cancelled():
            task.exception()  # marked as read, or asyncio would log an error that nobody retrieved
        return
    if task.cancelled():
        follower.cancel()
    elif (error := task.exception()) is not None:
        follower.set_exception(error)
    else:
        follower.set_result(task.result())
