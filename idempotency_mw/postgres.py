"""The PostgreSQL store, on asyncpg: the records of ``sql/queries.sql``, on the connections of a connector.

Each public operation is one statement and one round trip (asyncpg prepares each statement once per connection),
with the store's deadline, so a dead server turns into :class:`StoreUnavailable` (and a 503) instead of a hung
request. Where the connections come from, the store's own pool or the app's, is ``connectors.py``'s business.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any, Self

import asyncpg

from idempotency_mw.connectors import AppPool, Connector, OwnPool, Unbound, lent_connection, reachable
from idempotency_mw.lending import LentConnection
from idempotency_mw.rows import claim_from_row, completion, new_fence, record_from_row, reseal_rows
from idempotency_mw.sql import check_schema, migrate, queries
from idempotency_mw.store import (
    Claim,
    ClaimOutcome,
    RecordInfo,
    ResealedBatch,
    StoredResponse,
    StoreNotMigrated,
    StoreUnavailable,
    Subscription,
    TransactionEnded,
)
from idempotency_mw.transaction import Settlement
from idempotency_mw.urls import postgres_url
from idempotency_mw.waiting import SettlementListener, Waiters

if TYPE_CHECKING:
    from idempotency_mw.encryption import ResponseCipher

# How a completion in a handler's transaction learns that another claim's response is stored (the primary key) or
# that the record was deleted meanwhile (the foreign key): fenced out, like a completion that finds another fence
# (sql/queries.sql). Under REPEATABLE READ and SERIALIZABLE, the primary key met in a row the snapshot cannot see is
# a serialization failure instead, which a conflict of the handler's own writes can raise just as well: that one
# fails the transaction, and the release that follows tells the two apart (transaction.py).
FENCED_OUT = (
    asyncpg.exceptions.UniqueViolationError,
    asyncpg.exceptions.ForeignKeyViolationError,
)

Run = Callable[[str, tuple[Any, ...]], Any]  # one statement by name and arguments: its first row


class PostgresStore:
    """Records in PostgreSQL (see ``sql/migrations``).

    ``PostgresStore("postgresql://…")`` opens its own connections on first use, at most ``max_size`` (see
    ``connections.py`` for why they are not an asyncpg pool); SQLAlchemy's spelling of the URL
    (``postgresql+asyncpg://…``, one ``DATABASE_URL`` for the app's engine and the store) is taken too, and a URL
    of another database is a ``ValueError``. ``PostgresStore(pool)`` uses an asyncpg pool the app already has and
    leaves closing it to the app. ``timeout`` bounds every database call in seconds, connecting
    and waiting for a free connection included. ``schema`` is where the tables live; every statement names it,
    so a handler that changes ``search_path`` on a connection the store then uses changes nothing.

    ``prepared_statements=False`` is for a transaction-pooling proxy (PgBouncer's ``pool_mode = transaction`` before
    1.21, or without ``max_prepared_statements``): the store's connections then keep no named prepared statements,
    which such a proxy would send to a server connection that never saw them (see docs/operations.md). It costs a
    round trip per statement. A pool passed in has its own setting: create it with ``statement_cache_size=0``.

    The store's own statements run under READ COMMITTED whatever the database's default isolation level; the
    transactions it lends to handlers keep the database's default (``connectors.py``).

    ``cipher`` (an :class:`~idempotency_mw.encryption.ResponseCipher`) seals every response it stores, in its own
    completions and in handlers' transactions alike, and opens them for replays and ``inspect``; a response stored
    plain is refused unless the cipher allows it. See docs/configuration.md, "Encrypting stored responses".
    """

    def __init__(
        self,
        dsn_or_pool: str | asyncpg.Pool | None = None,
        *,
        timeout: float = 5.0,
        min_size: int = 2,
        max_size: int = 20,
        schema: str = "public",
        prepared_statements: bool = True,
        cipher: ResponseCipher | None = None,
    ) -> None:
        if timeout <= 0:
            raise ValueError("PostgresStore timeout must be positive")
        self.timeout = timeout
        self.cipher = cipher
        self.schema = check_schema(schema)
        self._sql = queries(self.schema)
        self._connector: Connector
        if isinstance(dsn_or_pool, str):
            self._connector = OwnPool(
                postgres_url(dsn_or_pool),
                self._sql,
                self.schema,
                timeout=timeout,
                min_size=min_size,
                max_size=max_size,
                prepared_statements=prepared_statements,
            )
        elif not prepared_statements:
            raise ValueError(
                "prepared_statements=False applies to the connections a DSN-built PostgresStore opens; an asyncpg "
                "pool passed in keeps its own setting: create it with asyncpg.create_pool(..., statement_cache_size=0)"
            )
        elif dsn_or_pool is None:
            self._connector = Unbound(timeout)  # until bind(): the app's pool, made in its lifespan
        else:
            self._connector = AppPool(dsn_or_pool, self._sql, self.schema, timeout=timeout)
        self._bindable = dsn_or_pool is None
        # Claims handed out and not yet completed or released: close() gives them time to settle.
        self._unsettled: set[tuple[str, str, int]] = set()
        self._all_settled: asyncio.Event | None = None  # set when the last one settles while close() waits
        self._closing = False
        self.claim_races = 0  # claims that found no row to answer from and ran claim_locked (benchmarks count them)
        self._waiters = Waiters()  # requests waiting for a claim of another's to settle (waiting.py)
        self._listener = SettlementListener(self._connector, self.schema, self._waiters)
        self._explicit_elsewhere: bool | None = None  # claims on connections of no connector's (SQLAlchemy's)

    def bind(self, pool: asyncpg.Pool) -> Self:
        """Use the app's asyncpg ``pool``, made in its lifespan (a pool is bound to the event loop it was made on,
        which at import is not the server's): for a store built as ``PostgresStore()``, before it opens::

            async with asyncpg.create_pool(dsn) as pool, store.bind(pool):
                yield

        Each lifespan binds its own pool; the pool stays the app's to close. Returns the store, to open."""
        if not self._bindable:
            raise ValueError(
                "bind() is for a PostgresStore built without a database URL or pool (PostgresStore()); this one has "
                "its connections"
            )
        if not isinstance(pool, asyncpg.Pool):
            raise TypeError(f"bind() takes an asyncpg pool (asyncpg.create_pool), not {type(pool).__name__}")
        self._connector = AppPool(pool, self._sql, self.schema, timeout=self.timeout)
        self._listener = SettlementListener(self._connector, self.schema, self._waiters)
        return self

    @property
    def database_isolation(self) -> str | None:
        """The default isolation level of the database's sessions, once a connection has told it."""
        return self._connector.database_isolation

    async def open(self) -> None:
        """Connect now (``min_size`` connections) and check that the tables exist, so that a database that cannot
        be reached, or was never migrated, fails at startup: :class:`StoreNotMigrated` names the command to run.

        :meth:`migrate` needs no ``open()`` first (it would refuse a database that is not migrated yet). A closed
        store opens again (a lifespan run once per test): on new connections, and without the claims of before the
        close, which had their grace then.
        """
        if self._closing:
            self._closing = False
            self._unsettled.clear()
            self._all_settled = None
        await self._connector.open()
        row = await self._connector.run("migrated", ())
        if row is None or not row[0]:
            raise StoreNotMigrated(self.schema)

    async def close(self, *, grace: float | None = None) -> None:
        """Refuse new claims, give the claims still being settled up to ``grace`` seconds (default: ``timeout``) to
        complete or release, then close the connections the store opened, those still in use as they come back (a
        pool passed in is the app's to close). A closed store answers every call with :class:`StoreUnavailable`,
        until :meth:`open` opens it again.

        The grace is for a server's graceful shutdown: it cancels the requests still running and then runs the
        app's shutdown at once; each cancelled request releases its key on its way out, and needs a connection for
        that. Without the grace the key would stay in progress for a whole lease, and the client's retry after the
        restart would get 409 until then.
        """
        self._closing = True
        await self._listener.stop(self.timeout)
        if self._unsettled:
            self._all_settled = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.timeout if grace is None else grace):
                    await self._all_settled.wait()
        await self._connector.close()

    def settled(self, tenant: str, key: str, fence: int) -> None:
        """A claim of this store was completed or released (or fenced out, or the attempt failed): :meth:`close`
        waits no longer on its behalf. The store's own ``complete``/``release`` and its transactions say so
        themselves; a transaction of another kind that completes a record (SQLAlchemy's) calls this."""
        self._unsettled.discard((tenant, key, fence))
        if not self._unsettled and self._all_settled is not None:
            self._all_settled.set()
        self._waiters.wake(fence)

    @contextlib.asynccontextmanager
    async def watch(self, fence: int) -> AsyncIterator[Subscription]:
        """See :meth:`Store.watch`: woken by this store's settlements, and by other processes' through LISTEN on one
        connection of its own beside the pool (opened for the first waiter, which waits until it listens; none
        behind a transaction-pooling proxy, where waiters in other processes wake at their deadline)."""
        async with self._waiters.watch(fence) as settled:
            if not self._closing:
                await self._listener.listen(self.timeout)
            yield settled

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[asyncpg.Connection]:
        """A connection for code other than ours (the resource-deleted race in the guide), waited for no longer than
        ``timeout``. It comes back as its pool gave it, whatever the code did to it (``lending.py``), and refuses use
        once the block has ended."""
        async with lent_connection(self._connector) as connection:
            yield connection

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[PostgresTransaction]:
        """A connection for one transactional request (``transaction.py``): the claim is taken on it, then the
        transaction begins on it; committed or rolled back by the caller. It comes back with a clean session."""
        connector = self._connector
        connection = await connector.lend()
        run = partial(connector.run_on, connection)
        transaction = PostgresTransaction(self, connection, run, isolation=connector.begin_isolation())
        try:
            yield transaction
        finally:
            transaction.lent.end()
            await connector.give_back(connection, lost=transaction.lost, then=transaction.settlement.notice)

    def notice(self, tenant: str, key: str, fence: int) -> str:
        """The SQL that tells the waiters of a record in other processes that its claim under ``fence`` settled, if
        it had duplicates, with its values written in (``notify_waiters``): for after a COMMIT, in the round trip of
        the reset of the connection that committed."""
        sql = self._sql["notify_waiters"]
        return (
            sql.replace("{tenant_hex}", tenant.encode().hex())
            .replace("{key_hex}", key.encode().hex())
            .replace("{fence}", str(int(fence)))
        )

    def statement(self, name: str) -> str:
        """The SQL of one of the store's statements (``sql/queries.sql``: ``complete``, ``forget``, …), in its schema,
        with asyncpg's ``$1`` parameters: for a transaction the store does not own (``idempotency_mw.sqlalchemy``).
        """
        try:
            return self._sql[name]
        except KeyError:
            raise KeyError(f"PostgresStore has no statement {name!r}; it has {', '.join(sorted(self._sql))}") from None

    # -- the Store protocol --------------------------------------------------------------------------------

    async def claim(
        self, tenant: str, key: str, fingerprint: bytes, *, lease: float, ttl: float, matching: tuple[bytes, ...] = ()
    ) -> Claim:
        return await self._claim(
            self._connector.run, tenant, key, (fingerprint, *matching), lease=lease, ttl=ttl, flush=True
        )

    async def claim_on(
        self,
        connection: asyncpg.Connection,
        tenant: str,
        key: str,
        fingerprint: bytes,
        *,
        lease: float,
        ttl: float,
        matching: tuple[bytes, ...] = (),
    ) -> Claim:
        """The claim of a transactional request, on a connection of the app's engine that a transaction of another
        kind (SQLAlchemy's) then begins on; under READ COMMITTED whatever the session's default, as every statement
        of the store's, and committed without waiting for its flush (see :meth:`_claim`)."""
        if self._explicit_elsewhere is None:
            with reachable():
                level = await connection.fetchval("SHOW default_transaction_isolation", timeout=self.timeout)
            self._explicit_elsewhere = level != "read committed"
        explicit = self._explicit_elsewhere

        async def run(name: str, args: tuple[Any, ...]) -> Any:
            with reachable(self.schema):
                if not explicit:
                    return await connection.fetchrow(self._sql[name], *args, timeout=self.timeout)
                async with connection.transaction(isolation="read_committed"):
                    return await connection.fetchrow(self._sql[name], *args, timeout=self.timeout)

        return await self._claim(run, tenant, key, (fingerprint, *matching), lease=lease, ttl=ttl, flush=False)

    async def _claim(
        self, run: Run, tenant: str, key: str, fingerprints: tuple[bytes, ...], *, lease: float, ttl: float, flush: bool
    ) -> Claim:
        """The claim, by ``run``. Without ``flush`` (a transactional request's) it commits without waiting for its
        WAL flush, which the handler's COMMIT does for it (``sql/queries.sql``, claim): never for a claim whose
        effect is outside the database, which a crash could then lose after the effect ran."""
        if self._closing:
            raise StoreUnavailable("the idempotency store is closing: it takes no new claims")
        # max: a record never expires under a live lease (sql/queries.sql, renew)
        unflushed = None if flush else "off"
        args = (tenant, key, fingerprints, float(lease), float(max(ttl, lease)), new_fence(), unflushed)
        row = await run("claim", args)  # a fresh key, a replay, a 409 or a 422 (see sql/queries.sql)
        if row is None:  # an expired record or a lapsed lease to take over, or a race
            row = await run("claim_or_take_over", args)
        if row is None:  # lost a race with a concurrent claim of the key: lock and look again
            self.claim_races += 1
            row = await run("claim_locked", args)
            assert row is not None  # INSERT … ON CONFLICT DO UPDATE … RETURNING always returns the row
        claim = claim_from_row(row, tenant, key, self.cipher)
        if claim.outcome is ClaimOutcome.OWNED:
            self._unsettled.add((tenant, key, claim.fence))
        return claim

    async def renew(self, tenant: str, key: str, fence: int, *, lease: float) -> bool:
        status = await self._connector.run("renew", (tenant, key, fence, float(lease)), urgent=True, status=True)
        return bool(status == "UPDATE 1")

    async def complete(self, tenant: str, key: str, fence: int, response: StoredResponse) -> bool:
        try:
            args = completion(tenant, key, fence, response, self.cipher)
            status = await self._connector.run("complete", args, urgent=True, status=True)
        finally:
            self.settled(tenant, key, fence)
        return bool(status == "INSERT 0 1")

    async def release(self, tenant: str, key: str, fence: int) -> bool:
        try:
            row = await self._connector.run("release", (tenant, key, fence), urgent=True)
        except asyncpg.ForeignKeyViolationError:
            return False  # its response committed while the release ran: completed, not released
        finally:
            self.settled(tenant, key, fence)
        return bool(row is not None and row["released"] == 1)

    async def forget(self, tenant: str, key: str, *, connection: asyncpg.Connection | None = None) -> bool:
        """Delete the record; pass the ``connection`` of a transaction that deletes the resource it names."""
        if connection is None:
            status = await self._connector.run("forget", (tenant, key), status=True)
        else:
            with reachable(self.schema):
                status = await connection.execute(self._sql["forget"], tenant, key, timeout=self.timeout)
        return bool(status == "DELETE 1")

    async def inspect(self, tenant: str, key: str) -> RecordInfo | None:
        row = await self._connector.run("inspect", (tenant, key))
        return None if row is None else record_from_row(row, self.cipher)

    async def purge_expired(self, *, batch_size: int = 1000) -> int:
        status = await self._connector.run("purge_expired", (batch_size,), status=True)
        return int(status.split()[-1])

    async def count_expired(self) -> int:
        row = await self._connector.run("count_expired", ())
        assert row is not None
        return int(row[0])

    async def stats(self) -> dict[str, Any]:
        row = await self._connector.run("stats", ())
        assert row is not None
        return dict(row)

    async def reencrypt(
        self, *, batch_size: int = 1000, seal_plain: bool = False, after: tuple[str, str] | None = None
    ) -> ResealedBatch:
        """Re-seal under the cipher's current key up to ``batch_size`` responses sealed under its other keys (and
        with ``seal_plain`` those stored plain), starting after ``after`` (the ``after`` of the previous batch; None
        for the first). One transaction: the rows are locked (``FOR UPDATE SKIP LOCKED``, ``sql/queries.sql``,
        reseal_batch), opened and sealed here, and written back before the locks go; so it is safe beside live
        traffic and other runs, and a batch that fails leaves every response as it was. A response that does not
        open is left as it is and reported."""
        cipher = self.cipher
        if cipher is None:
            raise ValueError("reencrypt needs a PostgresStore with a cipher: PostgresStore(..., cipher=...)")
        older = [key_id for key_id in cipher.key_ids if key_id != cipher.current]
        start, first = after or ("", ""), after is None
        async with self._connector.session() as connection:
            with reachable(self.schema):
                async with connection.transaction(isolation="read_committed"):
                    rows = await connection.fetch(
                        self._sql["reseal_batch"], *start, first, older, seal_plain, batch_size, timeout=self.timeout
                    )
                    resealed, unreadable = reseal_rows(rows, cipher)
                    if resealed[0]:
                        await connection.execute(self._sql["reseal"], cipher.current, *resealed, timeout=self.timeout)
        last = (rows[-1]["tenant"], rows[-1]["key"]) if len(rows) == batch_size else None
        return ResealedBatch(len(resealed[0]), unreadable, last)

    async def responses_by_key(self) -> dict[str | None, int]:
        """How many stored responses are sealed under each key id (None: stored plain); one scan of the table."""
        async with self._connector.session() as connection:
            with reachable(self.schema):
                rows = await connection.fetch(self._sql["responses_by_key"], timeout=self.timeout)
        return {row["sealed_with"]: row["responses"] for row in rows}

    async def migrate(self) -> list[str]:
        """Create the schema if it is missing and apply the migrations it lacks, in order; return their names. Safe
        to run repeatedly and from several processes at once (``sql.migrate``)."""
        async with self._connector.session() as connection:
            return await migrate(connection, self.schema)


