"""The connection pool a :class:`~idempotency_mw.postgres.PostgresStore` opens from a DSN.

Why not asyncpg's ``Pool``: a checkout there costs more CPU than the statement it wraps (measured: about 60 µs per
acquire and release on top of a 50 µs ``SELECT 1``, from a task for the acquire timeout, another for the shielded
release, a proxy object and an inactivity timer), and a fresh request checks out twice. Its waiters are not
served in arrival order either, which stretches the p99 once requests outnumber connections.

Here a checkout of an idle connection is a list pop, a check-in is an append or a hand-over to the oldest waiter,
and only a checkout that has to wait or connect sets a timer. What asyncpg's pool also does and this one does
not: per-connection setup hooks, closing idle connections after a while, ``max_queries``. A connection that saw
any error is closed rather than reused: our statements never leave one in a state worth repairing.
"""

from __future__ import annotations

import asyncio
import collections

import asyncpg


class PoolClosed(asyncpg.exceptions.InterfaceError):
    """The pool was closed while a checkout was waiting, or before it."""


class ConnectionPool:
    """At most ``max_size`` connections to ``dsn``, opened on demand; ``open()`` opens ``min_size`` ahead.

    ``timeout`` bounds a checkout (waiting for a free connection, or opening one), in seconds.
    """

    def __init__(self, dsn: str, *, min_size: int, max_size: int, timeout: float) -> None:
        if not 0 <= min_size <= max_size or max_size < 1:
            raise ValueError(f"pool sizes must satisfy 0 <= min_size <= max_size >= 1, got {min_size}, {max_size}")
        self.dsn = dsn
        self.min_size = min_size
        self.max_size = max_size
        self.timeout = timeout
        self._idle: list[asyncpg.Connection] = []
        self._waiters: collections.deque[asyncio.Future[asyncpg.Connection | None]] = collections.deque()
        self._size = 0  # connections open, in use or idle, plus those being opened
        self._closed = False

    @property
    def size(self) -> int:
        return self._size

    @property
    def idle(self) -> int:
        return len(self._idle)

    async def open(self) -> None:
        """Open connections up to ``min_size`` (a dead server fails here, at startup, instead of at a request)."""
        while self._size < self.min_size and not self._closed:
            self._size += 1
            try:
                connection = await self._connect()
            except BaseException:
                self._size -= 1
                raise
            self.release(connection)

    async def acquire(self) -> asyncpg.Connection:
        while self._idle:
            connection = self._idle.pop()  # the most recently used: its server backend is the warmest
            if not connection.is_closed():
                return connection
            self._size -= 1  # the server closed it while it was idle (a restart, an admin): forget it
        async with asyncio.timeout(self.timeout):
            return await self._wait_or_connect()

    def release(self, connection: asyncpg.Connection, *, broken: bool = False) -> None:
        """Give a connection back; ``broken`` (it saw an error) closes it instead, and frees its place."""
        if broken or self._closed or connection.is_closed():
            connection.terminate()
            self._size -= 1
            self._wake(None)  # a waiter may open a connection in its place
            return
        if not self._wake(connection):
            self._idle.append(connection)

    async def close(self) -> None:
        """Close the idle connections now, the others as they come back; waiting checkouts fail."""
        self._closed = True
        idle, self._idle = self._idle, []
        self._size -= len(idle)
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(PoolClosed("the idempotency store's pool was closed"))
        await asyncio.gather(*(connection.close(timeout=self.timeout) for connection in idle), return_exceptions=True)

    async def _wait_or_connect(self) -> asyncpg.Connection:
        while True:
            if self._closed:
                raise PoolClosed("the idempotency store's pool is closed")
            if self._idle:
                connection = self._idle.pop()
                if not connection.is_closed():
                    return connection
                self._size -= 1
                continue
            if self._size < self.max_size:
                self._size += 1
                try:
                    return await self._connect()
                except BaseException:
                    self._size -= 1
                    self._wake(None)
                    raise
            waiter: asyncio.Future[asyncpg.Connection | None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                handed = await waiter
            except BaseException:
                # Timed out or cancelled. A connection handed over in the same instant must not be lost with us.
                if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                    late = waiter.result()
                    if late is not None:
                        self.release(late)
                    else:
                        self._wake(None)
                else:
                    waiter.cancel()
                raise
            if handed is not None:
                return handed
            # A place was freed (a connection closed): loop to open one, unless someone was quicker.

    def _wake(self, connection: asyncpg.Connection | None) -> bool:
        """Hand ``connection`` (or, with None, a freed place) to the oldest waiter still waiting."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(connection)
                return True
        return False

    async def _connect(self) -> asyncpg.Connection:
        connection: asyncpg.Connection = await asyncpg.connect(self.dsn, timeout=self.timeout)
        return connection
