"""Connections lent to code other than the store's, for the loan only, and given back as they were lent; and the
transaction of a transactional request on one of them.

A transactional handler writes through a connection of the store's (or of the app's pool) for one request. Two
things keep one request's use of it from reaching the next user of the connection:

- :class:`LentConnection` is what the handler holds: an asyncpg connection that refuses every call once the loan
  has ended, as asyncpg's own pool refuses a connection used after its release. A task that outlived its request
  could otherwise read another tenant's uncommitted writes, or write into its transaction.
- :func:`reset_sql` is what the connection runs when it comes back, in one round trip: ``sql/reset_session.sql``
  clears whatever the handler did to the session (role, settings, temp tables, advisory locks, LISTEN; SQL-level
  prepared statements after a loan whose SQL said PREPARE), then the SQL that restores what the pool established
  when it opened the connection (an asyncpg pool's ``init``, a SQLAlchemy ``connect`` event, the store's own
  settings). That state is read once per connection, the first time it is lent (:func:`remember`), and kept with
  the connection.

:class:`PostgresTransaction` is the lent connection of one transactional request: the key is claimed on it (committed
at once), then the handler's transaction begins on it, and the record completes in it.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import inspect
import re
import weakref
from collections.abc import AsyncIterator
from typing import Any, cast

import asyncpg

from idempotency_mw.postgres._connector import default_isolation
from idempotency_mw.postgres._records import NOT_MIGRATED, UNAVAILABLE, Records, reachable
from idempotency_mw.postgres._recovery import point_arguments, points_from_rows
from idempotency_mw.postgres._sql import reset_session, session
from idempotency_mw.store import (
    Claim,
    RecoveryPoint,
    StoredResponse,
    StoreNotMigrated,
    StoreUnavailable,
    TransactionEnded,
)

# How a completion in a handler's transaction learns that another claim's response is stored (the primary key) or
# that the record was deleted meanwhile (the foreign key): fenced out, like a completion that finds another fence
# (sql/queries.sql). Under REPEATABLE READ and SERIALIZABLE, the primary key met in a row the snapshot cannot see is
# a serialization failure instead, which a conflict of the handler's own writes can raise just as well: that one
# fails the transaction, and the release that follows tells the two apart (_transactional.py).
FENCED_OUT = (
    asyncpg.exceptions.UniqueViolationError,
    asyncpg.exceptions.ForeignKeyViolationError,
)

# The SQL that restores each connection's state as its pool made it, by the driver connection it belongs to.
_restores: weakref.WeakKeyDictionary[asyncpg.Connection, str] = weakref.WeakKeyDictionary()
# The driver connections whose loan sent SQL that may have made a prepared statement (LentConnection), deallocated
# by their next reset.
_preparing: weakref.WeakSet[asyncpg.Connection] = weakref.WeakSet()
_PREPARE = re.compile("prepare", re.IGNORECASE).search
_DEALLOCATE = re.compile("deallocate", re.IGNORECASE).search


def driver_connection(connection: Any) -> asyncpg.Connection:
    """The asyncpg connection itself, behind an asyncpg pool's proxy if ``connection`` is one."""
    driver: asyncpg.Connection = getattr(connection, "_con", None) or connection  # where an asyncpg pool's proxy has it
    return driver


def set_restore(connection: asyncpg.Connection, sql: str) -> None:
    """Record the SQL that gives ``connection`` back the state its pool established (the store's own pool sets it
    as it opens a connection, since it knows what it set)."""
    _restores[driver_connection(connection)] = sql


async def remember(connection: Any, *, time_limit: float) -> None:
    """Read the session state the pool gave ``connection`` (once per connection), before it is first lent."""
    driver = driver_connection(connection)
    if driver not in _restores:
        _restores[driver] = await connection.fetchval(session()["capture"], timeout=time_limit) or ""


