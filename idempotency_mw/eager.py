"""Start the claim and the settlement of a request in tasks of their own, eagerly where Python can.

Both must outlive a cancellation of the request (a server shutting down, an outer timeout), so whatever waits goes
on in a task of its own (``IdempotentRequest._run`` and ``_settle``). On Python 3.12 and later the task starts
eagerly: it runs in the caller's turn of the event loop up to its first wait, so one that never waits
(``MemoryStore``) is done at once and costs no turn of the loop, and one that waits for the database has already
sent its statement. Python 3.11 has no eager tasks; there the task starts at the loop's next turn.

Why not emulate eager start on 3.11 by driving the coroutine by hand until it first waits: code that captures the
current task before that wait (``asyncio.timeout``, which the store's pool uses while waiting for a connection)
would then cancel the request's task instead of its own. A real eager task is current while it runs.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def start_eagerly(coroutine: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """A task running ``coroutine``: started eagerly on Python 3.12+, at the loop's next turn on 3.11."""
    loop = asyncio.get_running_loop()
    if sys.version_info >= (3, 12):
        return asyncio.Task(coroutine, loop=loop, eager_start=True)
    return loop.create_task(coroutine)
