"""The PostgreSQL store, on asyncpg.

Each public operation is one statement and one round trip; asyncpg prepares each statement once per connection.
Every database call has a deadline, so a dead server turns into :class:`StoreUnavailable` (and a 503) instead of a
hung request.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, cast

import asyncpg

from idempotency_mw.capture import decode_headers, encode_headers
from idempotency_mw.connections import NO_TIMEOUT, ConnectionPool
from idempotency_mw.lending import LentConnection, remember, reset_sql, set_restore
from idempotency_mw.sql import bookkeeping, check_schema, migrations, queries, session
from idempotency_mw.store import (
    Claim,
    ClaimOutcome,
    PoolExhausted,
    RecordInfo,
    StoredResponse,
    StoreNotMigrated,
    StoreUnavailable,
    TransactionEnded,
)

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

# How a completion in a handler's transaction learns, under REPEATABLE READ or SERIALIZABLE, that another claim of
# the key completed first (its response meets ours), or that the record was deleted meanwhile (the foreign key):
# fenced out, like a completion that finds another fence under READ COMMITTED (sql/queries.sql).
FENCED_OUT = (
    asyncpg.exceptions.SerializationError,
    asyncpg.exceptions.UniqueViolationError,
    asyncpg.exceptions.ForeignKeyViolationError,
)

# asyncpg's names of the isolation levels, by PostgreSQL's.
_ASYNCPG_ISOLATION = {
    "read committed": "read_committed",
    "repeatable read": "repeatable_read",
    "serializable": "serializable",
    "read uncommitted": "read_uncommitted",
}


class PostgresStore:
    """Records in one PostgreSQL table (see ``sql/migrations``).

    ``PostgresStore("postgresql://…")`` opens its own connections on first use, at most ``max_size`` (see
    ``connections.py`` for why they are not an asyncpg pool); ``PostgresStore(pool)`` uses an asyncpg pool the app
    already has and leaves closing it to the app. ``timeout`` bounds every database call in seconds, connecting
    and waiting for a free connection included. ``schema`` is where the tables live; every statement names it,
    so a handler that changes ``search_path`` on a connection the store then uses changes nothing.

    ``prepared_statements=False`` is for a transaction-pooling proxy (PgBouncer's ``pool_mode = transaction`` before
    1.21, or without ``max_prepared_statements``): the store's connections then keep no named prepared statements,
    which such a proxy would send to a server connection that never saw them (see docs/operations.md). It costs a
    round trip per statement. A pool passed in has its own setting: create it with ``statement_cache_size=0``.

    The store's own statements run under READ COMMITTED whatever the database's default isolation level (see
    ``sql/session.sql``); the transactions it lends to handlers keep the database's default. On the connections it
    opens itself this costs nothing per statement. Where it cannot set its sessions (an app's pool, a
    transaction-pooling proxy) and the default is not READ COMMITTED, each statement runs in a READ COMMITTED
    transaction of its own: two more round trips (docs/operations.md).
    """

    def __init__(
        self,
        dsn_or_pool: str | asyncpg.Pool,
        *,
        timeout: float = 5.0,
        min_size: int = 2,
        max_size: int = 20,
        schema: str = "public",
        prepared_statements: bool = True,
    ) -> None:
        if timeout <= 0:
            raise ValueError("PostgresStore timeout must be positive")
        self.timeout = timeout
        self.schema = check_schema(schema)
        self._own: ConnectionPool | None = None
        self._borrowed: asyncpg.Pool | None = None
        if isinstance(dsn_or_pool, str):
            self._own = ConnectionPool(
                dsn_or_pool,
                min_size=min_size,
                max_size=max_size,
                timeout=timeout,
                connection_class=StoreConnection,
                prepared_statements=prepared_statements,
                setup=self._pin_read_committed if prepared_statements else None,
            )
        elif not prepared_statements:
            raise ValueError(
                "prepared_statements=False applies to the connections a DSN-built PostgresStore opens; an asyncpg "
                "pool passed in keeps its own setting: create it with asyncpg.create_pool(..., statement_cache_size=0)"
            )
        else:
            self._borrowed = dsn_or_pool
            # Claims and lent transactions take all but one of the pool's connections at most, as on the store's own
            # pool (connections.py): the last one stays for the work that finishes requests.
            self._ordinary = asyncio.Semaphore(max(1, dsn_or_pool.get_max_size() - 1))
            self._holding_ordinary: set[int] = set()  # id() of the connections checked out under it
        self._sql = queries(self.schema)
        self._prepare = self._own is not None and prepared_statements  # statements as objects on its connections
        # The default isolation level of the database's sessions, once a connection has told it.
        self.database_isolation: str | None = None
        # Whether each statement needs a READ COMMITTED transaction of its own (None: not known yet). Never on
        # connections the store pins to READ COMMITTED as it opens them.
        self._explicit_isolation: bool | None = False if self._prepare else None
        # Claims handed out and not yet completed or released: close() gives them time to settle.
        self._unsettled: set[tuple[str, str, int]] = set()
        self._all_settled: asyncio.Event | None = None  # set when the last one settles while close() waits
        self._closing = False
        self.claim_races = 0  # claims that found no row to answer from and ran claim_locked (benchmarks count them)

    async def open(self) -> None:
        """Connect now (``min_size`` connections) and check that the tables exist, so that a database that cannot
        be reached, or was never migrated, fails at startup: :class:`StoreNotMigrated` names the command to run.

        :meth:`migrate` needs no ``open()`` first (it would refuse a database that is not migrated yet).
        """
        if self._own is not None:
            with _reachable():
                await self._own.open()
        row = await self._fetchrow("migrated")
        if row is None or not row[0]:
            raise StoreNotMigrated(self.schema)

    async def close(self, *, grace: float | None = None) -> None:
        """Refuse new claims, give the claims still being settled up to ``grace`` seconds (default: ``timeout``) to
        complete or release, then close the connections the store opened, those still in use as they come back (a
        pool passed in is the app's to close). A closed store answers every call with :class:`StoreUnavailable`.

        The grace is for a server's graceful shutdown: it cancels the requests still running and then runs the
        app's shutdown at once; each cancelled request releases its key on its way out, and needs a connection for
        that. Without the grace the key would stay in progress for a whole lease, and the client's retry after the
        restart would get 409 until then.
        """
        self._closing = True
        if self._unsettled:
            self._all_settled = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.timeout if grace is None else grace):
                    await self._all_settled.wait()
        if self._own is not None:
            await self._own.close()

    def settled(self, tenant: str, key: str, fence: int) -> None:
        """A claim of this store was completed or released (or fenced out, or the attempt failed): :meth:`close`
        waits no longer on its behalf. The store's own ``complete``/``release`` and its transactions say so
        themselves; a transaction of another kind that completes a record (SQLAlchemy's) calls this."""
        self._unsettled.discard((tenant, key, fence))
        if not self._unsettled and self._all_settled is not None:
            self._all_settled.set()

    async def __aenter__(self) -> PostgresStore:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[asyncpg.Connection]:
        """A connection for code other than ours (the resource-deleted race in the guide), waited for no longer than
        ``timeout``. It comes back with a clean session, whatever the code did to it (see :meth:`_reset`)."""
        connection = await self._acquire()
        lent = LentConnection(connection)
        lost = False
        try:
            await self._prepare_loan(connection)
            if self._lent_isolation() is not None:
                # Pinned for the store's statements; code of the app's gets the database's default back.
                restore = "SELECT set_config('default_transaction_isolation', $1, false)"
                await connection.execute(restore, self.database_isolation, timeout=self.timeout)
            yield cast(asyncpg.Connection, lent)
        except BaseException as error:
            lost = isinstance(error, (*UNAVAILABLE, StoreUnavailable))  # no reset for a connection that is gone
            raise
        finally:
            lent.end()
            await self._give_back_lent(connection, lost=lost)

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[PostgresTransaction]:
        """A transaction on a connection of its own, for a transactional handler (``transaction.py``): begun here,
        committed or rolled back by the caller; the connection comes back with a clean session."""
        connection = await self._acquire()
        transaction = PostgresTransaction(
            connection, self._sql["complete_in_transaction"], self.timeout, self.schema, on_settled=self.settled
        )
        try:
            with _reachable():
                await self._prepare_loan(connection)
            await transaction.begin(self._lent_isolation())
            yield transaction
        finally:
            transaction.lent.end()
            await self._give_back_lent(connection, lost=transaction.lost)

    def statement(self, name: str) -> str:
        """The SQL of one of the store's statements (``sql/queries.sql``: ``complete``, ``forget``, …), in its schema,
        with asyncpg's ``$1`` parameters: for a transaction the store does not own (``idempotency_mw.sqlalchemy``).
        """
        try:
            return self._sql[name]
        except KeyError:
            raise KeyError(f"PostgresStore has no statement {name!r}; it has {', '.join(sorted(self._sql))}") from None

    async def _give_back_lent(self, connection: asyncpg.Connection, *, lost: bool) -> None:
        """Reset a connection lent to code other than ours and give it back; closed if it is lost or the reset
        fails. Even when the reset itself is cancelled, the connection goes back (closed)."""
        healthy = False
        try:
            healthy = not lost and await self._reset(connection)
        finally:
            if not healthy and not connection.is_closed():
                connection.terminate()
            await self._give_back(connection, broken=not healthy)

    async def _prepare_loan(self, connection: asyncpg.Connection) -> None:
        """Before a connection of the app's pool is first lent, read the session state its pool gave it, which its
        reset restores (``lending.py``). The store's own connections know theirs from the start."""
        if self._own is None:
            await remember(connection, time_limit=self.timeout)

    async def _reset(self, connection: asyncpg.Connection) -> bool:
        """Give a lent connection back the session its pool gave it, in one round trip (``lending.reset_sql``): no
        transaction, no role, settings, temp tables, SQL-level prepared statements, advisory locks or LISTEN of the
        handler's, then the pool's own role and settings again (asyncpg's own reset leaves the role, the session
        authorization, temp tables and prepared statements behind). False if the connection is unusable."""
        try:
            if connection.is_closed():
                return False
            if self._own is not None:
                await connection.reset(timeout=self.timeout)  # StoreConnection: the full reset, one round trip
            else:  # an asyncpg pool's connection: ours first, then the pool runs asyncpg's on release
                await connection.execute(reset_sql(connection), timeout=self.timeout)
        except Exception:  # lost, broken or busy: a fresh connection is cheaper than a doubtful one
            return False
        return True

    async def _acquire(self, *, urgent: bool = False) -> asyncpg.Connection:
        """A connection; waiting for one (or connecting) too long, or a database that is gone, is StoreUnavailable."""
        with _reachable():
            if self._own is not None:
                return await self._own.acquire(urgent=urgent)
            pool = self._borrowed
            assert pool is not None
            deadline = asyncio.get_running_loop().time() + self.timeout
            if not urgent:
                try:
                    async with asyncio.timeout_at(deadline):
                        await self._ordinary.acquire()
                except TimeoutError:
                    raise self._exhausted(pool) from None
            try:
                remaining = max(deadline - asyncio.get_running_loop().time(), 0.001)
                proxy = await pool.acquire(timeout=remaining)
            except BaseException as error:
                if not urgent:
                    self._ordinary.release()
                # asyncpg's deadline covers waiting for a free connection and opening one: it was the wait if the
                # pool is full and every connection is in use.
                if (
                    isinstance(error, TimeoutError)
                    and pool.get_idle_size() == 0
                    and pool.get_size() >= pool.get_max_size()
                ):
                    raise self._exhausted(pool) from None
                raise
            if not urgent:
                self._holding_ordinary.add(id(proxy))
            return cast(asyncpg.Connection, proxy)  # a pool's proxy: it has every method of a Connection

    def _exhausted(self, pool: asyncpg.Pool) -> PoolExhausted:
        return PoolExhausted(
            "the asyncpg pool passed to PostgresStore", max_size=pool.get_max_size(), timeout=self.timeout
        )

    async def _give_back(self, connection: asyncpg.Connection, *, broken: bool = False) -> None:
        if self._own is not None:
            self._own.release(connection, broken=broken)
            return
        assert self._borrowed is not None
        if id(connection) in self._holding_ordinary:
            self._holding_ordinary.discard(id(connection))
            self._ordinary.release()
        with contextlib.suppress(Exception):  # a failed reset or a lost connection: asyncpg has terminated it
            await self._borrowed.release(cast(asyncpg.pool.PoolConnectionProxy, connection), timeout=self.timeout)

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[asyncpg.Connection]:
        """A connection for the store's own multi-statement work (migrations); closed after an error."""
        connection = await self._acquire()
        broken = True
        try:
            yield connection
            broken = False
        finally:
            await self._give_back(connection, broken=broken)

    async def _fetchrow(self, name: str, *args: Any) -> asyncpg.Record | None:
        """One statement's first row (None if it returned none), on a connection of its own."""
        row: asyncpg.Record | None = await self._run(name, args, False, False)
        return row

    async def _execute(self, name: str, *args: Any, urgent: bool = False) -> str:
        """One statement's status ("UPDATE 1"), on a connection of its own."""
        status: str = await self._run(name, args, urgent, True)
        return status

    async def _run(self, name: str, args: tuple[Any, ...], urgent: bool, status: bool) -> Any:
        """One statement on a connection of its own: its first row, or with ``status`` its status. A connection
        that saw an error is not reused. ``urgent``: the statement finishes a request (renew, complete, release)
        and goes before new claims for a connection.

        Every request takes this path twice, so it is written for speed (benchmarks/storepath.py times it,
        benchmarks/instructions.py counts its instructions; claim, complete and release call it directly): an
        idle connection is taken without a coroutine, the statement runs as a prepared-statement object kept on the
        connection (no lookup in asyncpg's statement cache), and its deadline is kept by the pool's one timer
        (``connections.Deadlines``) rather than by a timer per statement.
        """
        own = self._own
        connection = own.take(urgent) if own is not None else None
        if connection is None:
            connection = await self._acquire(urgent=urgent)
        result: Any
        try:
            if self._explicit_isolation is None:
                await self._learn_isolation(connection)
            if self._explicit_isolation:
                async with connection.transaction(isolation="read_committed"):
                    if status:
                        result = await connection.execute(self._sql[name], *args, timeout=self.timeout)
                    else:
                        result = await connection.fetchrow(self._sql[name], *args, timeout=self.timeout)
            elif self._prepare:  # the store's own connection, with prepared statements
                assert own is not None
                statements = connection.statements  # type: ignore[attr-defined]  # a StoreConnection (no cast(): a call)
                statement = statements.get(name)
                if statement is None:
                    statement = statements[name] = await connection.prepare(self._sql[name])
                own.deadlines.start(connection)
                try:
                    result = await statement.fetchrow(*args, timeout=NO_TIMEOUT)
                finally:
                    own.deadlines.finish(connection)
                if status:
                    result = statement.get_statusmsg()
            elif status:  # a pool's connection, or no prepared statements (a transaction-pooling proxy)
                result = await connection.execute(self._sql[name], *args, timeout=self.timeout)
            else:
                result = await connection.fetchrow(self._sql[name], *args, timeout=self.timeout)
        except UNAVAILABLE as error:
            await self._give_back(connection, broken=True)
            if own is not None and own.deadlines.was_late(connection):
                late = TimeoutError(f"the database did not answer within {self.timeout}s")
                raise StoreUnavailable(str(late)) from late
            raise StoreUnavailable(str(error) or type(error).__name__) from error
        except NOT_MIGRATED as error:
            await self._give_back(connection, broken=True)
            raise StoreNotMigrated(self.schema, str(error)) from error
        except BaseException:
            await self._give_back(connection, broken=True)
            raise
        if own is not None:
            own.release(connection)
        else:
            await self._give_back(connection)
        return result

    async def _pin_read_committed(self, connection: asyncpg.Connection) -> None:
        """Set up a connection the store opened: its statements run under READ COMMITTED (``sql/session.sql``)."""
        pinned = session()["pin_read_committed"]
        self.database_isolation = await connection.fetchval(pinned, timeout=self.timeout)
        set_restore(connection, "SELECT set_config('default_transaction_isolation', 'read committed', false);")

    def _lent_isolation(self) -> str | None:
        """The isolation level to BEGIN a handler's transaction with: the database's default where the store pinned
        its own connection to READ COMMITTED, else None (the session's default is the database's or the pool's)."""
        if not self._prepare or self.database_isolation in (None, "read committed"):
            return None
        return _ASYNCPG_ISOLATION[self.database_isolation]

    async def _learn_isolation(self, connection: asyncpg.Connection) -> None:
        """On a session the store does not set up, ask once for its default isolation level."""
        level = await connection.fetchval(session()["default_isolation"], timeout=self.timeout)
        self.database_isolation = level
        self._explicit_isolation = level != "read committed"

    # -- the Store protocol --------------------------------------------------------------------------------

    async def claim(self, tenant: str, key: str, fingerprint: bytes, *, lease: float, ttl: float) -> Claim:
        if self._closing:
            raise StoreUnavailable("the idempotency store is closing: it takes no new claims")
        # max: a record never expires under a live lease (sql/queries.sql, renew)
        args = (tenant, key, fingerprint, float(lease), float(max(ttl, lease)), new_fence())
        row = await self._run("claim", args, urgent=False, status=False)
        if row is None:  # lost a race with a concurrent claim of the key (see sql/queries.sql): lock and look again
            self.claim_races += 1
            row = await self._run("claim_locked", args, urgent=False, status=False)
            assert row is not None  # INSERT … ON CONFLICT DO UPDATE … RETURNING always returns the row
        claim = claim_from_row(row)
        if claim.outcome is ClaimOutcome.OWNED:
            self._unsettled.add((tenant, key, claim.fence))
        return claim

    async def renew(self, tenant: str, key: str, fence: int, *, lease: float) -> bool:
        return await self._execute("renew", tenant, key, fence, float(lease), urgent=True) == "UPDATE 1"

    async def complete(self, tenant: str, key: str, fence: int, response: StoredResponse) -> bool:
        try:
            args = completion(tenant, key, fence, response)
            status: str = await self._run("complete", args, urgent=True, status=True)
        finally:
            self.settled(tenant, key, fence)
        return status == "INSERT 0 1"

    async def release(self, tenant: str, key: str, fence: int) -> bool:
        try:
            status: str = await self._run("release", (tenant, key, fence), urgent=True, status=True)
        except asyncpg.ForeignKeyViolationError:
            return False  # its response committed while the release ran: completed, not released
        finally:
            self.settled(tenant, key, fence)
        return status == "DELETE 1"

    async def forget(self, tenant: str, key: str, *, connection: asyncpg.Connection | None = None) -> bool:
        """Delete the record; pass the ``connection`` of a transaction that deletes the resource it names."""
        if connection is None:
            return await self._execute("forget", tenant, key) == "DELETE 1"
        with _reachable(self.schema):
            status = await connection.execute(self._sql["forget"], tenant, key, timeout=self.timeout)
        return bool(status == "DELETE 1")

    async def inspect(self, tenant: str, key: str) -> RecordInfo | None:
        row = await self._fetchrow("inspect", tenant, key)
        if row is None:
            return None
        response = None
        if row["state"] == "completed":
            response = StoredResponse(row["status"], decode_headers(row["headers"]), row["body"], row["body_size"])
        return RecordInfo(
            tenant=row["tenant"],
            key=row["key"],
            state=row["state"],
            fence=row["fence"],
            fingerprint=bytes(row["fingerprint"]),
            attempts=row["attempts"],
            created_at=row["created_at"],
            expires_at=row["expires_at"],
            lease_expires_at=row["lease_expires_at"],
            response=response,
        )

    async def purge_expired(self, *, batch_size: int = 1000) -> int:
        status = await self._execute("purge_expired", batch_size)
        return int(status.split()[-1])

    async def count_expired(self) -> int:
        row = await self._fetchrow("count_expired")
        assert row is not None
        return int(row[0])

    async def stats(self) -> dict[str, Any]:
        row = await self._fetchrow("stats")
        assert row is not None
        return dict(row)

    async def migrate(self) -> list[str]:
        """Create the schema if it is missing and apply the migrations it lacks, in order, each in its own
        transaction; return their names.

        Safe to run repeatedly and from several processes at once: every transaction here, the one that creates
        the schema and the bookkeeping table included, first takes a transaction-scoped advisory lock, so
        concurrent runs take turns and each migration is applied once (see ``sql/migrate.sql``).
        """
        sql = bookkeeping(self.schema)
        applied: list[str] = []
        async with self._connection() as connection:
            async with connection.transaction():
                await connection.execute(sql["lock"])
                if not await connection.fetchval(sql["schema_exists"]):
                    await connection.execute(sql["create_schema"])
                await connection.execute(sql["create_table"])
            for version, name, migration in migrations(self.schema):
                async with connection.transaction():
                    await connection.execute(sql["lock"])
                    if await connection.fetchval(sql["is_applied"], version):
                        continue
                    await connection.execute(migration)
                    await connection.execute(sql["record"], version, name)
                    applied.append(name)
        return applied


@contextlib.contextmanager
def _reachable(schema: str | None = None) -> Iterator[None]:
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


def new_fence() -> int:
    """A claim's fence: a random positive 63-bit token. Only equality is ever asked of fences, so what they need is
    to be unique per claim of a key, also across a restore or a failover, which a sequence cannot promise. The
    bits are the operating system's (what ``secrets.randbits`` reads, without its two Python-level calls)."""
    return int.from_bytes(os.urandom(8)) >> 1 or 1


def claim_from_row(row: asyncpg.Record) -> Claim:
    attempts = row["attempts"]
    if row["owned"]:
        return Claim(ClaimOutcome.OWNED, fence=row["fence"], attempts=attempts)
    if not row["same_request"]:
        return Claim(ClaimOutcome.MISMATCH, attempts=attempts)
    if not row["completed"]:
        return Claim(ClaimOutcome.IN_PROGRESS, attempts=attempts)
    response = StoredResponse(row["status"], decode_headers(row["headers"]), row["body"], row["body_size"])
    return Claim(ClaimOutcome.COMPLETED, response=response, attempts=attempts)


def completion(tenant: str, key: str, fence: int, response: StoredResponse) -> tuple[Any, ...]:
    """The arguments of the ``complete`` statement."""
    headers = encode_headers(response.headers)
    return (tenant, key, fence, response.status, headers, response.body, response.body_size)


class PostgresTransaction:
    """A transaction on one of the store's connections, lent to a transactional handler as ``connection``.

    Every call has the store's deadline; a database that cannot be reached is :class:`StoreUnavailable`, and marks
    the connection ``lost`` (it goes back closed, without a reset that would wait out another deadline).
    """

    def __init__(
        self,
        connection: asyncpg.Connection,
        complete_sql: str,
        timeout: float,
        schema: str,
        on_settled: Callable[[str, str, int], None] | None = None,
    ) -> None:
        self.connection = connection
        self.lent = LentConnection(connection)  # what the handler gets: refused once the request has ended
        self.lost = False
        self._transaction: asyncpg.transaction.Transaction | None = None
        self._complete_sql = complete_sql
        self._timeout = timeout
        self._schema = schema
        self.settlement = Settlement(on_settled)

    async def begin(self, isolation: str | None = None) -> None:
        """BEGIN, with ``isolation`` (asyncpg's spelling) or the session's default."""
        with self._reachable():
            self._transaction = self.connection.transaction(isolation=isolation)  # type: ignore[arg-type]
            await self._transaction.start()

    async def complete(self, tenant: str, key: str, fence: int, response: StoredResponse) -> bool:
        if not self.connection.is_in_transaction():
            # The handler ran COMMIT or ROLLBACK itself. Completing now would write the record on its own: after a
            # ROLLBACK, a retry would be told of an effect that never happened.
            raise TransactionEnded.by_the_handler("connection", "async with connection.transaction(): ...")
        args = completion(tenant, key, fence, response)
        try:
            with self._reachable(self._schema):
                status = await self.connection.execute(self._complete_sql, *args, timeout=self._timeout)
        except FENCED_OUT:
            status = "INSERT 0 0"
        return self.settlement.completed(tenant, key, fence, status == "INSERT 0 1")

    async def commit(self) -> None:
        assert self._transaction is not None
        with self._reachable():
            await self._transaction.commit()
        self.settlement.committed()

    async def rollback(self) -> None:
        assert self._transaction is not None
        with self._reachable():
            await self._transaction.rollback()

    @contextlib.contextmanager
    def _reachable(self, schema: str | None = None) -> Iterator[None]:
        try:
            with _reachable(schema):
                yield
        except StoreUnavailable:
            self.lost = True
            raise


class Settlement:
    """What a transaction that completes a claim tells ``on_settled`` (``PostgresStore.settled``, which ``close()``
    waits on): the claim is settled once its completion is committed, or at once if it was fenced out (the key is
    another claim's now). A completion rolled back is not settled here: the middleware releases the key."""

    def __init__(self, on_settled: Callable[[str, str, int], None] | None) -> None:
        self._on_settled = on_settled
        self._completed: tuple[str, str, int] | None = None

    def completed(self, tenant: str, key: str, fence: int, done: bool) -> bool:
        """Note the outcome of the completion statement; returns ``done``."""
        if done:
            self._completed = (tenant, key, fence)
        elif self._on_settled is not None:
            self._on_settled(tenant, key, fence)
        return done

    def committed(self) -> None:
        if self._completed is not None and self._on_settled is not None:
            self._on_settled(*self._completed)


class StoreConnection(asyncpg.Connection):
    """The connections a DSN-built store opens: their reset (when a lent one comes back) is the full one of
    ``sql/reset_session.sql``, in one round trip, instead of asyncpg's partial one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The store's statements, prepared on this connection as first used (PostgresStore._run), unless the
        # store keeps no prepared statements (a transaction-pooling proxy).
        self.statements: dict[str, asyncpg.prepared_stmt.PreparedStatement] = {}

    def get_reset_query(self) -> str:
        return reset_sql(self)
