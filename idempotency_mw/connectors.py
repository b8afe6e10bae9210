"""Where a :class:`~idempotency_mw.postgres.PostgresStore`'s connections come from: a pool of its own, or the app's
asyncpg pool, chosen once when the store is built.

Both keep the same promises, so the store above never asks which one it has (procrastinate's connector is the
model):

- the store's statements run under READ COMMITTED whatever the database's default isolation level
  (``sql/session.sql``), and a statement's deadline is the store's ``timeout``;
- claims and lent transactions take all but one of the pool's connections: the last one stays for the work that
  finishes requests (renewals, completions, releases), which a burst of new requests or handlers holding every
  connection must not keep waiting until a lease lapses;
- a connection lent to a handler comes back as the pool gave it (``lending.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Protocol, cast

import asyncpg

from idempotency_mw.connections import NO_TIMEOUT, ConnectionPool
from idempotency_mw.lending import LentConnection, remember, reset_sql, set_restore
from idempotency_mw.sql import session
from idempotency_mw.store import PoolExhausted, StoreNotMigrated, StoreUnavailable

# What "the store cannot be reached" looks like from asyncpg: connection failures, a server shutting down,
# deadlines. Errors in our own SQL surface as they are, except a missing table (see NOT_MIGRATED).
# A lost COMMIT (TransactionResolutionUnknownError, SQLSTATE 08007) is among them: the retry then finds the record
# completed (and replays) or gone (and runs), so answering 503 and releasing the key is right either way.
UNAVAILABLE = (
    OSError,
    TimeoutError,
    asyncpg.exceptions.PostgresConnectionError,  # SQLSTATE class 08, connection lost or refused
    asyncpg.exceptions.InterfaceError,  # "connection is closed", a closed pool, an operation on a lost connection
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.CrashShutdownError,
    asyncpg.exceptions.TooManyConnectionsError,
    asyncpg.exceptions.QueryCanceledError,
    # A statement sent on a connection whose server process was just terminated (pg_terminate_backend, a
    # failover): the server's FATAL error has arrived but the socket is not closed yet, and asyncpg, still in the
    # middle of that error, refuses the statement with "cannot switch to state 11; another operation (2) is in
    # progress". asyncpg raises this class for any client state it did not expect; a connection that saw it is
    # closed, never reused, so a retry runs on a fresh one.
    asyncpg.exceptions.InternalClientError,
)

# What "the store's tables are not there" looks like: a table or sequence (42P01) or the schema itself (3F000)
# does not exist. The store's statements name nothing else, so this means "not migrated" (or the wrong schema).
NOT_MIGRATED = (asyncpg.exceptions.UndefinedTableError, asyncpg.exceptions.InvalidSchemaNameError)

# asyncpg's names of the isolation levels, by PostgreSQL's.
ASYNCPG_ISOLATION = {
    "read committed": "read_committed",
    "repeatable read": "repeatable_read",
    "serializable": "serializable",
    "read uncommitted": "read_uncommitted",
}

PIN_RESTORE = "SELECT set_config('default_transaction_isolation', 'read committed', false);"

Listener = Callable[[Any, int, str, object], None]  # asyncpg's: (connection, pid, channel, payload)


@contextlib.contextmanager
def reachable(schema: str | None = None) -> Iterator[None]:
    """Turn "the database cannot be reached" (see ``UNAVAILABLE``) into :class:`StoreUnavailable` and, around the
    store's own statements in ``schema``, "the tables are missing" into :class:`StoreNotMigrated`; let the rest be.
    """
    try:
        yield
    except UNAVAILABLE as error:
        raise StoreUnavailable(str(error) or type(error).__name__) from error
    except NOT_MIGRATED as error:
        if schema is None:
            raise
        raise StoreNotMigrated(schema, str(error)) from error


class Connector(Protocol):
    """What a PostgresStore asks of where its connections come from."""

    timeout: float
    database_isolation: str | None  # the default isolation level of the database's sessions, once known

    async def open(self) -> None:
        """Connect ahead, where the pool is the store's own."""

    async def close(self) -> None:
        """Close what the store opened itself (an app's pool is the app's to close)."""

    async def run(self, name: str, args: tuple[Any, ...], *, urgent: bool = False, status: bool = False) -> Any:
        """One of the store's statements on a connection of its own: its first row, or with ``status`` its status
        ("UPDATE 1"). ``urgent``: it finishes a request, and goes before new claims for a connection."""

    async def run_on(self, connection: asyncpg.Connection, name: str, args: tuple[Any, ...]) -> Any:
        """One of the store's statements, its first row, on a connection lent from this connector, outside a
        transaction (the claim of a transactional request, taken on the connection its transaction then uses)."""

    async def lend(self) -> asyncpg.Connection:
        """A connection for code other than the store's (a handler's transaction), from the share of ordinary
        work; :class:`PoolExhausted` when none comes free in time."""

    def begin_isolation(self) -> str | None:
        """The isolation level (asyncpg's spelling) to begin a lent connection's transaction with, when its session
        default is not the database's; None to begin with the session's default."""

    async def give_back(self, connection: asyncpg.Connection, *, lost: bool, then: str = "") -> None:
        """Take a lent connection back as its pool gave it; closed if ``lost`` or if its reset fails. ``then`` is SQL
        to run after the reset, in its round trip (``notify_waiters``, after a transactional request's COMMIT)."""

    def session(self) -> contextlib.AbstractAsyncContextManager[asyncpg.Connection]:
        """A connection for the store's own multi-statement work (migrations); closed after an error."""

    def listening(
        self, channel: str, notified: Listener
    ) -> contextlib.AbstractAsyncContextManager[asyncpg.Connection | None]:
        """A connection that LISTENs on ``channel`` (``notified`` gets each notification) for as long as the block
        lasts; None where no session can listen (a transaction-pooling proxy)."""


