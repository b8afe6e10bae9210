"""Other processes' settlements, heard through LISTEN, for the requests that wait in this one
(``on_conflict="wait"``, ``idempotency_mw._waiting``)."""

from __future__ import annotations

import asyncio

import asyncpg

from idempotency_mw._waiting import Waiters
from idempotency_mw.postgres._connector import Connector

CHANNEL = "idempotency_mw_settled"  # the LISTEN/NOTIFY channel (sql/queries.sql); payloads are "<schema>:<fence>"
PROBE_EVERY = 5.0  # seconds between the listening connection's checks that it is still there


class SettlementListener:
    """Other processes' settlements, heard on one connection of the store's own that LISTENs on :data:`CHANNEL` and
    wakes the :class:`Waiters` they concern: started by the first waiter (who waits until it listens), held until
    :meth:`stop` or until the connection is lost. A lost connection wakes every waiter, since what was notified
    meanwhile went unheard: each claims again and, still waiting, subscribes again, which listens again. A connection
    dropped without a word (a NAT's or a load balancer's idle timeout, a server gone with its host: no FIN, no RST)
    would never end by itself, so the listener asks it every :data:`PROBE_EVERY` seconds whether it is there (which
    also keeps such an idle timeout from coming), and takes one that does not answer within the store's timeout
    for lost. Where no
    session can listen (behind a transaction-pooling proxy), waiters wake at their deadline, or when a settlement in
    their own process wakes them."""

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
        lost = False

        def terminated(_: object) -> None:
            nonlocal lost
            lost = lost or not ended.is_set()  # set already: stopped, and the connection closed for it
            ended.set()

        try:
            async with self._connector.listening(CHANNEL, self._notified) as connection:
                if connection is not None:
                    connection.add_termination_listener(terminated)
                listening.set_result(None)
                if connection is None:
                    await ended.wait()
                elif not await self._answers_until(connection, ended):
                    lost = not ended.is_set()
        finally:
            if not listening.done():
                listening.set_result(None)  # it could not listen: nobody waits for it
            if lost:
                self._waiters.wake_all()

    async def _answers_until(self, connection: asyncpg.Connection, ended: asyncio.Event) -> bool:
        """Wait until ``ended``, asking ``connection`` every :data:`PROBE_EVERY` seconds whether it is there: True
        once ended, False as soon as it does not answer within the store's timeout."""
        while True:
            try:
                async with asyncio.timeout(PROBE_EVERY):
                    await ended.wait()
                return True
            except TimeoutError:
                pass
            try:
                await connection.fetchval("SELECT 1", timeout=self._connector.timeout)
            except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError):
                return False