class PostgresTransaction:
    """A connection lent to one transactional request: its claim, then a transaction whose ``connection`` the handler
    writes through (a :class:`LentConnection`, refused once the request has ended) and in which the record completes.

    Every call has the store's deadline; a database that cannot be reached is :class:`StoreUnavailable`, and marks
    the connection ``lost`` (it goes back closed, without a reset that would wait out another deadline).
    """

    def __init__(
        self, store: PostgresStore, connection: asyncpg.Connection, run: Run, *, isolation: str | None
    ) -> None:
        self.connection = connection
        self.lent = LentConnection(connection)
        self.lost = False
        self.settlement = Settlement(store.settled, store.notice)
        self._store = store
        self._run = run  # the store's statements on this connection
        self._isolation = isolation
        self._transaction: asyncpg.transaction.Transaction | None = None

    async def claim(
        self, tenant: str, key: str, fingerprint: bytes, *, lease: float, ttl: float, matching: tuple[bytes, ...] = ()
    ) -> Claim:
        with self._reachable():
            fingerprints = (fingerprint, *matching)
            return await self._store._claim(self._run, tenant, key, fingerprints, lease=lease, ttl=ttl, flush=False)

    async def begin(self) -> None:
        """BEGIN, at the database's default isolation level (the store's own session reads READ COMMITTED)."""
        with self._reachable():
            self._transaction = self.connection.transaction(isolation=self._isolation)  # type: ignore[arg-type]
            await self._transaction.start()

    async def complete(self, tenant: str, key: str, fence: int, response: StoredResponse) -> bool:
        if not self.connection.is_in_transaction():
            # The handler ran COMMIT or ROLLBACK itself. Completing now would write the record on its own: after a
            # ROLLBACK, a retry would be told of an effect that never happened.
            raise TransactionEnded.by_the_handler("connection", "async with connection.transaction(): ...")
        args = completion(tenant, key, fence, response, self._store.cipher)
        sql = self._store.statement("complete_in_transaction")
        try:
            with self._reachable(self._store.schema):
                status = await self.connection.execute(sql, *args, timeout=self._store.timeout)
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
        if self.lost:
            # A statement of ours found the connection dead or silent (a hung server). A ROLLBACK would wait out
            # another timeout behind asyncpg's unfinished cancellation; closing the connection, which the store
            # does as it takes it back, rolls the transaction back on the server.
            raise StoreUnavailable("the connection of the handler's transaction was lost")
        with self._reachable():
            await self._transaction.rollback()

    @contextlib.contextmanager
    def _reachable(self, schema: str | None = None) -> Iterator[None]:
        try:
            with reachable(schema):
                yield
        except StoreUnavailable as error:
            if not isinstance(error, StoreNotMigrated):
                self.lost = True
            raise