@contextlib.asynccontextmanager
async def lent_connection(connector: Connector) -> AsyncIterator[asyncpg.Connection]:
    """A connection of ``connector``'s for code other than the store's, at the database's default isolation level:
    it comes back as its pool gave it, whatever the code did to it, and refuses use once the block has ended."""
    connection = await connector.lend()
    lent = LentConnection(connection)
    lost = False
    try:
        if connector.begin_isolation() is not None:  # the store's own session reads READ COMMITTED
            with reachable():
                await connection.execute(
                    "SELECT set_config('default_transaction_isolation', $1, false)",
                    connector.database_isolation,
                    timeout=connector.timeout,
                )
        yield cast(asyncpg.Connection, lent)
    except BaseException as error:
        lost = isinstance(error, (*UNAVAILABLE, StoreUnavailable))  # no reset for a connection that is gone
        raise
    finally:
        lent.end()
        await connector.give_back(connection, lost=lost)


class OwnPool:
    """The connections a DSN-built store opens (``connections.py``), each pinned to READ COMMITTED as it opens.

    Every request runs two statements here: an idle connection is taken without a coroutine, the statement runs as a
    prepared-statement object kept on the connection, and its deadline is kept by the pool's one timer
    (``connections.Deadlines``).

    ``prepared_statements=False`` (a transaction-pooling proxy in front of the server) keeps no prepared statement
    and sets nothing on the sessions, which such a proxy would hand to other clients: there the store learns the
    database's default level and, when it is not READ COMMITTED, runs each statement in a READ COMMITTED
    transaction of its own.
    """

    def __init__(
        self,
        dsn: str,
        sql: dict[str, str],
        schema: str,
        *,
        timeout: float,
        min_size: int,
        max_size: int,
        prepared_statements: bool,
    ) -> None:
        self.timeout = timeout
        self._sql = sql
        self._schema = schema
        self._prepare = prepared_statements
        self.pool = ConnectionPool(
            dsn,
            min_size=min_size,
            max_size=max_size,
            timeout=timeout,
            connection_class=StoreConnection,
            prepared_statements=prepared_statements,
            setup=self._pin if prepared_statements else None,
        )
        self.database_isolation: str | None = None  # the database's default level, once a connection has told it
        # Whether each statement needs a READ COMMITTED transaction of its own (None: not known yet).
        self._explicit: bool | None = False if prepared_statements else None

    async def open(self) -> None:
        if self.pool.closed:  # opened again after a close: its connections may belong to an event loop that is gone
            self.pool = self.pool.fresh()
        with reachable():
            await self.pool.open()

    async def close(self) -> None:
        await self.pool.close()

    def _release(self, connection: asyncpg.Connection, *, broken: bool = False) -> None:
        """Back to the pool it came from: out when the store closed and back after it opened again, it is closed."""
        if self.pool.owns(connection):
            self.pool.release(connection, broken=broken)
        else:
            connection.terminate()

    async def _pin(self, connection: asyncpg.Connection) -> None:
        self.database_isolation = await connection.fetchval(session()["pin_read_committed"], timeout=self.timeout)
        set_restore(connection, PIN_RESTORE)

    async def run(self, name: str, args: tuple[Any, ...], *, urgent: bool = False, status: bool = False) -> Any:
        pool = self.pool
        connection = pool.take(urgent)
        if connection is None:
            with reachable():
                connection = await pool.acquire(urgent=urgent)
        result: Any
        try:
            if self._prepare:
                statements = connection.statements  # type: ignore[attr-defined]  # a StoreConnection
                statement = statements.get(name)
                if statement is None:
                    statement = statements[name] = await connection.prepare(self._sql[name])
                pool.deadlines.start(connection)
                try:
                    result = await statement.fetchrow(*args, timeout=NO_TIMEOUT)
                finally:
                    pool.deadlines.finish(connection)
                if status:
                    result = statement.get_statusmsg()
            else:
                if self._explicit is None:
                    self._explicit = await _not_read_committed(self, connection)
                result = await _run_unprepared(connection, self._sql[name], args, self.timeout, status, self._explicit)
        except UNAVAILABLE as error:
            pool.release(connection, broken=True)
            if pool.deadlines.was_late(connection):
                late = TimeoutError(f"the database did not answer within {self.timeout}s")
                raise StoreUnavailable(str(late)) from late
            raise StoreUnavailable(str(error) or type(error).__name__) from error
        except NOT_MIGRATED as error:
            pool.release(connection, broken=True)
            raise StoreNotMigrated(self._schema, str(error)) from error
        except BaseException:
            pool.release(connection, broken=True)
            raise
        pool.release(connection)
        return result

    async def run_on(self, connection: asyncpg.Connection, name: str, args: tuple[Any, ...]) -> Any:
        with reachable(self._schema):
            if self._explicit is None:
                self._explicit = await _not_read_committed(self, connection)
            return await _run_unprepared(connection, self._sql[name], args, self.timeout, False, self._explicit)

    async def lend(self) -> asyncpg.Connection:
        with reachable():
            return await self.pool.acquire()

    def begin_isolation(self) -> str | None:
        level = self.database_isolation
        if not self._prepare or level in (None, "read committed"):
            return None  # the session's default is the database's
        return ASYNCPG_ISOLATION[level]

    async def give_back(self, connection: asyncpg.Connection, *, lost: bool, then: str = "") -> None:
        healthy = False
        try:
            if not lost and not connection.is_closed():
                # StoreConnection.get_reset_query: the full reset, then the pin again, then ``then``; one round trip.
                connection.then = then  # type: ignore[attr-defined]  # a StoreConnection
                await connection.reset(timeout=self.timeout)
                healthy = True
        except Exception:  # lost, broken or busy: a fresh connection is cheaper than a doubtful one
            pass
        finally:
            self._release(connection, broken=not healthy)

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[asyncpg.Connection]:
        with reachable():
            connection = await self.pool.acquire()
        broken = True
        try:
            yield connection
            broken = False
        finally:
            self._release(connection, broken=broken)

    @contextlib.asynccontextmanager
    async def listening(self, channel: str, notified: Listener) -> AsyncIterator[asyncpg.Connection | None]:
        if not self._prepare:  # behind a transaction-pooling proxy: a LISTEN would outlive no transaction
            yield None
            return
        with reachable():
            connection: asyncpg.Connection = await asyncpg.connect(self.pool.dsn, timeout=self.timeout)
        try:
            await connection.add_listener(channel, notified)
            yield connection
        finally:
            connection.terminate()


