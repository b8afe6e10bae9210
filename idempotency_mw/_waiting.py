"""Requests that wait for another request's claim of their key to settle (``on_conflict="wait"``), instead of a 409.

A waiter names the claim it waits for by its fence, the random number the claim was given, which means nothing
outside the store: the notifications that carry it can be heard by any role that may LISTEN, and tell it nothing.
Waiters of one claim in one process share one event, which the settlement wakes: in process, the store's own
completion or release; across processes, the database's notification of it (``sql/queries.sql``: a completion or
release of a record that had duplicates notifies, and so does a transaction's COMMIT, after it). No waiter polls,
and none holds a connection while it waits.

A waiter subscribes first and checks after: it registers its event and makes sure the store listens, then claims
again. A settlement that came before the subscription is what that claim finds; one after it wakes the event. So
no waiter sleeps out its wait behind a settlement it missed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class Settled:
    """One waiter's subscription to the settlement of a claim (see :meth:`Waiters.watch`)."""

    def __init__(self, event: asyncio.Event) -> None:
        self._event = event

    async def wait(self, within: float) -> None:
        """Until the claim settles, or ``within`` seconds."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(within, 0)):
                await self._event.wait()


class Waiters:
    """The events waiters wait on, by the fence of the claim they wait for."""

    def __init__(self) -> None:
        self.events: dict[int, tuple[asyncio.Event, int]] = {}  # fence -> (event, waiters); empty: nobody waits

    @contextlib.asynccontextmanager
    async def watch(self, fence: int) -> AsyncIterator[Settled]:
        """Subscribe to the settlement of the claim under ``fence`` for as long as the block lasts."""
        event, count = self.events.get(fence, (None, 0))
        if event is None:
            event = asyncio.Event()
        self.events[fence] = (event, count + 1)
        try:
            yield Settled(event)
        finally:
            current = self.events.get(fence)
            if current is not None and current[0] is event:
                if current[1] <= 1:
                    del self.events[fence]
                else:
                    self.events[fence] = (event, current[1] - 1)

    def wake(self, fence: int) -> None:
        """The claim under ``fence`` settled (completed, released, fenced out, or taken over)."""
        found = self.events.pop(fence, None)
        if found is not None:
            found[0].set()

    def wake_all(self) -> None:
        """Every claim may have settled unheard (the connection that listened was lost): all claim again."""
        for event, _ in self.events.values():
            event.set()
        self.events.clear()
