"""The connections a :class:`~idempotency_mw.postgres.PostgresStore` opens from a DSN: :class:`ConnectionPool`, and
:class:`OwnPool`, the connector that runs the store's statements on it.

Why not asyncpg's ``Pool``: its checkout does more than the store needs (a task for the acquire timeout, another for
the shielded release, a proxy object, an inactivity timer), around statements that each take one round trip, and
its waiters are not served in arrival order, which stretches the p99 once requests outnumber connections.

Here a checkout of an idle connection is a list pop, a check-in is an append or a hand-over to the oldest waiter,
and only a checkout that has to wait or connect sets a timer. What asyncpg's pool also does and this one does
not: per-connection setup hooks, closing idle connections after a while, ``max_queries``. A connection that saw
any error is closed rather than reused: our statements never leave one in a state worth repairing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import importlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import asyncpg

from idempotency_mw.postgres._connector import ASYNCPG_ISOLATION, Listener, naming_address
from idempotency_mw.postgres._lending import (
    Lender,
    reset_sql,
    set_restore,
)
from idempotency_mw.postgres._records import NOT_MIGRATED, UNAVAILABLE, reachable, run_unprepared
from idempotency_mw.postgres._sql import session
from idempotency_mw.store import PoolExhausted, StoreNotMigrated, StoreUnavailable

STATEMENT_CACHE_SIZE = 100  # asyncpg's default: far more than the store's dozen statements

# What asyncpg takes as "no deadline for this call, whatever the connection's command_timeout": the store's own
# statements use it and are watched by Deadlines instead. If a later asyncpg drops it, None gives those statements
# the connection's command_timeout as well: slower (a timer per statement), just as safe.
NO_TIMEOUT: Any = getattr(importlib.import_module("asyncpg.protocol.protocol"), "NO_TIMEOUT", None)


class Deadlines:
    """The deadline of the store's own statements, kept by one timer per pool instead of one per statement.

    asyncpg's per-call deadline (``timeout=``, or the connection's ``command_timeout``) starts and cancels a timer
    for every statement. Here a statement only notes when it started; a timer that runs while statements are in flight
    wakes every quarter of ``timeout`` and closes the connection of any statement that has run longer than ``timeout``.
    The statement then fails at once (asyncpg's "connection was closed in the middle of operation"), so a database that
    stopped answering still becomes :class:`~idempotency_mw.store.StoreUnavailable` (a 503), after ``timeout`` and at
    most a quarter more.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._started: dict[Any, float] = {}  # connection -> time.monotonic() its statement started
        self._late: set[Any] = set()  # connections closed for running late, until their statement hears of it
        self._timer: asyncio.TimerHandle | None = None

    def start(self, connection: Any) -> None:
        self._started[connection] = time.monotonic()
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.timeout / 4, self._check)

    def finish(self, connection: Any) -> None:
        self._started.pop(connection, None)

    def was_late(self, connection: Any) -> bool:
        """Whether this connection was closed because its statement ran past the deadline (asked once)."""
        if connection in self._late:
            self._late.discard(connection)
            return True
        return False

    def _check(self) -> None:
        self._timer = None
        now = time.monotonic()
        for connection, started in list(self._started.items()):
            if now - started >= self.timeout:
                del self._started[connection]
                self._late.add(connection)
                connection.terminate()
        if self._started:
            self._timer = asyncio.get_running_loop().call_later(self.timeout / 4, self._check)


class PoolClosed(asyncpg.exceptions.InterfaceError):
    """The pool was closed while a checkout was waiting, or before it."""