def reset_sql(connection: Any, *, watched: bool = True) -> str:
    """What a lent connection runs when it comes back: the reset, then its pool's state again. Its SQL-level
    prepared statements are deallocated too where the loan's SQL said PREPARE, or where it was not ``watched``
    (lent other than as a :class:`LentConnection`, whose SQL the store does not see)."""
    driver = driver_connection(connection)
    reset = reset_session()
    parts = [reset["reset"], _restores.get(driver, "")]
    if driver in _preparing or not watched:
        _preparing.discard(driver)
        parts.insert(1, reset["deallocate"])
    return "\n".join(parts)


class LentConnection:
    """An asyncpg connection for the length of a loan: every method of ``asyncpg.Connection`` works on the
    connection until :meth:`end`, and raises ``asyncpg.InterfaceError`` after it (a method looked up before the end
    and called after it too). Like asyncpg's pool proxy, it guards the connection's methods, not the objects they
    returned during the loan (a prepared statement, a cursor).

    ``must_reset`` says the connection comes back through its reset even when nothing was sent after its COMMIT
    (:func:`lend_transaction` counts what was): the handler added listeners the driver keeps on its side
    (``add_listener``, ``add_log_listener``), which only asyncpg's own ``reset()`` forgets, or ran a COPY, which the
    driver does not count. ``driver_state`` says it changed what no reset reaches (a query logger, a termination
    listener, a type codec: the next request's arguments would reach the logger, its headers the codec): the
    connection is closed instead. What the code took from the connection that outlives the call (a prepared
    statement, a cursor, a transaction object) is refused once the loan ends, as asyncpg's pool refuses it after a
    release.
    SQL that names PREPARE (any case, anywhere in its text: a statement, a function's body, a DO block) marks the
    connection for the deallocation of SQL-level prepared statements when it comes back (:func:`reset_sql`). A
    PREPARE run by a function created beforehand is not seen, and its statement stays, as asyncpg's own pool
    leaves every one: it holds a plan, never rows, and runs with the privileges of whoever executes it.

    SQL that names DEALLOCATE may drop the driver's prepared statements too (``DEALLOCATE ALL`` drops every one of
    the session): asyncpg's of earlier requests, which its cache would use again, and the store's own. Before it
    runs, the connection forgets them (asyncpg's ``reload_schema_state``, which the store's connections extend to
    their own statements), and each is prepared again when next used: the handler's next statement, its
    completion, the requests after it. One run later, through a prepared statement or a cursor of the handler's, or
    by a function, is not seen: the statement that then finds its own gone fails, and its request is rolled back."""

    __slots__ = ("_connection", "driver_state", "must_reset", "took")

    def __init__(self, connection: asyncpg.Connection) -> None:
        self._connection: asyncpg.Connection | None = connection
        self.must_reset = False
        self.driver_state = False
        self.took = False  # an object of the connection's that outlives the call (TAKEN)

    def end(self) -> None:
        if self.took and self._connection is not None:
            _refuse_taken(self._connection)
        self._connection = None

    def _live(self, name: str) -> asyncpg.Connection:
        connection = self._connection
        if connection is None:
            raise asyncpg.InterfaceError(
                f"cannot call Connection.{name}(): the connection was lent to a request that has ended (a task that "
                "outlives its request needs a connection of its own)"
            )
        return connection

    def __getattr__(self, name: str) -> Any:
        return getattr(self._live(name), name)

    def __repr__(self) -> str:
        state = "ended" if self._connection is None else repr(self._connection)
        return f"<LentConnection {state}>"


def _refuse_taken(connection: Any) -> None:
    """What was taken from ``connection`` during a loan is refused from now on: asyncpg counts a connection's
    releases, and each object taken from it (a ConnectionResource) compares the count it was made under, which is
    how asyncpg's pool refuses it. The store's own statements, made before the loan, move to the new count: they
    stay valid. Otherwise a task that kept such an object would run it in the next request's transaction."""
    driver: Any = driver_connection(connection)  # asyncpg's own attributes, which its stubs do not name
    driver._pool_release_ctr += 1
    for statement in getattr(driver, "statements", {}).values():  # a StoreConnection's
        statement._con_release_ctr = driver._pool_release_ctr


