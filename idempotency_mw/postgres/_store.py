"""The PostgreSQL store: the records of ``sql/queries.sql`` (``_records.py``), on the connections of a connector.

Each operation on the request path is one statement and one round trip (asyncpg prepares each statement once per
connection), with the store's deadline, so a dead server turns into :class:`StoreUnavailable` (and a 503) instead of
a hung request. Where the connections come from, the store's own pool or the app's, is the connector's business
(``_connector.py``); what the records look like, ``_records.py``'s.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Self

import asyncpg

from idempotency_mw import _environment as environment
from idempotency_mw.postgres._apppool import AppPool, Unbound
from idempotency_mw.postgres._connector import Connector, postgres_url
from idempotency_mw.postgres._listener import SettlementListener
from idempotency_mw.postgres._pool import OwnPool
from idempotency_mw.postgres._records import Records, reachable, record_from_row
from idempotency_mw.postgres._sql import applied_versions, check_schema, migrate, migrations, stamp
from idempotency_mw.store import (
    Claim,
    RecordInfo,
    RecordLine,
    ResealedBatch,
    StoredResponse,
    StoreNotGranted,
    StoreNotMigrated,
    Subscription,
    Transaction,
)

if TYPE_CHECKING:
    from idempotency_mw.encryption import ResponseCipher

RESEAL_BATCH_BYTES = 64 * 1024 * 1024  # responses' bytes per reencrypt batch: far below PostgreSQL's 1 GB messages
REPLAYS_EVERY = 5.0  # seconds between the batches that write the replays counted in memory (count_replays)


class PostgresStore:
    """Records in PostgreSQL (see ``sql/migrations``).

    ``PostgresStore("postgresql://…")`` opens its own connections on first use, at most ``max_size`` (``_pool.py``
    says why they are not an asyncpg pool); SQLAlchemy's spelling of the URL (``postgresql+asyncpg://…``) is taken
    too, and a URL of another database is a ``ValueError``. ``PostgresStore(pool)`` uses an asyncpg pool the app
    already has and leaves closing it to the app; ``PostgresStore()`` waits for one, made in the app's lifespan
    (:meth:`bind`). ``timeout`` bounds every database call in seconds, connecting and waiting for a free connection
    included (default: ``IDEMPOTENCY_STORE_TIMEOUT``, else 5). ``schema`` is where the tables live (default:
    ``IDEMPOTENCY_SCHEMA``, else ``public``); every statement names it, so a handler that changes ``search_path`` on
    a connection the store then uses changes nothing.

    ``prepared_statements=False`` is for a transaction-pooling proxy (PgBouncer's ``pool_mode = transaction`` before
    1.21, or without ``max_prepared_statements``): the store's connections then keep no named prepared statements,
    which such a proxy would send to a server connection that never saw them (see docs/operations.md). It costs a
    round trip per statement. A pool passed in has its own setting: create it with ``statement_cache_size=0``.

    The store's own statements run under READ COMMITTED whatever the database's default isolation level; the
    transactions it lends to handlers keep the database's default.

    ``cipher`` (an :class:`~idempotency_mw.encryption.ResponseCipher`) seals every response it stores, in its own
    completions and in handlers' transactions alike, and opens them for replays and ``inspect``; a response stored
    plain is refused unless the cipher allows it. See docs/configuration.md, "Encrypting stored responses".
    """

    def __init__(
        self,
        dsn_or_pool: str | asyncpg.Pool | None = None,
        *,
        timeout: float | None = None,
        min_size: int = 2,
        max_size: int = 20,
        schema: str | None = None,
        prepared_statements: bool = True,
        cipher: ResponseCipher | None = None,
    ) -> None:
        timeout = environment.seconds(environment.STORE_TIMEOUT, timeout, 5.0)
        if timeout <= 0:
            raise ValueError("PostgresStore timeout must be positive")
        self.timeout = timeout
        self.schema = check_schema(environment.text(environment.SCHEMA, schema, "public"))
        self._records = Records(self.schema, timeout=timeout, cipher=cipher)
        self._bindable = dsn_or_pool is None
        self._own: OwnPool | None = None  # the connections the store opens itself, from a DSN
        if isinstance(dsn_or_pool, str):
            url = postgres_url(dsn_or_pool)
            sql = self._records.sql
            self._own = OwnPool(url, sql, self.schema, timeout=timeout, min_size=min_size, max_size=max_size,
                                prepared_statements=prepared_statements)  # fmt: skip
            self._connect(self._own)
        elif not prepared_statements:
            raise ValueError(
                "prepared_statements=False applies to the connections a DSN-built PostgresStore opens; an asyncpg "
                "pool passed in keeps its own setting: create it with asyncpg.create_pool(..., statement_cache_size=0)"
            )
        elif dsn_or_pool is None:
            self._connect(Unbound(timeout))  # until bind(): the app's pool, made in its lifespan
        else:
            self._connect(AppPool(dsn_or_pool, self._records.sql, self.schema, timeout=timeout))

    def _connect(self, connector: Connector) -> None:
        """Take connections from ``connector`` from now on (at construction, at :meth:`bind`, or when SQLAlchemy
        lends the handlers' transactions: ``idempotency_mw.sqlalchemy``)."""
        self._connector = connector
        self._listener = SettlementListener(connector, self.schema, self._records.waiters)

    @property
    def cipher(self) -> ResponseCipher | None:
        return self._records.cipher

    @cipher.setter
    def cipher(self, cipher: ResponseCipher | None) -> None:
        self._records.cipher = cipher

    @property
    def connector(self) -> Connector:
        """Where the store's connections come from (``_connector.py``)."""
        return self._connector

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
        self._connect(AppPool(pool, self._records.sql, self.schema, timeout=self.timeout))
        return self

    @property
    def database_isolation(self) -> str | None:
        """The default isolation level of the database's sessions, once a connection has told it."""
        return self._connector.database_isolation

    async def open(self) -> None:
        """Connect now (``min_size`` connections) and check that the tables exist and the role may use them, so that
        a database that cannot be reached, was never migrated, or whose role lacks a grant fails at startup:
        :class:`StoreNotMigrated` names the command to run, :class:`StoreNotGranted` the GRANT.

        :meth:`migrate` needs no ``open()`` first (it would refuse a database that is not migrated yet). A closed
        store opens again (a lifespan run once per test): on new connections, and without the claims of before the
        close, which had their grace then.

        A failed ``open()`` closes the connections it opened: a caller whose startup failed seldom calls
        :meth:`close`, and they would stay on the server. The store is then as before it: it connects on first use
        (:meth:`migrate` after :class:`StoreNotMigrated`), opens again, and closes harmlessly; requests it served
        meanwhile go on, on the connections they have or wait for.
        """
        if self._records.closing:
            self._records.reopened()
        try:
            await self._connector.open()
            row = await self._connector.run("migrated", ())
            if row is None or not row[0]:
                raise StoreNotMigrated(self.schema)
            row = await self._connector.run("missing_grants", ())
            if row is not None and row["missing"]:
                raise StoreNotGranted(self.schema, list(row["missing"]))
        except BaseException:
            if self._own is not None:  # an app's pool stays the app's: what was taken from it went back
                self._own.close_idle()
            raise
        self._records.replays.start(self._connector.run, REPLAYS_EVERY)

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
        self._records.closing = True
        await self._listener.stop(self.timeout)
        await self._records.all_settled(self.timeout if grace is None else grace)
        await self._records.replays.stop(self._connector.run)
        await self._connector.close()

    async def count_replays(self) -> None:
        """Write the replays counted since the last time, in one statement (the store does it every
        ``REPLAYS_EVERY`` seconds once opened, and as it closes); counts whose statement fails are kept."""
        await self._records.replays.write(self._connector.run)

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def connection(self) -> contextlib.AbstractAsyncContextManager[asyncpg.Connection]:
        """A connection for code other than ours (the resource-deleted race in the guide), waited for no longer than
        ``timeout``. It comes back as its pool gave it, whatever the code did to it, and refuses use once the block
        has ended."""
        return self._connector.connection()

    def transaction(self) -> contextlib.AbstractAsyncContextManager[Transaction]:
        """A connection for one transactional request: the claim is taken on it, then the transaction begins on
        it; committed or rolled back by the caller. It comes back with a clean session."""
        return self._connector.transaction(self._records)

    # -- the Store protocol: the request path ----------------------------------------------------------------

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
        run, fingerprints = self._connector.run, (fingerprint, *matching)
        return await self._records.claim(
            run, tenant, key, fingerprints, lease=lease, ttl=ttl, flush=True, request=request, parts=parts
        )

    async def renew(self, tenant: str, key: str, fence: int, *, lease: float) -> bool:
        status = await self._connector.run("renew", (tenant, key, fence, float(lease)), urgent=True, status=True)
        return bool(status == "UPDATE 1")

    async def complete(self, tenant: str, key: str, fence: int, response: StoredResponse) -> bool:
        try:
            args = self._records.completion(tenant, key, fence, response)
            status = await self._connector.run("complete", args, urgent=True, status=True)
        finally:
            self._records.settled(tenant, key, fence)
        return bool(status == "INSERT 0 1")

    async def release(self, tenant: str, key: str, fence: int) -> bool:
        try:
            row = await self._connector.run("release", (tenant, key, fence), urgent=True)
        except asyncpg.ForeignKeyViolationError:
            return False  # its response committed while the release ran: completed, not released
        finally:
            self._records.settled(tenant, key, fence)
        return bool(row is not None and row["released"] == 1)

    @contextlib.asynccontextmanager
    async def watch(self, fence: int) -> AsyncIterator[Subscription]:
        """See :meth:`Store.watch`: woken by this store's settlements, and by other processes' through LISTEN on one
        connection of its own beside the pool (opened for the first waiter, which waits until it listens; none
        behind a transaction-pooling proxy, where waiters in other processes wake at their deadline)."""
        async with self._records.waiters.watch(fence) as settled:
            if not self._records.closing:
                await self._listener.listen(self.timeout)
            yield settled

    # -- operators' commands ---------------------------------------------------------------------------------

    async def forget(self, tenant: str, key: str, *, connection: asyncpg.Connection | None = None) -> bool:
        """Delete the record; pass the ``connection`` of a transaction that deletes the resource it names. Requests
        waiting for the record claim again at once (with ``connection``, once its transaction commits)."""
        if connection is not None:
            with reachable(self.schema):
                row = await connection.fetchrow(self._records.sql["forget"], tenant, key, timeout=self.timeout)
            return row is not None
        row = await self._connector.run("forget", (tenant, key))
        if row is None:
            return False
        self._records.waiters.wake(row["fence"])
        return True

    async def inspect(self, tenant: str, key: str) -> RecordInfo | None:
        row = await self._connector.run("inspect", (tenant, key))
        return None if row is None else record_from_row(row, self.cipher)

    async def tenants_between(self, since: float, until: float) -> list[str]:
        """The tenants with records first claimed in ``[since, until)`` (epoch seconds). It reads every record of
        that window: keep it short on a large table (or ask a replica)."""
        async with self._connector.session() as connection:
            with reachable(self.schema):
                rows = await connection.fetch(self._records.sql["tenants_between"], since, until, timeout=self.timeout)
        return [row["tenant"] for row in rows]

    async def list_records(self, tenant: str, since: float, until: float, *, limit: int = 100) -> list[RecordLine]:
        """``tenant``'s records first claimed in ``[since, until)`` (epoch seconds), oldest first, at most
        ``limit``: for a support desk that knows the customer and roughly when."""
        async with self._connector.session() as connection:
            with reachable(self.schema):
                rows = await connection.fetch(
                    self._records.sql["list_records"], tenant, since, until, limit, timeout=self.timeout
                )
        return [RecordLine(**dict(row)) for row in rows]

    async def purge_expired(self, *, batch_size: int = 1000) -> int:
        status = await self._connector.run("purge_expired", (batch_size,), status=True)
        return int(status.split()[-1])

    async def count_expired(self) -> int:
        row = await self._connector.run("count_expired", ())
        assert row is not None
        return int(row[0])

    async def ping(self) -> float:
        """For a readiness probe: one round trip on a connection taken as a claim takes one, the seconds it took, or
        :class:`StoreUnavailable` (:class:`StoreNotMigrated`: no tables) within the store's ``timeout``."""
        started = time.perf_counter()
        row = await self._connector.run("migrated", ())
        if row is None or not row[0]:
            raise StoreNotMigrated(self.schema)
        return time.perf_counter() - started

    async def stats(self) -> dict[str, Any]:
        row = await self._connector.run("stats", ())
        assert row is not None
        return dict(row)

    async def reencrypt(
        self,
        *,
        batch_size: int = 1000,
        seal_plain: bool = False,
        after: tuple[str, str] | None = None,
        batch_bytes: int = RESEAL_BATCH_BYTES,
    ) -> ResealedBatch:
        """Re-seal under the cipher's current key up to ``batch_size`` responses sealed under its other keys (with
        ``seal_plain``, those stored plain too), after ``after`` (the previous batch's; None for the first), and no
        more of them than add up to ``batch_bytes`` (one at least): a batch goes to the server and back in one
        message each way, which PostgreSQL limits to 1 GB, and responses can be several MiB each. One
        transaction locks the rows (``FOR UPDATE SKIP LOCKED``: reseal_batch), seals them here and writes them back
        before the locks go: safe beside live traffic and other runs; a batch that fails leaves every response as it
        was, and a response that does not open is left as it is and reported."""
        if self.cipher is None:
            raise ValueError("reencrypt needs a PostgresStore with a cipher: PostgresStore(..., cipher=...)")
        async with self._connector.session() as connection:
            with reachable(self.schema):
                return await self._records.reseal(connection, batch_size, seal_plain, after, batch_bytes)

    async def responses_by_key(self) -> dict[str | None, int]:
        """How many stored responses are sealed under each key id (None: stored plain); one scan of the table."""
        async with self._connector.session() as connection:
            with reachable(self.schema):
                rows = await connection.fetch(self._records.sql["responses_by_key"], timeout=self.timeout)
        return {row["sealed_with"]: row["responses"] for row in rows}

    async def live_fingerprints_by_key(self, key_ids: Sequence[str]) -> dict[str, tuple[int, datetime]]:
        """For each of the fingerprint ``key_ids`` that a live record's fingerprint is under: how many records, and
        when the last of them expires (until then the key must stay, or their retries are 422s); it reads every
        live record."""
        async with self._connector.session() as connection:
            with reachable(self.schema):
                rows = await connection.fetch(
                    self._records.sql["live_fingerprints_by_key"], list(key_ids), timeout=self.timeout
                )
        return {row["key_id"]: (row["records"], row["expires_at"]) for row in rows}

    async def migrate(self) -> list[str]:
        """Create the schema if it is missing and apply the migrations it lacks, in order; return their names. Safe
        to run repeatedly and from several processes at once (``_sql.migrate``)."""
        async with self._connector.session() as connection:
            return await migrate(connection, self.schema)

    async def pending_migrations(self) -> list[str]:
        """The migrations :meth:`migrate` would apply here, by name; read only (``idempotency-mw migrate --check``)."""
        async with self._connector.session() as connection:
            applied = set(await applied_versions(connection, self.schema))
        return [name for version, name, _ in migrations(self.schema) if version not in applied]

    async def stamp_migrations(self) -> list[str]:
        """Record every migration as applied without running it: for tables another tool created from them
        (``idempotency-mw migrate --stamp``). A schema without the tables is a ValueError."""
        async with self._connector.session() as connection:
            return await stamp(connection, self.schema)