class ConnectionPool:
    """At most ``max_size`` connections to ``dsn``, opened on demand; ``open()`` opens ``min_size`` ahead.

    ``timeout`` bounds a checkout (waiting for a free connection, or opening one), in seconds. A checkout that
    waited that long for a busy pool fails with :class:`PoolExhausted`, one that was opening a connection with
    ``TimeoutError``: a pool too small for the load and a database that does not answer need different fixes. A
    checkout that waited while no connection was in use, every place taken by a connection still being opened,
    waited for the database, not for the pool: ``TimeoutError`` too.

    Two kinds of checkout. Work that *finishes* a request (renewing a running handler's lease, recording or
    releasing its outcome) is ``urgent``: it is served before anything else, and one connection is kept for it
    alone (when ``max_size`` > 1). Everything else, new claims and the connections lent to transactional handlers
    included, shares the rest. Without that, a burst of new requests, or transactional handlers holding every
    connection, would keep a running handler from renewing its lease: it would lapse, and a retry would run the
    handler a second time.

    ``prepared_statements=False`` opens connections without asyncpg's statement cache (``statement_cache_size=0``),
    for a transaction-pooling proxy in front of the server; see ``_connect``. ``setup`` runs on each connection as it
    is opened, before anyone uses it.
    """

    def __init__(
        self,
        dsn: str,
        *,
        min_size: int,
        max_size: int,
        timeout: float,
        connection_class: type[asyncpg.Connection] = asyncpg.Connection,
        prepared_statements: bool = True,
        setup: Callable[[asyncpg.Connection], Awaitable[None]] | None = None,
    ) -> None:
        if not 0 <= min_size <= max_size or max_size < 1:
            raise ValueError(f"pool sizes must satisfy 0 <= min_size <= max_size >= 1, got {min_size}, {max_size}")
        self.dsn = dsn
        self.min_size = min_size
        self.max_size = max_size
        self.timeout = timeout
        self.connection_class = connection_class
        self.prepared_statements = prepared_statements
        self.setup = setup
        self._idle: list[asyncpg.Connection] = []
        self._urgent: collections.deque[asyncio.Future[asyncpg.Connection | None]] = collections.deque()
        self._normal: collections.deque[asyncio.Future[asyncpg.Connection | None]] = collections.deque()
        self._size = 0  # connections open, in use or idle, plus those being opened
        self._lent: set[asyncpg.Connection] = set()  # out on a checkout that is not urgent
        self._opening = 0  # connections being opened for checkouts that are not urgent (they count as lent)
        self._connecting = 0  # connections being opened, for any checkout
        self._normal_cap = max_size - 1 if max_size > 1 else max_size  # the last one is kept for urgent work
        self._closed = False
        self._members: set[asyncpg.Connection] = set()  # every connection open and not yet closed
        self.deadlines = Deadlines(timeout)

    @property
    def size(self) -> int:
        return self._size

    @property
    def closed(self) -> bool:
        return self._closed

    def owns(self, connection: asyncpg.Connection) -> bool:
        """Whether ``connection`` was opened by this pool and is still open (a pool that replaced a closed one is
        given back the closed one's connections too)."""
        return connection in self._members

    def fresh(self) -> ConnectionPool:
        """A new pool, not opened yet, with this one's settings: what a closed store opens again with."""
        return ConnectionPool(
            self.dsn,
            min_size=self.min_size,
            max_size=self.max_size,
            timeout=self.timeout,
            connection_class=self.connection_class,
            prepared_statements=self.prepared_statements,
            setup=self.setup,
        )

    @property
    def idle(self) -> int:
        return len(self._idle)

    async def open(self) -> None:
        """Open connections up to ``min_size`` (a dead server fails here, at startup, instead of at a request)."""
        while self._size < self.min_size and not self._closed:
            self._size += 1
            self._connecting += 1
            try:
                connection = await self._connect()
            except BaseException:
                self._size -= 1
                raise
            finally:
                self._connecting -= 1
            self.release(connection)

    def close_idle(self) -> None:
        """Terminate the idle connections and free their places; what is lent, or waited for, is left alone. After a
        failed :meth:`open` its connections are idle (unless a request had one), and nothing else would close them
        (a caller whose startup failed seldom calls :meth:`close`); a later checkout or open connects again.
        Terminated, not closed politely: a database that stopped answering would hold each close for ``timeout``."""
        while self._idle:
            connection = self._idle.pop()
            connection.terminate()
            self._members.discard(connection)
            self._size -= 1

    def _room(self, urgent: bool) -> bool:
        """Whether this checkout may take a connection now: urgent work always, other work below its share."""
        return urgent or len(self._lent) + self._opening < self._normal_cap

    def take(self, urgent: bool = False) -> asyncpg.Connection | None:
        """An idle connection now, or None (then :meth:`acquire` waits or connects): the common case, without a
        coroutine."""
        if not self._closed and self._room(urgent):
            return self._take_idle(urgent)
        return None

    async def acquire(self, *, urgent: bool = False) -> asyncpg.Connection:
        """A connection within ``timeout``. Waiting that long for a busy pool raises :class:`PoolExhausted`;
        connecting that long raises ``TimeoutError`` (the database is slow or gone, not the pool too small)."""
        if self._room(urgent) and (connection := self._take_idle(urgent)) is not None:
            return connection  # the common case: no timer, no await
        return await self._wait_or_connect(urgent, asyncio.get_running_loop().time() + self.timeout)

    def _take_idle(self, urgent: bool) -> asyncpg.Connection | None:
        while self._idle:
            connection = self._idle.pop()  # the most recently used: its server backend is the warmest
            if connection.is_closed():
                self._size -= 1  # the server closed it while it was idle (a restart, an admin): forget it
                self._members.discard(connection)
                continue
            if not urgent:
                self._lent.add(connection)
            return connection
        return None

    def release(self, connection: asyncpg.Connection, *, broken: bool = False) -> None:
        """Give a connection back; ``broken`` (it saw an error) closes it instead, and frees its place."""
        self._lent.discard(connection)
        if broken or self._closed or connection.is_closed():
            connection.terminate()
            self._members.discard(connection)
            self._size -= 1
            self._hand_over(None)  # a waiter may open a connection in its place
            return
        if (self._urgent or self._normal) and self._hand_over(connection):
            return
        self._idle.append(connection)  # the common case: nobody waits

    async def close(self) -> None:
        """Close the idle connections now, the others as they come back; waiting checkouts fail."""
        self._closed = True
        idle, self._idle = self._idle, []
        self._size -= len(idle)
        self._members.difference_update(idle)
        for waiters in (self._urgent, self._normal):
            while waiters:
                waiter = waiters.popleft()
                if not waiter.done():
                    waiter.set_exception(PoolClosed("the idempotency store was closed"))
        await asyncio.gather(*(connection.close(timeout=self.timeout) for connection in idle), return_exceptions=True)

    async def _wait_or_connect(self, urgent: bool, deadline: float) -> asyncpg.Connection:
        while True:
            if self._closed:
                raise PoolClosed("the idempotency store is closed: open() it again to use it")
            if self._room(urgent):
                if (idle := self._take_idle(urgent)) is not None:
                    return idle
                if self._size < self.max_size:
                    counted = 0 if urgent else 1  # a connection opened for other work already takes its share
                    self._size += 1
                    self._opening += counted
                    self._connecting += 1
                    try:
                        async with asyncio.timeout_at(deadline):
                            connection = await self._connect()
                    except BaseException:
                        self._size -= 1
                        self._opening -= counted
                        self._connecting -= 1
                        self._hand_over(None)
                        raise
                    self._opening -= counted
                    self._connecting -= 1
                    if not urgent:
                        self._lent.add(connection)
                    return connection
            loop = asyncio.get_running_loop()
            waiter: asyncio.Future[asyncpg.Connection | None] = loop.create_future()
            (self._urgent if urgent else self._normal).append(waiter)
            # The deadline fails the waiter itself, by a plain timer.
            expiry = loop.call_at(deadline, _expire, waiter)
            try:
                handed = await waiter
            except BaseException as error:
                # Timed out or cancelled. A connection handed over in the same instant must not be lost with us.
                if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                    late = waiter.result()
                    if late is not None:
                        self.release(late)
                    else:
                        self._hand_over(None)
                else:
                    waiter.cancel()
                if isinstance(error, TimeoutError):
                    if self._size - len(self._idle) - self._connecting <= 0:
                        raise TimeoutError(
                            f"the database did not answer within {self.timeout}s: no connection could be opened"
                        ) from None
                    raise PoolExhausted(
                        "the idempotency store's connection pool", max_size=self.max_size, timeout=self.timeout
                    ) from None
                raise
            finally:
                expiry.cancel()
            if handed is not None:
                return handed
            # A place was freed (a connection closed): loop to open one, unless someone was quicker.

    def _hand_over(self, connection: asyncpg.Connection | None) -> bool:
        """Give ``connection`` (or, with None, a freed place) to the oldest urgent waiter, else to the oldest other
        waiter if the share of non-urgent work allows. False if nobody took it."""
        while self._urgent:
            waiter = self._urgent.popleft()
            if not waiter.done():
                waiter.set_result(connection)
                return True
        if not self._room(urgent=False):
            return False
        while self._normal:
            waiter = self._normal.popleft()
            if not waiter.done():
                if connection is not None:
                    self._lent.add(connection)
                waiter.set_result(connection)
                return True
        return False

    async def _connect(self) -> asyncpg.Connection:
        # Without prepared statements asyncpg's statement cache is off and every statement is unnamed: one round
        # trip parses and describes it (ending in Flush, not Sync, so a transaction-pooling proxy keeps the same
        # server connection), a second parses it again and runs it. Nothing outlives the statement's Sync.
        try:
            connection: asyncpg.Connection = await asyncpg.connect(
                self.dsn,
                timeout=self.timeout,
                command_timeout=self.timeout,
                connection_class=self.connection_class,
                statement_cache_size=STATEMENT_CACHE_SIZE if self.prepared_statements else 0,
            )
        except OSError as error:
            raise naming_address(error, self.dsn) from error
        if self.setup is not None:
            try:
                await self.setup(connection)
            except BaseException:
                connection.terminate()
                raise
        self._members.add(connection)
        return connection