def _noting(name: str, flag: str) -> Any:
    """The method ``name``, which also notes ``flag`` on the loan: what its give-back must know (NOTED)."""

    def method(self: LentConnection, *args: Any, **kwargs: Any) -> Any:
        found = getattr(self._live(name), name)
        setattr(self, flag, True)
        return found(*args, **kwargs)

    return functools.update_wrapper(method, getattr(asyncpg.Connection, name))


def _forwarding(name: str) -> Any:
    def method(self: LentConnection, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._live(name), name)(*args, **kwargs)

    return functools.update_wrapper(method, getattr(asyncpg.Connection, name))


def _watching_sql(name: str) -> Any:
    takes, runs_now = name in TAKEN, name in RUN_NOW

    def method(self: LentConnection, *args: Any, **kwargs: Any) -> Any:
        connection = self._live(name)
        if takes:
            self.took = True
        sql = args[0] if args else kwargs.get("query", kwargs.get("command"))
        if isinstance(sql, str):
            if _PREPARE(sql):
                _preparing.add(driver_connection(connection))
            if runs_now and _DEALLOCATE(sql):
                return _forgetting_statements(connection, name, args, kwargs)
        return getattr(connection, name)(*args, **kwargs)

    return functools.update_wrapper(method, getattr(asyncpg.Connection, name))


async def _forgetting_statements(connection: asyncpg.Connection, name: str, args: Any, kwargs: Any) -> Any:
    """Run SQL that may deallocate the driver's prepared statements, once the connection has forgotten them."""
    await connection.reload_schema_state()
    return await getattr(connection, name)(*args, **kwargs)


CLIENT_STATE = ("add_listener", "add_log_listener")  # what the driver keeps on its side of a session
# What sends SQL the driver does not count among its queries (asyncpg's protocol counts the rest): a COPY.
UNCOUNTED = ("copy_from_query", "copy_from_table", "copy_records_to_table", "copy_to_table")
# What the driver keeps on its side that its reset() leaves: after one of these, the connection is not lent again.
DRIVER_STATE = (
    "add_query_logger",
    "add_termination_listener",
    "reset_type_codec",
    "set_builtin_type_codec",
    "set_type_codec",
)
# The methods that send SQL text of the caller's, as their first argument.
SQL_TEXT = (
    "copy_from_query",
    "cursor",
    "execute",
    "executemany",
    "fetch",
    "fetchmany",
    "fetchrow",
    "fetchval",
    "prepare",
)
TAKEN = ("cursor", "prepare", "transaction")  # what returns an object of the connection's that outlives the call
RUN_NOW = frozenset(SQL_TEXT) - set(TAKEN)  # those that run their SQL as they are awaited
# The methods that only note something on the loan (the rest of TAKEN send SQL: _watching_sql notes it for them).
# A COPY's query names neither PREPARE nor DEALLOCATE as a statement: copy_from_query is noted, not watched.
NOTED = {
    **dict.fromkeys(CLIENT_STATE, "must_reset"),
    **dict.fromkeys(UNCOUNTED, "must_reset"),
    **dict.fromkeys(DRIVER_STATE, "driver_state"),
    "transaction": "took",
}

for _name, _member in inspect.getmembers(asyncpg.Connection, inspect.isfunction):
    if not _name.startswith("_"):
        if _name in NOTED:
            method = _noting(_name, NOTED[_name])
        else:
            method = _watching_sql(_name) if _name in SQL_TEXT else _forwarding(_name)
        setattr(LentConnection, _name, method)


