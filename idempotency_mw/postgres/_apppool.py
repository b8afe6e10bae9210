"""The connectors of a store on an asyncpg pool of the app's: :class:`AppPool`, and :class:`Unbound` for a store
whose pool the app makes in its lifespan (``PostgresStore().bind(pool)``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, cast

import asyncpg

from idempotency_mw.postgres._connector import Listener
from idempotency_mw.postgres._lending import (
    Lender,
    PostgresTransaction,
    remember,
    reset_sql,
)
from idempotency_mw.postgres._records import Records, reachable, run_unprepared
from idempotency_mw.store import PoolExhausted, StoreUnavailable


class AppPool(Lender):
    """An asyncpg pool of the app's, which stays the app's (it is not closed here).

    Its sessions are the app's: nothing is set on them. The store learns their default isolation level once, and
    where it is not READ COMMITTED runs each statement in a READ COMMITTED transaction of its own (two more round
    trips: docs/operations.md). A connection lent to a handler comes back with the role and settings the pool's
    ``init`` gave it, read the first time it is lent.
    """

    def __init__(self, pool: asyncpg.Pool, sql: dict[str, str], schema: str, *, timeout: float) -> None:
        self.timeout = timeout
        self._pool = pool
        self._sql = sql
        self._schema = schema
        self.database_isolation: str | None = None
        self._explicit: bool | None = None
        self._ordinary = asyncio.Semaphore(max(1, pool.get_max_size() - 1))  # all but one connection
        self._holding_ordinary: set[int] = set()  # id() of the connections checked out under it

    async def open(self) -> None:
        pass  # the app opens its pool

    async def close(self) -> None:
        pass  # and closes it

    async def run(self, name: str, args: tuple[Any, ...], *, urgent: bool = False, status: bool = False) -> Any:
        connection = await self._acquire(urgent)
        try:
            with reachable(self._schema):
                if self._explicit is None:
                    self._explicit = await self._not_read_committed(connection)
                return await run_unprepared(connection, self._sql[name], args, self.timeout, status, self._explicit)
        finally:
            await self._release(connection)

    async def run_on(self, connection: asyncpg.Connection, name: str, args: tuple[Any, ...]) -> Any:
        with reachable(self._schema):
            if self._explicit is None:
                self._explicit = await self._not_read_committed(connection)
            return await run_unprepared(connection, self._sql[name], args, self.timeout, False, self._explicit)

    async def lend(self) -> asyncpg.Connection:
        connection = await self._acquire(False)
        try:
            with reachable():
                await remember(connection, time_limit=self.timeout)  # the pool's session state, to restore
        except BaseException:
            await self._release(connection)
            raise
        return connection

    def begin_isolation(self) -> str | None:
        return None  # the app's sessions keep their own default

    async def give_back(
        self, connection: asyncpg.Connection, *, lost: bool, then: str = "", clean: bool = False, keep: bool = True
    ) -> None:
        healthy = False
        try:
            if not lost and not connection.is_closed():
                # Ours first (the full reset, then the pool's init state); asyncpg's own follows on release. A
                # transaction the code left open (a BEGIN after the COMMIT) ends first: asyncpg's ROLLBACK on release
                # would otherwise undo the reset with it.
                rollback = "ROLLBACK;\n" if connection.is_in_transaction() else ""
                await connection.execute(rollback + reset_sql(connection) + "\n" + then, timeout=self.timeout)
                healthy = keep
        except Exception:  # lost, broken or busy: the pool must not hand this connection out again
            pass
        finally:
            if not healthy and not connection.is_closed():
                connection.terminate()
            await self._release(connection)

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[asyncpg.Connection]:
        connection = await self._acquire(False)
        try:
            yield connection
        except BaseException:
            connection.terminate()
            raise
        finally:
            await self._release(connection)

    @contextlib.asynccontextmanager
    async def listening(self, channel: str, notified: Listener) -> AsyncIterator[asyncpg.Connection | None]:
        """A connection of the store's own, made as the pool makes its own (its connect arguments, its ``init``),
        but not one of the pool's: held while requests wait, one of those would take a place of the work that
        finishes requests, and a lease could lapse behind it."""
        with reachable():
            async with asyncio.timeout(self.timeout):
                # asyncpg's own way of making a connection as the pool makes its own (private, and the same since
                # asyncpg 0.18; the suite runs it on the oldest asyncpg the package accepts).
                connection: asyncpg.Connection = await self._pool._get_new_connection()  # type: ignore[attr-defined]
        try:
            await connection.add_listener(channel, notified)
            yield connection
        finally:
            connection.terminate()

    async def _acquire(self, urgent: bool) -> asyncpg.Connection:
        """A connection within ``timeout``; ordinary work waits for its share first."""
        pool = self._pool
        deadline = asyncio.get_running_loop().time() + self.timeout
        if not urgent:
            try:
                async with asyncio.timeout_at(deadline):
                    await self._ordinary.acquire()
            except TimeoutError:
                raise self._exhausted() from None
        try:
            remaining = max(deadline - asyncio.get_running_loop().time(), 0.001)
            with reachable():
                try:
                    proxy = await pool.acquire(timeout=remaining)
                except TimeoutError:
                    # asyncpg's deadline covers waiting for a free connection and opening one: it was the wait if
                    # the pool is full and every connection is in use.
                    if pool.get_idle_size() == 0 and pool.get_size() >= pool.get_max_size():
                        raise self._exhausted() from None
                    raise
        except BaseException:
            if not urgent:
                self._ordinary.release()
            raise
        if not urgent:
            self._holding_ordinary.add(id(proxy))
        return cast(asyncpg.Connection, proxy)  # a pool's proxy: it has every method of a Connection

    async def _release(self, connection: asyncpg.Connection) -> None:
        if id(connection) in self._holding_ordinary:
            self._holding_ordinary.discard(id(connection))
            self._ordinary.release()
        with contextlib.suppress(Exception):  # a failed reset or a lost connection: asyncpg has terminated it
            await self._pool.release(cast(asyncpg.pool.PoolConnectionProxy, connection), timeout=self.timeout)

    def _exhausted(self) -> PoolExhausted:
        return PoolExhausted(
            "the asyncpg pool passed to PostgresStore", max_size=self._pool.get_max_size(), timeout=self.timeout
        )


class Unbound:
    """The connections of a store built without any (``PostgresStore()``), until it is given the app's pool at
    startup (``PostgresStore.bind``): every use of them before that says so."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.database_isolation: str | None = None

    @staticmethod
    def _unbound() -> StoreUnavailable:
        return StoreUnavailable(
            "this PostgresStore was built without a database URL or pool, and was not given the app's pool yet: "
            "call store.bind(pool) in the app's lifespan, before the store opens"
        )

    async def open(self) -> None:
        raise self._unbound()

    async def close(self) -> None:
        pass  # nothing was opened

    async def run(self, name: str, args: tuple[Any, ...], *, urgent: bool = False, status: bool = False) -> Any:
        raise self._unbound()

    def transaction(self, records: Records) -> contextlib.AbstractAsyncContextManager[PostgresTransaction]:
        raise self._unbound()

    def connection(self) -> contextlib.AbstractAsyncContextManager[asyncpg.Connection]:
        raise self._unbound()

    def session(self) -> contextlib.AbstractAsyncContextManager[asyncpg.Connection]:
        raise self._unbound()

    def listening(
        self, channel: str, notified: Listener
    ) -> contextlib.AbstractAsyncContextManager[asyncpg.Connection | None]:
        raise self._unbound()
