"""Requests that wait for another request's claim of their key to settle (``on_conflict="wait"``), instead of a 409.

Waiters of one key in one process share one event, which the settlement wakes: in process, the store's own
completion or release; across processes, the database's notification of it (``sql/queries.sql``: a completion or
release of a record that had duplicates notifies). No waiter polls, and none holds a connection while it waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from idempotency_mw.store import Claim, ClaimOutcome

if TYPE_CHECKING:
    from idempotency_mw.connectors import Connector

CHANNEL = "idempotency_mw_settled"  # the LISTEN/NOTIFY channel; payloads are "<schema>:<tag>"


def settlement_tag(tenant: str, key: str) -> str:
    """What a notification names a record by: as ``sql/queries.sql`` computes it (the tenant's length in characters
    first, so that no two (tenant, key) pairs meet)."""
    return hashlib.sha256(f"{len(tenant)}:{tenant}{key}".encode()).hexdigest()[:32]


async def claim_or_wait(
    claim: Callable[[], Awaitable[Claim]], wait: Callable[[float], Awaitable[None]], within: float
) -> Claim:
    """The ``claim``; while another request runs under its key, claimed again each time ``wait`` says that request
    may have settled, for ``within`` seconds at most."""
    claimed = await claim()
    if claimed.outcome is not ClaimOutcome.IN_PROGRESS:
        return claimed
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while claimed.outcome is ClaimOutcome.IN_PROGRESS and (left := deadline - loop.time()) > 0:
        await wait(left)
        claimed = await claim()
    return claimed


class Waiters:
    """The events waiters of each record wait on, by :func:`settlement_tag`."""

    def __init__(self) -> None:
        self._events: dict[str, tuple[asyncio.Event, int]] = {}  # tag -> (event, waiters)

    async def wait(self, tenant: str, key: str, within: float) -> None:
        """Until the record's claim settles, or ``within`` seconds."""
        tag = settlement_tag(tenant, key)
        event, count = self._events.get(tag, (None, 0))
        if event is None:
            event = asyncio.Event()
        self._events[tag] = (event, count + 1)
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(within):
                    await event.wait()
        finally:
            current = self._events.get(tag)
            if current is not None and current[0] is event:
                if current[1] <= 1:
                    del self._events[tag]
                else:
                    self._events[tag] = (event, current[1] - 1)

    def wake(self, tenant: str, key: str) -> None:
        """The record's claim settled here (completed, released, or fenced out)."""
        if self._events:  # with nobody waiting there is no tag to compute
            self.wake_tag(settlement_tag(tenant, key))

    def wake_tag(self, tag: str) -> None:
        found = self._events.pop(tag, None)
        if found is not None:
            found[0].set()

    @property
    def waiting(self) -> bool:
        return bool(self._events)


class SettlementListener:
    """Other processes' settlements, heard on one connection that LISTENs on :data:`CHANNEL` and wakes the
    :class:`Waiters` they concern: started by the first wait, held until :meth:`stop` or until the connection is lost
    (the next wait then starts it again). Where no session can listen (behind a transaction-pooling proxy), waiters
    wake at their deadline."""

    def __init__(self, connector: Connector, schema: str, waiters: Waiters) -> None:
        self._connector = connector
        self._prefix = f"{schema}:"
        self._waiters = waiters
        self._task: asyncio.Task[None] | None = None
        self._ended = asyncio.Event()

    def start(self) -> None:
        """Listen, unless listening already."""
        if self._task is None or self._task.done():
            self._ended = asyncio.Event()
            self._task = asyncio.ensure_future(self._listen(self._ended))

    async def stop(self, within: float) -> None:
        """Stop listening, waiting ``within`` seconds at most for the connection to close."""
        self._ended.set()
        if self._task is not None:
            await asyncio.wait({self._task}, timeout=within)
            self._task = None

    def _notified(self, connection: object, pid: int, channel: str, payload: object) -> None:
        if isinstance(payload, str) and payload.startswith(self._prefix):
            self._waiters.wake_tag(payload[len(self._prefix) :])

    async def _listen(self, ended: asyncio.Event) -> None:
        async with self._connector.listening(CHANNEL, self._notified) as connection:
            if connection is not None:
                connection.add_termination_listener(lambda _: ended.set())
            await ended.wait()