def _expire(waiter: asyncio.Future[Any]) -> None:
    """A checkout's deadline passed while it waited: it fails with TimeoutError, unless it was served just now."""
    if not waiter.done():
        waiter.set_exception(TimeoutError())


PIN_RESTORE = "SELECT set_config('default_transaction_isolation', 'read committed', false);"


class OwnPool(Lender):
    """The connector of a DSN-built store: a :class:`ConnectionPool` of its own, each connection pinned to READ
    COMMITTED as it opens.

    Every request runs two statements here: an idle connection is taken without a coroutine, the statement runs as a
    prepared-statement object kept on the connection, and its deadline is kept by the pool's one timer
    (:class:`Deadlines`).

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

    def close_idle(self) -> None:
        """What a failed open leaves (PostgresStore.open): its connections closed, the pool not (requests it serves
        meanwhile go on)."""
        self.pool.close_idle()

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
                except asyncpg.exceptions.InvalidSQLStatementNameError:
                    # Ours is gone: code this connection was lent to ran DEALLOCATE ALL where the loan could not see
                    # it (_lending.py). It did not run; prepared again, it runs once more.
                    await connection.reload_schema_state()  # StoreConnection: the store's statements are forgotten
                    statement = statements[name] = await connection.prepare(self._sql[name])
                    result = await statement.fetchrow(*args, timeout=NO_TIMEOUT)
                finally:
                    pool.deadlines.finish(connection)
                if status:
                    result = statement.get_statusmsg()
            else:
                if self._explicit is None:
                    self._explicit = await self._not_read_committed(connection)
                result = await run_unprepared(connection, self._sql[name], args, self.timeout, status, self._explicit)
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
                self._explicit = await self._not_read_committed(connection)
            return await run_unprepared(connection, self._sql[name], args, self.timeout, False, self._explicit)

    async def lend(self) -> asyncpg.Connection:
        with reachable():
            connection = await self.pool.acquire()
        statements = connection.statements  # type: ignore[attr-defined]  # a StoreConnection
        if self._prepare and "notify_waiters" not in statements:
            # Once per connection, before any handler had it (its session as the store set it up): run by name
            # after a transactional request's COMMIT (Records.notice). Not yet where the tables are not: the claim
            # that follows says so, and a later loan prepares it. Run once too, on no record (no fence is 0):
            # asyncpg's prepare ends in Flush, not Sync, which leaves the server in the implicit transaction that
            # parsed it, and a BEGIN ISOLATION LEVEL on it would fail; the run's Sync ends it.
            try:
                with reachable(), contextlib.suppress(*NOT_MIGRATED):
                    prepared = await connection.prepare(self._sql["notify_waiters"], timeout=self.timeout)
                    await prepared.fetchrow("", "", 0, timeout=self.timeout)
                    statements["notify_waiters"] = prepared
            except BaseException:
                self._release(connection, broken=True)
                raise
        return connection

    def begin_isolation(self) -> str | None:
        level = self.database_isolation
        if not self._prepare or level in (None, "read committed"):
            return None  # the session's default is the database's
        return ASYNCPG_ISOLATION[level]

    def notice_statement(self, connection: asyncpg.Connection) -> str | None:
        prepared = connection.statements.get("notify_waiters")  # type: ignore[attr-defined]  # a StoreConnection
        return None if prepared is None else str(prepared.get_name())

    def begin(self, connection: asyncpg.Connection, transaction: Any) -> Coroutine[Any, Any, None]:
        # A plain function returning the coroutine that sends the BEGIN: no coroutine level of its own.
        store_connection: StoreConnection = connection  # type: ignore[assignment]  # the pool opens no other kind
        return store_connection.sending_after(transaction.start, session()["mark_transaction"])

    async def commit(self, connection: asyncpg.Connection, transaction: Any, then: str) -> bool:
        store_connection: StoreConnection = connection  # type: ignore[assignment]  # the pool opens no other kind
        await store_connection.sending_after(transaction.commit, reset_sql(connection) + "\n" + then)
        return True

    async def give_back(
        self, connection: asyncpg.Connection, *, lost: bool, then: str = "", clean: bool = False, keep: bool = True
    ) -> None:
        if not keep:  # no reset reaches what the driver keeps; the waiters were told in the COMMIT's round trip
            self._release(connection, broken=True)
            return
        if clean and not lost and not connection.is_closed():
            self._release(connection)  # reset in its COMMIT's round trip
            return
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


_execute = asyncpg.Connection.execute


class StoreConnection(asyncpg.Connection):
    """The connections an :class:`OwnPool` opens: the statements prepared on them, and their reset (when a lent one
    comes back): the full one of ``_lending.py``, in one round trip, instead of asyncpg's partial one; after a
    transactional request's COMMIT, in the COMMIT's round trip (:meth:`sending_after`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The store's statements, prepared on this connection as first used, unless the store keeps no prepared
        # statements (a transaction-pooling proxy).
        self.statements: dict[str, asyncpg.prepared_stmt.PreparedStatement] = {}
        self._after = ""  # SQL for the BEGIN or COMMIT that sending_after() is sending, after it, in its message

    async def reload_schema_state(self) -> None:
        """asyncpg's, and the store's statements forgotten too, to be prepared again as next used: a lent
        connection's handler is about to run SQL that may deallocate them (``_lending.py``)."""
        await super().reload_schema_state()
        self.statements.clear()

    async def sending_after(self, step: Callable[[], Awaitable[None]], then: str) -> None:
        """Start or commit a transaction (``step``: asyncpg's ``Transaction.start`` or ``commit``, so that its state
        and a handler's savepoints in it stay asyncpg's to keep) and run ``then`` after its BEGIN or COMMIT in the
        same simple query: one round trip."""
        self._after = then
        try:
            await step()
        finally:
            self._after = ""

    def execute(self, query: str, *args: Any, timeout: float | None = None) -> Coroutine[Any, Any, str]:
        # A plain function returning asyncpg's coroutine: no coroutine level of its own on the handler's statements.
        if self._after and query.startswith(("BEGIN", "COMMIT;")):  # asyncpg's, sent in sending_after()
            query = query + "\n" + self._after
        return _execute(self, query, *args, timeout=timeout)

    then = ""  # SQL to run after the next reset, in its round trip (see Lender.give_back), once

    def get_reset_query(self) -> str:
        then, self.then = self.then, ""
        return reset_sql(self) + "\n" + then