class Lender(abc.ABC):
    """An asyncpg connector that lends its connections to requests (the store's own pool, or the app's): what
    lending asks of it, and the loans it gives the store."""

    timeout: float
    database_isolation: str | None

    @abc.abstractmethod
    async def lend(self) -> asyncpg.Connection:
        """A connection from the share of ordinary work; :class:`PoolExhausted` when none comes free in time."""

    @abc.abstractmethod
    async def run(self, name: str, args: tuple[Any, ...], *, urgent: bool = False, status: bool = False) -> Any:
        """One of the store's statements, its first row (its status with ``status``), on a connection of the
        pool's own; ``urgent`` work is served first (it finishes a request)."""

    @abc.abstractmethod
    def begin_isolation(self) -> str | None:
        """The isolation level (asyncpg's spelling) to begin a lent connection's transaction with, when its session
        default is not the database's; None to begin with the session's default."""

    @abc.abstractmethod
    async def run_on(self, connection: asyncpg.Connection, name: str, args: tuple[Any, ...]) -> Any:
        """One of the store's statements, its first row, on a lent connection, outside a transaction."""

    @abc.abstractmethod
    async def give_back(
        self, connection: asyncpg.Connection, *, lost: bool, then: str = "", clean: bool = False, keep: bool = True
    ) -> None:
        """Take a lent connection back as its pool gave it; closed if ``lost`` or if its reset fails. ``then`` is SQL
        to run after the reset, in its round trip (``notify_waiters``, after a transactional request's COMMIT);
        ``clean``: the reset already ran, in the COMMIT's round trip (:meth:`commit`), and nothing used the
        connection since; ``keep=False``: closed instead of given back, since the driver keeps state of the loan's
        (``LentConnection.driver_state``); ``then`` still runs where the COMMIT did not carry it (an app's pool)."""

    def notice_statement(self, connection: asyncpg.Connection) -> str | None:
        """The name of ``notify_waiters`` as prepared on ``connection``, if it is (the store's own connections)."""
        return None

    async def begin(self, connection: asyncpg.Connection, transaction: Any) -> None:
        """Start asyncpg's ``transaction`` on a lent connection, marked (``mark_transaction``) in its BEGIN's round
        trip. asyncpg's ``start()`` sends its BEGIN alone, and an app's connection cannot be made to send more (the
        store's own can: :class:`OwnPool`). So the BEGIN is sent here as ``start()`` sends it for a transaction at the
        session's default level, and asyncpg's transaction is left as ``start()`` leaves it (its own state, not
        stubbed): the handler's savepoints nest in it, and it commits and rolls back as asyncpg's."""
        driver: Any = driver_connection(connection)
        await driver.execute("BEGIN;\n" + session()["mark_transaction"], timeout=self.timeout)
        transaction._state = asyncpg.transaction.TransactionState.STARTED
        driver._top_xact = transaction

    async def commit(self, connection: asyncpg.Connection, transaction: Any, then: str) -> bool:
        """COMMIT a lent connection's ``transaction``; True when the connection's reset, then ``then``, ran after it
        in the same round trip (a connection of the store's own pool), False when they are left to :meth:`give_back`
        (an app's pool, whose connections the store cannot make send more than asyncpg's COMMIT)."""
        await transaction.commit()
        return False

    def transaction(self, records: Records) -> contextlib.AbstractAsyncContextManager[PostgresTransaction]:
        return lend_transaction(self, records)

    def connection(self) -> contextlib.AbstractAsyncContextManager[asyncpg.Connection]:
        return lent_connection(self)

    async def _not_read_committed(self, connection: asyncpg.Connection) -> bool:
        """Ask a session the store does not set up (an app's pool, a proxy's) for its default level, once: True when
        it is not READ COMMITTED."""
        self.database_isolation = await default_isolation(connection, self.timeout)
        return self.database_isolation != "read committed"