class AppPool:
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
                    self._explicit = await _not_read_committed(self, connection)
                return await _run_unprepared(connection, self._sql[name], args, self.timeout, status, self._explicit)
        finally:
            await self._release(connection)

    async def run_on(self, connection: asyncpg.Connection, name: str, args: tuple[Any, ...]) -> Any:
        with reachable(self._schema):
            if self._explicit is None:
                self._explicit = await _not_read_committed(self, connection)
            return await _run_unprepared(connection, self._sql[name], args, self.timeout, False, self._explicit)

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

    async def give_back(self, connection: asyncpg.Connection, *, lost: bool, then: str = "") -> None:
        healthy = False
        try:
            if not lost and not connection.is_closed():
                # Ours first (the full reset, then the pool's init state); asyncpg's own follows on release.
                await connection.execute(reset_sql(connection) + "\n" + then, timeout=self.timeout)
                healthy = True
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

    async def run_on(self, connection: asyncpg.Connection, name: str, args: tuple[Any, ...]) -> Any:
        raise self._unbound()

    async def lend(self) -> asyncpg.Connection:
        raise self._unbound()

    def begin_isolation(self) -> str | None:
        return None

    async def give_back(self, connection: asyncpg.Connection, *, lost: bool, then: str = "") -> None:
        raise self._unbound()

    def session(self) -> contextlib.AbstractAsyncContextManager[asyncpg.Connection]:
        raise self._unbound()

    def listening(
        self, channel: str, notified: Listener
    ) -> contextlib.AbstractAsyncContextManager[asyncpg.Connection | None]:
        raise self._unbound()


