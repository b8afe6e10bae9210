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
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from idempotency_mw.store import Claim, ClaimOutcome, Subscription

if TYPE_CHECKING:
    from idempotency_mw.connectors import Connector

CHANNEL = "idempotency_mw_settled"  # the LISTEN/NOTIFY channel; payloads are "<schema>:<fence>"

Watch = Callable[[int], contextlib.AbstractAsyncContextManager[Subscription]]


async def claim_or_wait(claim: Callable[[], Awaitable[Claim]], watch: Watch, within: float) -> Claim:
    """The ``claim``; while another request runs under its key, watch that request's claim (``watch(fence)``), check
    again, and wait for it to settle, then claim again; for ``within`` seconds at most."""
    claimed = await claim()
    if claimed.outcome is not ClaimOutcome.IN_PROGRESS:
        return claimed
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while claimed.outcome is ClaimOutcome.IN_PROGRESS and deadline > loop.time():
        running = claimed.fence
        async with watch(running) as settled:
            claimed = await claim()  # subscribed: a settlement before this is found here, one after wakes us
            if claimed.outcome is ClaimOutcome.IN_PROGRESS and claimed.fence == running:
                await settled.wait(deadline - loop.time())
                claimed = await claim()
    return claimed


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
        self._events: dict[int, tuple[asyncio.Event, int]] = {}  # fence -> (event, waiters)

    @contextlib.asynccontextmanager
    async def watch(self, fence: int) -> AsyncIterator[Settled]:
        """Subscribe to the settlement of the claim under ``fence`` for as long as the block lasts."""
        event, count = self._events.get(fence, (None, 0))
        if event is None:
            event = asyncio.Event()
        self._events[fence] = (event, count + 1)
        try:
            yield Settled(event)
        finally:
            current = self._events.get(fence)
            if current is not None and current[0] is event:
                if current[1] <= 1:
                    del self._events[fence]
                else:
                    self._events[fence] = (event, current[1] - 1)

    def wake(self, fence: int) -> None:
        """The claim under ``fence`` settled (completed, released, fenced out, or taken over)."""
        found = self._events.pop(fence, None)
        if found is not None:
            found[0].set()

    @property
    def waiting(self) -> bool:
        return bool(self._events)


class SettlementListener:
    """Other processes' settlements, heard on one connection of the store's own that LISTENs on :data:`CHANNEL` and
    wakes the :class:`Waiters` they concern: started by the first waiter (who waits until it listens), held until
    :meth:`stop` or until the connection is lost (the next waiter then starts it again). Where no session can listen
    (behind a transaction-pooling proxy), waiters wake at their deadline, or when a settlement in their own process
    wakes them."""

    def __init__(self, connector: Connector, schema: str, waiters: Waiters) -> None:
        self._connector = connector
        self._prefix = f"{schema}:"
        self._waiters = waiters
        self._task: asyncio.Task[None] | None = None
        self._ended = asyncio.Event()
        self._listening: asyncio.Future[None] | None = None

    async def listen(self, within: float) -> None:
        """Return once the store listens (or cannot: a proxy, a database out of reach), ``within`` seconds at most:
        started here unless it is already."""
        if self._task is None or self._task.done():
            self._ended = asyncio.Event()
            self._listening = asyncio.get_running_loop().create_future()
            self._task = asyncio.ensure_future(self._listen(self._ended, self._listening))
        assert self._listening is not None
        await asyncio.wait({self._listening, self._task}, timeout=within, return_when=asyncio.FIRST_COMPLETED)

    async def stop(self, within: float) -> None:
        """Stop listening, waiting ``within`` seconds at most for the connection to close."""
        self._ended.set()
        if self._task is not None:
            await asyncio.wait({self._task}, timeout=within)
            self._task = None

    def _notified(self, connection: object, pid: int, channel: str, payload: object) -> None:
        if isinstance(payload, str) and payload.startswith(self._prefix):
            fence = payload[len(self._prefix) :]
            if fence.isdigit():
                self._waiters.wake(int(fence))

    async def _listen(self, ended: asyncio.Event, listening: asyncio.Future[None]) -> None:
        try:
            async with self._connector.listening(CHANNEL, self._notified) as connection:
                if connection is not None:
                    connection.add_termination_listener(lambda _: ended.set())
                listening.set_result(None)
                await ended.wait()
        finally:
            if not listening.done():
                listening.set_result(None)  # it could not listen: nobody waits for it