@contextlib.asynccontextmanager
async def lend_transaction(lender: Lender, records: Records) -> AsyncIterator[PostgresTransaction]:
    """A connection of ``lender``'s for one transactional request: the claim is taken on it, then the transaction
    begins on it; committed or rolled back by the caller. It comes back with a clean session, and after a commit
    the waiters of the record in other processes are told, in the same round trip."""
    connection = await lender.lend()
    transaction = PostgresTransaction(records, connection, lender)
    try:
        yield transaction
    finally:
        lent = transaction.lent
        lent.end()
        told = transaction.clean  # the reset and the waiters' notice rode in the COMMIT's round trip
        # SQL sent after the COMMIT (by a background task: a call, or a statement or transaction object taken
        # before it) may have changed the session again, or begun a transaction. asyncpg counts the queries it
        # sends on a connection, as it sends them (its pool reads the count for max_queries); a COPY is not one.
        clean = (
            told
            and connection._protocol.queries_count == transaction.queries_at_commit  # type: ignore[attr-defined]
            and not lent.must_reset
        )
        notice = "" if told else transaction.settlement.notice
        keep = not lent.driver_state
        await lender.give_back(connection, lost=transaction.lost, then=notice, clean=clean, keep=keep)


@contextlib.asynccontextmanager
async def lent_connection(lender: Lender) -> AsyncIterator[asyncpg.Connection]:
    """A connection of ``lender``'s for code other than the store's, at the database's default isolation level: it
    comes back as its pool gave it, whatever the code did to it, and refuses use once the block has ended."""
    connection = await lender.lend()
    lent = LentConnection(connection)
    lost = False
    try:
        if lender.begin_isolation() is not None:  # the store's own session reads READ COMMITTED
            with reachable():
                await connection.execute(
                    "SELECT set_config('default_transaction_isolation', $1, false)",
                    lender.database_isolation,
                    timeout=lender.timeout,
                )
        yield cast(asyncpg.Connection, lent)
    except BaseException as error:
        lost = isinstance(error, (*UNAVAILABLE, StoreUnavailable))  # no reset for a connection that is gone
        raise
    finally:
        lent.end()
        await lender.give_back(connection, lost=lost, keep=not lent.driver_state)


class Settlement:
    """What a transaction that completes a claim tells its store's records: the claim is settled once its completion
    is committed, or at once if it was fenced out (the key is another claim's now). A completion rolled back is not
    settled here: the request releases the key. Once committed, ``notice`` is the SQL that tells the waiters of
    other processes, run after the COMMIT with the connection's reset."""

    def __init__(self, records: Records) -> None:
        self._records = records
        self.completion: tuple[str, str, int] | None = None  # the claim completed in the transaction
        self.notice = ""

    def completed(self, tenant: str, key: str, fence: int, done: bool) -> bool:
        """Note the outcome of the completion statement; returns ``done``."""
        if done:
            self.completion = (tenant, key, fence)
        else:
            self._records.settled(tenant, key, fence)
        return done

    def notice_sql(self, prepared: str | None = None) -> str:
        """The SQL that tells the waiters of the completed claim, for after the COMMIT (``prepared``: the name of
        its statement as prepared on the connection); "" if nothing completed."""
        return "" if self.completion is None else self._records.notice(*self.completion, prepared)

    def committed(self, notice: str | None = None) -> None:
        """The completion committed; ``notice`` is its :meth:`notice_sql` when that was made already."""
        if self.completion is not None:
            self.notice = self.notice_sql() if notice is None else notice
            self._records.settled(*self.completion)