class StoreConnection(asyncpg.Connection):
    """The connections an :class:`OwnPool` opens: the statements prepared on them, and their reset (when a lent one
    comes back): the full one of ``lending.py``, in one round trip, instead of asyncpg's partial one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The store's statements, prepared on this connection as first used, unless the store keeps no prepared
        # statements (a transaction-pooling proxy).
        self.statements: dict[str, asyncpg.prepared_stmt.PreparedStatement] = {}

    then = ""  # SQL to run after the next reset, in its round trip (see Connector.give_back), once

    def get_reset_query(self) -> str:
        then, self.then = self.then, ""
        return reset_sql(self) + "\n" + then


async def _not_read_committed(connector: OwnPool | AppPool, connection: asyncpg.Connection) -> bool:
    """Ask a session the store does not set up for its default level, once: True when it is not READ COMMITTED."""
    level: str = await connection.fetchval(session()["default_isolation"], timeout=connector.timeout)
    connector.database_isolation = level
    return level != "read committed"


async def _run_unprepared(
    connection: asyncpg.Connection, sql: str, args: tuple[Any, ...], deadline: float, status: bool, explicit: bool
) -> Any:
    """A statement by its text (asyncpg's statement cache, if any, prepares it), in a READ COMMITTED transaction of
    its own when ``explicit``: its first row, or with ``status`` its status; ``deadline``: seconds it may take."""
    if explicit:
        async with connection.transaction(isolation="read_committed"):
            return await _run_unprepared(connection, sql, args, deadline, status, False)
    if status:
        return await connection.execute(sql, *args, timeout=deadline)
    return await connection.fetchrow(sql, *args, timeout=deadline)
