"""SQLAlchemy 2 (async, asyncpg driver) in a transactional handler's transaction.

from idempotency_mw.sqlalchemy import IdempotencySession, SQLAlchemyStore

store = SQLAlchemyStore(PostgresStore(dsn), engine)   # engine = create_async_engine("postgresql+asyncpg://…")
app.add_middleware(IdempotencyMiddleware, store=store, transactional=True)

@app.post("/v1/transfers")
async def transfer(session: IdempotencySession) -> dict: ...

The handler's ``AsyncSession`` is bound to a connection of the app's own engine, in the transaction that the
middleware completes the idempotency record in and commits once the response is final: the ORM writes and the
record commit together, or neither does. Claims, lease renewals and releases still go through the PostgresStore's
own connections. :class:`SQLAlchemyConnector` is the connector that lends the engine's connections
(procrastinate's ``contrib/sqlalchemy`` is the model); :class:`SQLAlchemyStore` is a PostgresStore that uses it.
With Alembic, :func:`alembic_include_name` keeps autogenerate away from the store's tables, and a migration runs
``idempotency_mw.postgres.migration_statements()`` (docs/operations.md, "Alembic").
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, Self

import asyncpg

try:
    from sqlalchemy import exc as sa_exc
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, AsyncTransaction
    from sqlalchemy.pool import QueuePool
except ImportError as error:  # sqlalchemy is an optional dependency of the package
    raise ImportError("idempotency_mw.sqlalchemy needs sqlalchemy: pip install 'idempotency-mw[sqlalchemy]'") from error
from starlette.requests import HTTPConnection

from idempotency_mw import _sqlalchemy_recovery as recovery
from idempotency_mw._context import idempotency_context
from idempotency_mw.postgres._connector import Connector, Listener, default_isolation
from idempotency_mw.postgres._lending import FENCED_OUT, Settlement, remember, reset_sql
from idempotency_mw.postgres._records import NOT_MIGRATED, UNAVAILABLE, Records, caused_by, run_unprepared
from idempotency_mw.postgres._sql import check_schema
from idempotency_mw.postgres._sql import session as session_sql  # session.sql, by name: here "session" is the ORM's
from idempotency_mw.postgres._store import PostgresStore
from idempotency_mw.store import (
    Claim,
    PoolExhausted,
    RecoveryPoint,
    StoredResponse,
    StoreNotMigrated,
    StoreUnavailable,
    TransactionEnded,
)


class SQLAlchemyConnector:
    """The connector of a store whose lent transactions run on the app's SQLAlchemy engine
    (``postgresql+asyncpg://``), each with an ``AsyncSession`` of ``session_class`` bound to it. The store's other
    statements (claims, renewals, completions, releases, operators' commands) run on ``statements``, the store's own
    connections. The engine stays the app's: nothing here disposes of it."""

    def __init__(self, engine: AsyncEngine, statements: Connector, *, session_class: type[AsyncSession]) -> None:
        if not isinstance(engine, AsyncEngine):
            raise TypeError(
                f"SQLAlchemyStore needs an AsyncEngine (sqlalchemy.ext.asyncio.create_async_engine), "
                f"not {type(engine).__name__}"
            )
        dialect = engine.dialect
        if (dialect.name, dialect.driver) != ("postgresql", "asyncpg"):
            raise ValueError(
                f"SQLAlchemyStore needs an engine on PostgreSQL's asyncpg driver (postgresql+asyncpg://…), "
                f"not {dialect.name}+{dialect.driver}"
            )
        if not (isinstance(session_class, type) and issubclass(session_class, AsyncSession)):
            raise TypeError(f"session_class must be AsyncSession or a subclass of it, not {session_class!r}")
        self.engine = engine
        self.session_class = session_class
        self._statements = statements
        self._explicit: bool | None = None  # whether the engine's sessions need READ COMMITTED asked for the claim

    @property
    def timeout(self) -> float:
        return self._statements.timeout

    @property
    def database_isolation(self) -> str | None:
        return self._statements.database_isolation

    async def run(self, name: str, args: tuple[Any, ...], *, urgent: bool = False, status: bool = False) -> Any:
        return await self._statements.run(name, args, urgent=urgent, status=status)

    def connection(self) -> contextlib.AbstractAsyncContextManager[Any]:
        return self._statements.connection()

    def session(self) -> contextlib.AbstractAsyncContextManager[Any]:
        return self._statements.session()

    def listening(self, channel: str, notified: Listener) -> contextlib.AbstractAsyncContextManager[Any]:
        return self._statements.listening(channel, notified)

    async def open(self) -> None:
        """Open the store's own connections, and check that the engine reaches the same database: the records
        complete in the handlers' transactions, on the engine."""
        await self._statements.open()
        identity = "SELECT current_database() AS database, pg_postmaster_start_time() AS server_started"
        async with self._statements.connection() as connection:
            row = await connection.fetchrow(identity, timeout=self.timeout)
            assert row is not None
            ours = tuple(row)
        with _reachable(self.timeout):
            async with asyncio.timeout(self.timeout), self.engine.connect() as connection:
                await _refuse_autocommit(connection)
                theirs = tuple((await connection.exec_driver_sql(identity)).one())
        if theirs != ours:
            raise ValueError(
                f"SQLAlchemyStore: the engine reaches database {theirs[0]!r} (server started {theirs[1]}), the "
                f"PostgresStore database {ours[0]!r} (server started {ours[1]}). The handlers' transactions complete "
                "the idempotency records, so both must use the same database"
            )

    async def close(self) -> None:
        await self._statements.close()  # the engine is the app's, to dispose of when it is done with it

    def _no_connection(self, timeout: float) -> StoreUnavailable:
        """Why no connection of the engine came in time: :class:`PoolExhausted` when every one its pool may open is
        checked out (the fix is the pool's size), else the database did not answer."""
        pool = self.engine.pool
        overflow = getattr(pool, "_max_overflow", -1)  # QueuePool's, since 2007; -1: no limit, never exhausted
        if isinstance(pool, QueuePool) and overflow >= 0 and pool.checkedout() >= pool.size() + overflow:
            return PoolExhausted(
                "the SQLAlchemy engine's pool",
                max_size=pool.size() + overflow,
                timeout=timeout,
                knob="pool_size or max_overflow of create_async_engine",
            )
        return StoreUnavailable(
            f"no connection of the SQLAlchemy engine within {timeout:g}s: the database does not answer"
        )

    @contextlib.asynccontextmanager
    async def transaction(self, records: Records) -> AsyncIterator[SQLAlchemyTransaction]:
        """A connection of the engine for one transactional request, with a session bound to it: the claim is taken
        on it, then the transaction begins on it; committed or rolled back by the caller. The connection goes back
        to the engine's pool with a clean session, or invalidated if it was lost."""
        timeout = self.timeout
        try:
            async with asyncio.timeout(timeout):
                with _reachable(timeout):
                    connection = await self.engine.connect()
        except TimeoutError as error:  # the store's deadline
            raise self._no_connection(timeout) from error
        except StoreUnavailable as error:
            if isinstance(error.__cause__, sa_exc.TimeoutError):  # the pool's own pool_timeout, when shorter
                raise self._no_connection(timeout) from error
            raise
        try:
            await _refuse_autocommit(connection)
            raw = await connection.get_raw_connection()
            with _reachable(timeout):
                await remember(raw.driver_connection, time_limit=timeout)  # the pool's session state, to restore
                driver: Any = raw.driver_connection  # asyncpg's Connection
                if self._explicit is None:  # the claim runs READ COMMITTED, whatever the engine's sessions default to
                    self._explicit = await default_isolation(driver, timeout) != "read committed"
        except BaseException:
            await connection.close()
            raise
        # The session works in a savepoint of the transaction: its own commit() and rollback() never end it.
        session = lent_session_class(self.session_class)(
            bind=connection, join_transaction_mode="create_savepoint", expire_on_commit=False, info={LENT: True}
        )
        transaction = SQLAlchemyTransaction(records, connection, session, explicit=self._explicit)
        app_failed = True
        try:
            yield transaction
            app_failed = False
        finally:
            await transaction.give_back(app_failed=app_failed)


class SQLAlchemyStore(PostgresStore):
    """A :class:`~idempotency_mw.postgres.PostgresStore` whose transactions, lent to transactional handlers, run on
    the app's SQLAlchemy engine (``postgresql+asyncpg://``), with an ``AsyncSession`` of ``session_class``
    (:class:`SQLAlchemyConnector`).

    It keeps the records, the settings and the connections of ``store``, which it stands in for: give the
    middleware this one. The engine must reach the store's database (:meth:`open` checks it), and stays the app's:
    :meth:`close` closes the store's own connections only.
    """

    def __init__(
        self, store: PostgresStore, engine: AsyncEngine, *, session_class: type[AsyncSession] = AsyncSession
    ) -> None:
        if not isinstance(store, PostgresStore):
            raise TypeError(f"SQLAlchemyStore keeps its records in a PostgresStore, not {type(store).__name__}")
        vars(self).update(vars(store))  # the same records, settings and connections as the store it stands in for
        self._connect(SQLAlchemyConnector(engine, store.connector, session_class=session_class))
        self.store = store
        self.engine = engine
        self.session_class = session_class

    def bind(self, pool: asyncpg.Pool) -> Self:
        """Put the store's own statements on the app's asyncpg ``pool`` (:meth:`PostgresStore.bind
        <idempotency_mw.postgres.PostgresStore.bind>`); the handlers' transactions stay on the engine."""
        self.store.bind(pool)
        self._connect(SQLAlchemyConnector(self.engine, self.store.connector, session_class=self.session_class))
        return self

    async def forget(self, tenant: str, key: str, *, connection: Any = None) -> bool:
        """Delete the record; pass the ``connection`` (``await session.connection()``) of a transaction that deletes
        the resource it names, so that both happen or neither does; an asyncpg connection is taken too."""
        if not isinstance(connection, AsyncConnection):
            return await super().forget(tenant, key, connection=connection)
        with _reachable(self.timeout, self.schema):
            result = await connection.exec_driver_sql(self._records.sql["forget"], (tenant, key))
        return result.first() is not None


class SQLAlchemyTransaction:
    """A transaction on a connection of the app's engine, lent to a transactional handler: ``session`` (an
    ``AsyncSession``) and ``connection`` (the ``AsyncConnection`` under it) write in it, and the record completes in
    it.

    The session works in a savepoint (``join_transaction_mode="create_savepoint"``): its ``commit()`` releases the
    savepoint and its ``rollback()`` returns to it, and neither ends the transaction. Its pending changes are flushed
    before the record is written and before the transaction commits. Our own statements have the store's deadline;
    a database that cannot be reached is :class:`StoreUnavailable` and marks the connection ``lost`` (it is
    invalidated, not reused).
    """

    def __init__(self, records: Records, connection: AsyncConnection, session: AsyncSession, *, explicit: bool) -> None:
        self.connection = connection
        self.session = session
        self.lost = False
        self._transaction: AsyncTransaction | None = None
        self._records = records
        self._explicit = explicit  # the claim asks for READ COMMITTED: the engine's sessions default to another level
        self._timeout = records.timeout
        self._schema = records.schema
        self.settlement = Settlement(records)

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
        """The claim, on this connection's driver connection, before the transaction begins (SQLAlchemy's adapter
        has begun nothing yet: it sends its BEGIN just before the first statement)."""
        raw = await self.connection.get_raw_connection()
        driver: Any = raw.driver_connection  # asyncpg's Connection
        sql, timeout, explicit = self._records.sql, self._timeout, self._explicit

        async def run(name: str, args: tuple[Any, ...]) -> Any:
            with _reachable(timeout, self._schema):
                return await run_unprepared(driver, sql[name], args, timeout, False, explicit)

        try:
            fingerprints = (fingerprint, *matching)
            return await self._records.claim(
                run, tenant, key, fingerprints, lease=lease, ttl=ttl, flush=False, request=request, parts=parts
            )
        except StoreUnavailable as error:
            if not isinstance(error, StoreNotMigrated):
                self.lost = True
            raise

    async def begin(self) -> None:
        """BEGIN, marked (``mark_transaction``): the completion and the recovery points are written in this
        transaction only, not in one the handler begins after ending it (``ROLLBACK; BEGIN``, ``COMMIT AND CHAIN``).

        SQLAlchemy's asyncpg adapter sends its BEGIN in a round trip of its own, just before the first statement,
        from state of its own that no public hook reaches: the mark cannot ride in it. So the mark is the first
        statement, sent now (the adapter's BEGIN just before it): one round trip more than the BEGIN alone, two while
        the adapter has not yet prepared the mark on this connection (every time, with its statement cache off)."""
        with self._reachable():
            self._transaction = await self.connection.begin()
            async with self._deadline():
                await self.connection.exec_driver_sql(session_sql()["mark_transaction"])

    async def complete(self, tenant: str, key: str, fence: int, response: StoredResponse) -> bool:
        await self._refuse_if_ended()  # first: a flush outside the transaction would commit on its own
        await self._end_session()
        try:
            with self._reachable(self._schema):
                async with self._deadline():
                    result = await self.connection.exec_driver_sql(
                        self._records.sql["complete_in_transaction"],
                        (*self._records.completion(tenant, key, fence, response), True),  # marked (begin)
                    )
        except sa_exc.DBAPIError as error:
            if not caused_by(error, FENCED_OUT):
                raise
            # another claim's response, or a record deleted meanwhile (sql/queries.sql)
            return self.settlement.completed(tenant, key, fence, False)
        done = result.rowcount == 1
        if not done:  # fenced out, or written nowhere: the handler ended the transaction and began another
            await self._refuse_if_unmarked()
        return self.settlement.completed(tenant, key, fence, done)

    async def recovery_points(self, tenant: str, key: str, fence: int) -> list[RecoveryPoint]:
        return await recovery.recovery_points(self, tenant, key, fence)  # _sqlalchemy_recovery.py, as the next two

    async def record_steps(self, tenant: str, key: str, fence: int, points: list[RecoveryPoint]) -> bool:
        return await recovery.record_steps(self, tenant, key, fence, points)

    async def lapse(self, tenant: str, key: str, fence: int) -> bool:
        return await recovery.lapse(self, tenant, key, fence)

    async def commit(self) -> None:
        assert self._transaction is not None
        await self._end_session()  # a request without a key completes no record: the flush is here
        with self._reachable():
            async with self._deadline():
                await self._transaction.commit()
        self.settlement.committed()

    async def rollback(self) -> None:
        assert self._transaction is not None
        with self._reachable():
            if self.lost or self.connection.invalidated:
                # Gone with its connection. SQLAlchemy's own rollback of an invalidated connection says nothing,
                # but the database could not be reached: the caller must hear it (503), as with asyncpg.
                raise StoreUnavailable("the connection of the handler's transaction was lost")
            async with self._deadline():
                await self._transaction.rollback()

    async def _refuse_if_ended(self) -> None:
        """A raw COMMIT or ROLLBACK through the session or connection (``text("ROLLBACK")``) ends the transaction on
        the server while SQLAlchemy, which does not read the SQL it passes on, still counts it open; the session's
        flush and the completion would then each commit on their own and, after a ROLLBACK, record an effect that
        never happened. Asked before the flush. asyncpg knows the server's transaction state from every answer: no
        round trip. (One the handler began after it is told by the mark: :meth:`_refuse_if_unmarked`.)"""
        raw = await self.connection.get_raw_connection()
        driver: Any = raw.driver_connection  # asyncpg's Connection
        if not driver.is_in_transaction():
            raise TransactionEnded.by_the_handler("session or connection", "async with session.begin_nested(): ...")

    async def _refuse_if_unmarked(self) -> None:
        """:class:`TransactionEnded` if the transaction :meth:`begin` marked is no longer the connection's: the
        handler ended it and began another, or ran RESET ALL (its mark is gone: ``transaction_ended``). Asked when a
        statement that writes in the marked transaction alone wrote nothing, which is otherwise a newer claim's
        fence."""
        with self._reachable():
            async with self._deadline():
                result = await self.connection.exec_driver_sql(session_sql()["transaction_ended"])
        if result.scalar():
            raise TransactionEnded.by_the_handler("session or connection", "async with session.begin_nested(): ...")

    async def _end_session(self) -> None:
        """Flush the session's pending changes into the transaction: the handler is done with it.

        A session whose flush failed and that was not rolled back (the handler caught the error and went on, but
        what the session had written is gone: in a savepoint it began, everything since the savepoint) is refused as
        its own commit would refuse it: ``PendingRollbackError``.
        """
        with self._reachable():
            if self.session.info.get(DISCARDED):
                raise sa_exc.PendingRollbackError(
                    "the request's session was closed after a failed flush, and what it had written was rolled back "
                    "with it: the answer cannot be recorded without the writes it was built on"
                )
            sync_session = self.session.sync_session  # the proxy's own getters fail on SQLAlchemy 2.0.0
            transaction = sync_session.get_nested_transaction() or sync_session.get_transaction()
            while transaction is not None:  # the innermost savepoint the handler began, up to the session's own
                if not transaction.is_active:
                    await self.session.commit()  # raises, as it would for the handler
                transaction = transaction.parent
            await self.session.flush()

    async def give_back(self, *, app_failed: bool) -> None:
        """Roll back what is still open, close the session, reset the connection and give it back to the pool
        (invalidated, if it was lost or the reset failed). Even when this is cancelled, the connection goes back.

        A transaction begun on the connection after ours ended (the session used in a background task, or while a
        response over the cap streams) is rolled back, and unless the app failed anyway, a RuntimeError says so:
        those writes were never part of the request's transaction.
        """
        late = (
            not self.connection.invalidated
            and self.connection.in_transaction()
            and (self._transaction is None or not self._transaction.is_active)
        )
        healthy = False
        try:
            healthy = await self._clean()
        finally:
            try:
                if not healthy:
                    await self._drop()
            finally:
                await self.connection.close()
        if late and not app_failed:
            raise RuntimeError(
                "the request's SQLAlchemy session (or connection) was used after its transaction had ended, and what "
                "it did there was rolled back: write before the response is returned, and give background tasks a "
                "session of their own"
            )

    async def _drop(self) -> None:
        """Close the connection at once and have the pool forget it. SQLAlchemy's asyncpg adapter says goodbye to
        the server as it invalidates a connection, and waits up to 2 seconds for a server that may have stopped
        answering (a hung host): closing the socket first leaves it nothing to wait for."""
        if not self.connection.invalidated:
            raw = await self.connection.get_raw_connection()
            driver: Any = raw.driver_connection  # asyncpg's Connection
            driver.terminate()
        await self.connection.invalidate()

    async def _clean(self) -> bool:
        """Give the connection the session of a fresh one: no transaction, then ``sql/reset_session.sql`` on the
        driver's connection. SQLAlchemy's pool only rolls back, which would leave a role, settings, temp tables,
        prepared statements, advisory locks or a LISTEN of this handler to the next user of the connection.
        False if the connection is unusable."""
        usable = not (self.lost or self.connection.invalidated)
        try:
            if usable and self.connection.in_transaction():
                async with self._deadline():
                    await self.connection.rollback()
            self.session.info[LENT] = False  # a plain close from here on
            await self.session.close()  # its savepoint ended with the transaction: no statement
            if usable:
                raw = await self.connection.get_raw_connection()
                driver: Any = raw.driver_connection  # asyncpg's Connection
                # The reset, then the waiters of a committed completion told (``notify_waiters``): one round trip.
                await driver.execute(
                    reset_sql(driver, watched=False) + "\n" + self.settlement.notice, timeout=self._timeout
                )
        except Exception:  # lost, broken or busy: a fresh connection is cheaper than a doubtful one
            return False
        return usable

    @contextlib.asynccontextmanager
    async def _deadline(self) -> AsyncIterator[None]:
        """The store's timeout on one of our statements, kept by closing the connection when it runs out (as the
        PostgresStore's pool does) rather than by cancelling the statement: SQLAlchemy answers a cancelled statement
        by saying goodbye to the server, and waits up to 2 seconds more for one that has stopped answering."""
        raw = await self.connection.get_raw_connection()
        driver: Any = raw.driver_connection  # asyncpg's Connection
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            driver.terminate()

        timer = asyncio.get_running_loop().call_later(self._timeout, expire)
        try:
            yield
        except Exception as error:
            if expired:
                self.lost = True
                raise StoreUnavailable(f"the database did not answer within {self._timeout:g}s") from error
            raise
        finally:
            timer.cancel()

    @contextlib.contextmanager
    def _reachable(self, schema: str | None = None) -> Iterator[None]:
        try:
            with _reachable(self._timeout, schema):
                yield
        except StoreUnavailable as error:
            if not isinstance(error, StoreNotMigrated):
                self.lost = True
            raise


LENT = "idempotency_mw.lent"  # in Session.info while the session is lent to its request
DISCARDED = "idempotency_mw.discarded"  # in Session.info once a close threw away what a failed flush left


def lent_session_class(session_class: type[AsyncSession]) -> type[AsyncSession]:
    """``session_class`` as lent to a handler: closing it keeps what it wrote.

    The session works in a savepoint of the request's transaction, and ``AsyncSession.close()`` rolls that back. A
    handler that closes its session (``await session.close()``, or leaving ``async with session:``) would then lose
    its writes while its answer, built on them, was recorded. Here the close releases the savepoint instead (what
    ``commit()`` does in this mode: the writes commit later, with the record). A session whose flush failed cannot
    keep anything: its close rolls back as usual, and the request fails rather than record that answer.
    """

    async def keep(session: AsyncSession) -> None:
        if session.info.get(LENT):
            transaction = session.sync_session.get_transaction()
            if transaction is not None:
                if transaction.is_active:
                    await session.commit()
                else:
                    session.info[DISCARDED] = True

    async def close(self: AsyncSession) -> None:
        await keep(self)
        await session_class.close(self)

    async def reset(self: AsyncSession) -> None:  # SQLAlchemy 2.0.22's close that leaves the session usable
        await keep(self)
        await session_class.reset(self)

    lent = _lent_classes.get(session_class)
    if lent is None:
        namespace = {"close": close, "reset": reset, "__doc__": session_class.__doc__}
        lent = _lent_classes[session_class] = type(f"Lent{session_class.__name__}", (session_class,), namespace)
    return lent


_lent_classes: dict[type[AsyncSession], type[AsyncSession]] = {}


async def _refuse_autocommit(connection: AsyncConnection) -> None:
    """An engine in AUTOCOMMIT begins no transaction: the handler's writes would commit one by one, without the
    record. No round trip: SQLAlchemy's asyncpg adapter knows its mode."""
    raw = await connection.get_raw_connection()
    if getattr(raw.dbapi_connection, "autocommit", False):
        raise ValueError(
            'SQLAlchemyStore needs an engine that runs transactions, not one in isolation_level="AUTOCOMMIT": the '
            "handler's writes would commit one by one, and without the idempotency record"
        )


@contextlib.contextmanager
def _reachable(timeout: float, schema: str | None = None) -> Iterator[None]:
    """Turn "the database cannot be reached" into :class:`StoreUnavailable` and, around the store's own statements
    in ``schema``, "the tables are missing" into :class:`StoreNotMigrated`; let the rest be.

    SQLAlchemy wraps the driver's errors (``DBAPIError``, with asyncpg's exception as the cause); a lost connection
    is ``connection_invalidated``; no free connection in the engine's pool is SQLAlchemy's ``TimeoutError``.
    """
    try:
        yield
    except StoreUnavailable:
        raise
    except sa_exc.TimeoutError as error:
        raise StoreUnavailable(f"no connection of the SQLAlchemy engine's pool came free: {error}") from error
    except Exception as error:
        if isinstance(error, sa_exc.DBAPIError) and error.connection_invalidated:
            raise StoreUnavailable(f"the connection was lost: {error.orig}") from error
        cause: BaseException | None = error
        while cause is not None:
            if isinstance(cause, TimeoutError):
                raise StoreUnavailable(f"the database did not answer within {timeout:g}s") from error
            if isinstance(cause, UNAVAILABLE):
                raise StoreUnavailable(str(cause) or type(cause).__name__) from error
            if schema is not None and isinstance(cause, NOT_MIGRATED):
                raise StoreNotMigrated(schema, str(cause)) from error
            cause = cause.__cause__
        raise


def idempotency_session(request: HTTPConnection) -> AsyncSession:
    """The session of a transactional route's transaction (a :class:`SQLAlchemyStore`): what Starlette handlers
    call, and what :data:`IdempotencySession` gives FastAPI handlers."""
    context = idempotency_context(request)
    if context is None:
        raise RuntimeError("this route is not handled by IdempotencyMiddleware (is it added to the app?)")
    transaction = context.transaction
    if transaction is None:
        raise RuntimeError(
            "this route is not transactional: use @idempotent(transactional=True) or "
            "IdempotencyMiddleware(transactional=True) to get its database transaction"
        )
    if not isinstance(transaction, SQLAlchemyTransaction):
        raise RuntimeError(
            f"the middleware's store lends {type(transaction).__name__}, not a SQLAlchemy session: pass "
            "store=SQLAlchemyStore(PostgresStore(…), engine) to IdempotencyMiddleware"
        )
    return transaction.session


try:
    from fastapi import Depends
except ImportError:  # FastAPI is optional here: Starlette handlers call idempotency_session(request)
    if not TYPE_CHECKING:

        def __getattr__(name: str) -> NoReturn:
            if name == "IdempotencySession":
                raise ImportError(
                    "idempotency_mw.sqlalchemy.IdempotencySession needs fastapi: pip install 'idempotency-mw[fastapi]'"
                )
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
else:
    IdempotencySession = Annotated[AsyncSession, Depends(idempotency_session)]
    """The session of a transactional route: its writes commit with the idempotency record, or not at all."""


# -- Alembic ------------------------------------------------------------------------------------------------------

STORE_TABLES = frozenset(
    {"idempotency_records", "idempotency_responses", "idempotency_recovery_points", "idempotency_replays",
     "idempotency_schema_migrations", "idempotency_fence"}
)  # fmt: skip
"""What the store keeps in its schema (the sequence only in schemas migrated before 0002)."""

NameFilter = Callable[[str | None, str, Mapping[str, str | None]], bool]


def alembic_include_name(schema: str = "public", *, then: NameFilter | None = None) -> NameFilter:
    """An ``include_name`` for Alembic's ``context.configure(...)``: ``alembic revision --autogenerate`` and
    ``alembic check`` leave the store's tables in ``schema`` alone (without it they propose to drop them, as they
    are in no model). ``then``: the app's own ``include_name``, asked about every other name."""
    check_schema(schema)

    def include_name(name: str | None, type_: str, parent_names: Mapping[str, str | None]) -> bool:
        if type_ == "table" and name in STORE_TABLES and (parent_names.get("schema_name") or "public") == schema:
            return False
        return then(name, type_, parent_names) if then is not None else True

    return include_name


__all__ = [
    "STORE_TABLES",
    "IdempotencySession",
    "SQLAlchemyConnector",
    "SQLAlchemyStore",
    "SQLAlchemyTransaction",
    "alembic_include_name",
    "idempotency_session",
]