class PostgresTransaction:
    """A connection lent to one transactional request: its claim, then a transaction whose ``connection`` the handler
    writes through (a :class:`LentConnection`, refused once the request has ended) and in which the record completes.

    Every call has the store's deadline; a database that cannot be reached is :class:`StoreUnavailable`, and marks
    the connection ``lost`` (it goes back closed, without a reset that would wait out another deadline).
    """

    def __init__(self, records: Records, connection: asyncpg.Connection, lender: Lender) -> None:
        self.connection = connection
        self.lent = LentConnection(connection)
        self.lost = False
        self.clean = False  # reset in the COMMIT's round trip, with the waiters told (Lender.commit)
        self.queries_at_commit = -1  # asyncpg's count of the connection's queries once its COMMIT was sent
        self.settlement = Settlement(records)
        self._records = records
        self._lender = lender
        self._run = functools.partial(lender.run_on, connection)  # the store's statements on this connection
        self._isolation = lender.begin_isolation()
        self._transaction: asyncpg.transaction.Transaction | None = None

    async def claim(
        self,
        tenant: str,
        key: str,
        fingerprint: bytes,
        *,
        lease: float,
        ttl: float,
        matching: tuple[bytes, ...] = (),
        request: str | None = None,
        parts: bytes | None = None,
    ) -> Claim:
        fingerprints = (fingerprint, *matching)
        try:
            return await self._records.claim(
                self._run, tenant, key, fingerprints, lease=lease, ttl=ttl, flush=False, request=request, parts=parts
            )
        except StoreNotMigrated:
            raise
        except StoreUnavailable:
            self.lost = True
            raise

    async def begin(self) -> None:
        """BEGIN, at the database's default isolation level (the store's own session reads READ COMMITTED), marked
        (``mark_transaction``): the completion is written in this transaction only, not in one the handler begins
        after ending it."""
        try:
            self._transaction = self.connection.transaction(isolation=self._isolation)  # type: ignore[arg-type]
            await self._lender.begin(self.connection, self._transaction)
        except UNAVAILABLE as error:
            raise self._unreachable(error) from error

    async def complete(self, tenant: str, key: str, fence: int, response: StoredResponse) -> bool:
        if not self.connection.is_in_transaction():
            # The handler ran COMMIT or ROLLBACK itself. Completing now would write the record on its own: after a
            # ROLLBACK, a retry would be told of an effect that never happened.
            raise TransactionEnded.by_the_handler("connection", "async with connection.transaction(): ...")
        records = self._records
        args = records.completion(tenant, key, fence, response)
        try:
            status = await self.connection.execute(
                records.sql["complete_in_transaction"], *args, True, timeout=records.timeout
            )
        except FENCED_OUT:
            return self.settlement.completed(tenant, key, fence, False)
        except UNAVAILABLE as error:
            raise self._unreachable(error) from error
        except NOT_MIGRATED as error:
            raise StoreNotMigrated(records.schema, str(error)) from error
        done = status == "INSERT 0 1"
        if not done:  # fenced out, or written nowhere: the handler ended the transaction and began another
            await self._refuse_if_ended()
        return self.settlement.completed(tenant, key, fence, done)

    async def recovery_points(self, tenant: str, key: str, fence: int) -> list[RecoveryPoint]:
        records = self._records
        try:
            rows = await self.connection.fetch(
                records.sql["recovery_points"], tenant, key, fence, timeout=records.timeout
            )
        except UNAVAILABLE as error:
            raise self._unreachable(error) from error
        except NOT_MIGRATED as error:
            raise StoreNotMigrated(records.schema, str(error)) from error
        return points_from_rows(rows, tenant, key, records.cipher)

    async def record_steps(self, tenant: str, key: str, fence: int, points: list[RecoveryPoint]) -> bool:
        if not self.connection.is_in_transaction():  # the handler ended it: the points would land without its writes
            raise TransactionEnded.by_the_handler("connection", "async with connection.transaction(): ...")
        records = self._records
        args = point_arguments(tenant, key, fence, points, records.cipher)
        try:
            status = await self.connection.execute(records.sql["record_steps"], *args, True, timeout=records.timeout)
        except FENCED_OUT:
            return False  # another claim's point of a step, or the record deleted meanwhile
        except UNAVAILABLE as error:
            raise self._unreachable(error) from error
        except NOT_MIGRATED as error:
            raise StoreNotMigrated(records.schema, str(error)) from error
        if status == f"INSERT 0 {len(points)}":
            return True
        await self._refuse_if_ended()  # the points would land in a transaction the handler began
        return False

    async def _refuse_if_ended(self) -> None:
        """:class:`TransactionEnded` if the transaction this began is no longer the connection's: the handler ended
        it and began another (its mark is gone: ``transaction_ended``). Asked when a statement that writes in the
        marked transaction alone wrote nothing, which is otherwise a newer claim's fence."""
        try:
            ended = await self.connection.fetchval(session()["transaction_ended"], timeout=self._records.timeout)
        except UNAVAILABLE as error:
            raise self._unreachable(error) from error
        if ended:
            raise TransactionEnded.by_the_handler("connection", "async with connection.transaction(): ...")

    async def lapse(self, tenant: str, key: str, fence: int) -> bool:
        if self.lost:
            raise StoreUnavailable("the connection of the handler's transaction was lost")
        try:
            row = await self._run("lapse", (tenant, key, fence))
        except StoreUnavailable:
            self.lost = True
            raise
        finally:
            self._records.settled(tenant, key, fence)
        return bool(row is not None and row["lapsed"] == 1)

    async def commit(self) -> None:
        """COMMIT; with a completion to commit, the connection's reset and the waiters' notice ride in its round trip.

        A simple query stops at its first error, so an error of that round trip, the connection lost included, is the
        COMMIT's own or one of the reset after it. The stored response tells them apart, asked on another connection:
        if it committed, so did the request, whatever failed after it, and this connection (its session in doubt)
        goes back closed."""
        assert self._transaction is not None
        completion = self.settlement.completion
        notice = None
        try:
            if completion is None:  # nothing to tell a failed reset from a failed COMMIT by: the reset comes later
                await self._transaction.commit()
            else:
                notice = self.settlement.notice_sql(self._lender.notice_statement(self.connection))
                # Counted before it is sent, the COMMIT being one query: one that another task sends after the
                # COMMIT, before this one goes on, is seen too (lend_transaction).
                self.queries_at_commit = self.connection._protocol.queries_count + 1  # type: ignore[attr-defined]
                self.clean = await self._lender.commit(self.connection, self._transaction, notice)
        except Exception as error:
            if completion is None or not await self._landed(*completion):
                if isinstance(error, UNAVAILABLE):
                    raise self._unreachable(error) from error
                raise
            self.lost = True  # committed; what failed came after the COMMIT
        self.settlement.committed(notice)

    async def _landed(self, tenant: str, key: str, fence: int) -> bool:
        """Whether the completion under ``fence`` committed (asked after an error in the COMMIT's round trip)."""
        if not self.connection.is_closed() and self.connection.is_in_transaction():
            return False  # still open: it did not commit
        try:
            row = await self._lender.run("committed", (tenant, key, fence), urgent=True)
        except Exception:
            return False  # not known: taken as not committed, and the key's release tells (refused if it did)
        return bool(row is not None and row["committed"])

    async def rollback(self) -> None:
        assert self._transaction is not None
        if self.lost:
            # A statement of ours found the connection dead or silent (a hung server). A ROLLBACK would wait out
            # another timeout behind asyncpg's unfinished cancellation; closing the connection, which the store
            # does as it takes it back, rolls the transaction back on the server.
            raise StoreUnavailable("the connection of the handler's transaction was lost")
        try:
            await self._transaction.rollback()
        except UNAVAILABLE as error:
            raise self._unreachable(error) from error

    def _unreachable(self, error: BaseException) -> StoreUnavailable:
        """A statement found the connection gone, or its server silent: it goes back closed, without a reset that
        would wait out another deadline (``lost``)."""
        self.lost = True
        return StoreUnavailable(str(error) or type(error).__name__)
