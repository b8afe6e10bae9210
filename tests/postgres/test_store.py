"""postgres.py: PostgresStore on its own, against a real PostgreSQL: migrations, schemas, URLs, opening and closing,
fences, what its errors say, and what transactional mode does on asyncpg alone. Where its connections come from and
the promises they keep (deadlines, pool exhaustion, isolation levels): test_connectors.py.

Tests that need a database nobody else touches get one of their own (``fresh_url`` in conftest.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import asyncpg
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from idempotency_mw import IdempotencyMiddleware, PostgresStore, StoredResponse, idempotency_context
from idempotency_mw.postgres._lending import PostgresTransaction
from idempotency_mw.postgres._records import Replays
from idempotency_mw.postgres._sql import bookkeeping, migrations
from idempotency_mw.store import ClaimOutcome, RecordInfo, StoreNotMigrated, StoreUnavailable
from tests.conftest import client_for, opened

FINGERPRINT = bytes(range(32))
RESPONSE = StoredResponse(201, [(b"content-type", b"application/json")], b'{"id": 1}', 9)


def with_setting(url: str, name: str, value: str) -> str:
    """The same database, with a server setting for every session (asyncpg passes unknown URL parameters on as
    server settings): ``search_path``, or ``role`` to run as another role, like ``SET ROLE``."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(query=urlencode([*parse_qsl(parts.query), (name, value)])))


async def fetch(url: str, query: str, *args: object) -> list[asyncpg.Record]:
    connection = await asyncpg.connect(url)
    try:
        return list(await connection.fetch(query, *args))
    finally:
        await connection.close()


async def relations_in(url: str, schema: str) -> list[str]:
    rows = await fetch(
        url,
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1 "
        "ORDER BY c.relname",
        schema,
    )
    return [row["relname"] for row in rows]


# -- migrate --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("schema", ["public", "idempotency"])
async def test_concurrent_migrations_of_a_fresh_database_take_turns(fresh_url: str, schema: str) -> None:
    """Replicas that migrate at startup all start at once. Creating the bookkeeping table (and the schema) used to
    happen before the advisory lock, and concurrent runs failed on the catalog (UniqueViolationError on pg_type)."""
    stores = [PostgresStore(fresh_url, min_size=0, max_size=1, schema=schema) for _ in range(16)]
    try:
        results = await asyncio.gather(*(store.migrate() for store in stores), return_exceptions=True)
    finally:
        await asyncio.gather(*(store.close() for store in stores))
    failures = [result for result in results if isinstance(result, BaseException)]
    assert failures == []
    applied = sorted(name for result in results if isinstance(result, list) for name in result)
    assert applied == [name for _, name, _ in migrations(schema)]  # each migration exactly once
    rows = await fetch(fresh_url, f"SELECT version, name FROM {schema}.idempotency_schema_migrations ORDER BY 1")
    assert [(row["version"], row["name"]) for row in rows] == [(v, n) for v, n, _ in migrations(schema)]


async def test_migrate_twice_applies_nothing_the_second_time(fresh_url: str) -> None:
    store = PostgresStore(fresh_url, min_size=0, max_size=1)
    assert await store.migrate() == [name for _, name, _ in migrations("public")]
    assert await store.migrate() == []
    await store.close()


async def test_migrate_needs_no_create_privilege_on_the_database_when_the_schema_exists(fresh_url: str) -> None:
    """A deploy role that owns its schema but may not create schemas still migrates (CREATE SCHEMA IF NOT EXISTS
    would need that privilege even for a schema that exists)."""
    role = f"imw_deploy_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(fresh_url)
    try:
        await admin.execute(f"CREATE ROLE {role}")  # no CREATE on the database: PUBLIC does not have it either
        await admin.execute(f"CREATE SCHEMA idempotency AUTHORIZATION {role}")
        store = PostgresStore(with_setting(fresh_url, "role", role), min_size=0, max_size=1, schema="idempotency")
        try:
            assert await store.migrate() == [name for _, name, _ in migrations("idempotency")]
        finally:
            await store.close()
        owner = await admin.fetchval(
            "SELECT tableowner FROM pg_tables WHERE schemaname = 'idempotency' AND tablename = 'idempotency_records'"
        )
        assert owner == role  # the migration really ran as that role
    finally:
        await admin.execute(f"DROP SCHEMA idempotency CASCADE; DROP OWNED BY {role}; DROP ROLE {role}")
        await admin.close()


# -- schemas --------------------------------------------------------------------------------------------------


async def exercise(store: PostgresStore, prefix: str) -> None:
    """Every statement the store runs, each checked for its effect."""
    key = f"{prefix}-key"
    claim = await store.claim("tenant", key, FINGERPRINT, lease=30, ttl=3600)
    assert claim.outcome is ClaimOutcome.OWNED
    busy = await store.claim("tenant", key, FINGERPRINT, lease=30, ttl=3600)
    assert (busy.outcome, busy.attempts) == (ClaimOutcome.IN_PROGRESS, 1)
    assert await store.renew("tenant", key, claim.fence, lease=30)
    assert await store.complete("tenant", key, claim.fence, RESPONSE)
    replay = await store.claim("tenant", key, FINGERPRINT, lease=30, ttl=3600)
    assert (replay.outcome, replay.response) == (ClaimOutcome.COMPLETED, RESPONSE)
    record = await store.inspect("tenant", key)
    assert record is not None
    assert (record.state, record.response, record.attempts) == ("completed", RESPONSE, 1)
    stats = await store.stats()
    assert (stats["completed"], stats["in_progress"], stats["attempts"]) == (1, 0, 1)

    released = await store.claim("tenant", f"{prefix}-released", FINGERPRINT, lease=30, ttl=3600)
    assert await store.release("tenant", f"{prefix}-released", released.fence)
    assert await store.inspect("tenant", f"{prefix}-released") is None

    await store.claim("tenant", f"{prefix}-forgotten", FINGERPRINT, lease=30, ttl=3600)
    assert await store.forget("tenant", f"{prefix}-forgotten")
    assert await store.inspect("tenant", f"{prefix}-forgotten") is None

    expiring = await store.claim("tenant", f"{prefix}-expiring", FINGERPRINT, lease=0.001, ttl=0.001)
    assert await store.complete("tenant", f"{prefix}-expiring", expiring.fence, RESPONSE)
    for _ in range(200):  # expires_at is 1 ms after the claim, by the database's clock
        if await store.count_expired() == 1:
            break
        await asyncio.sleep(0.01)
    assert await store.count_expired() == 1
    assert await store.purge_expired(batch_size=10) == 1
    assert await store.inspect("tenant", f"{prefix}-expiring") is None


@pytest.mark.parametrize("pool", ["own", "asyncpg"])
async def test_the_store_does_not_depend_on_the_search_path(migrated_url: str, pool: str) -> None:
    """A transactional handler of a schema-per-tenant app sets search_path on the connection the store then
    completes on. Unqualified table names made the store's statements fail there with UndefinedTableError."""
    elsewhere = with_setting(migrated_url, "search_path", "tenant_without_tables")
    admin = await asyncpg.connect(migrated_url)
    await admin.execute("CREATE SCHEMA tenant_without_tables")
    await admin.close()
    app_pool = await asyncpg.create_pool(elsewhere, min_size=1, max_size=2) if pool == "asyncpg" else None
    store = PostgresStore(app_pool or elsewhere, min_size=1, max_size=2)
    try:
        connection = await asyncpg.connect(elsewhere)
        assert await connection.fetchval("SHOW search_path") == "tenant_without_tables"
        await connection.close()
        await store.open()
        await exercise(store, "search-path")
    finally:
        await store.close(grace=0)
        if app_pool is not None:
            await app_pool.close()


@pytest.mark.parametrize("schema", ["idempotency", "user"])  # "user" is a reserved word: it works quoted
async def test_a_store_in_a_schema_of_its_own(fresh_url: str, schema: str) -> None:
    store = PostgresStore(fresh_url, min_size=1, max_size=2, schema=schema)
    assert store.schema == schema
    try:
        assert await store.migrate() == [name for _, name, _ in migrations(schema)]
        await store.open()
        await exercise(store, "own-schema")
    finally:
        await store.close(grace=0)
    assert await relations_in(fresh_url, "public") == []  # nothing was created in public
    assert "idempotency_records" in await relations_in(fresh_url, schema)
    assert "idempotency_schema_migrations" in await relations_in(fresh_url, schema)
    default = PostgresStore(fresh_url, min_size=0, max_size=1)  # the same database, the default schema
    with pytest.raises(StoreNotMigrated, match='schema "public"'):
        await default.open()
    await default.close()


@pytest.mark.parametrize(
    "schema", ["", "Idempotency", "1st", "tenant-a", "a.b", 'x"; DROP TABLE t; --', "é", "a" * 64, "pg_mine"]
)
def test_schema_names_are_checked(schema: str) -> None:
    with pytest.raises(ValueError, match="idempotency store schema") as refused:
        PostgresStore("postgresql://localhost/db", schema=schema)
    assert repr(schema) in str(refused.value)


@pytest.mark.parametrize("schema", ["a", "_", "tenant_42", "a" * 63])
def test_plain_lower_case_identifiers_are_accepted(schema: str) -> None:
    assert PostgresStore("postgresql://localhost/db", schema=schema).schema == schema


def test_a_bad_schema_name_says_what_is_allowed() -> None:
    with pytest.raises(ValueError, match="Billing") as refused:
        PostgresStore("postgresql://localhost/db", schema="Billing")
    assert str(refused.value) == (
        "idempotency store schema must be a plain lower-case identifier: a letter a-z or '_', then letters, "
        "digits or '_', at most 63 characters; got 'Billing'"
    )


# -- a database that was not migrated -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schema", "command"),
    [("public", "idempotency-mw migrate"), ("tenant_a", "idempotency-mw --schema tenant_a migrate")],
)
async def test_open_refuses_a_database_that_was_not_migrated(fresh_url: str, schema: str, command: str) -> None:
    store = PostgresStore(fresh_url, min_size=1, max_size=1, schema=schema)
    with pytest.raises(StoreNotMigrated) as refused:
        await store.open()
    assert str(refused.value) == (
        f'the idempotency tables are missing from schema "{schema}" of this database: '
        f"run `{command}`, or `await store.migrate()` before `store.open()`"
    )
    assert refused.value.schema == schema
    await store.migrate()
    await store.open()  # now it opens
    await store.close()


async def test_open_checks_an_app_pool_too(fresh_url: str) -> None:
    async with asyncpg.create_pool(fresh_url, min_size=1, max_size=1) as pool:
        store = PostgresStore(pool)
        with pytest.raises(StoreNotMigrated, match="idempotency-mw migrate"):
            await store.open()
        await store.migrate()
        await store.open()


async def test_every_statement_on_a_database_that_was_not_migrated_says_run_migrate(fresh_url: str) -> None:
    """Without open(), the first request used to fail with UndefinedTableError, and the middleware's 503 said
    "cannot be reached". StoreNotMigrated is still StoreUnavailable (503), with a message that names the fix."""
    store = PostgresStore(fresh_url, min_size=0, max_size=1, schema="not_created")
    calls: list[Callable[[], Awaitable[Any]]] = [
        lambda: store.claim("t", "k", FINGERPRINT, lease=10, ttl=60),
        lambda: store.renew("t", "k", 1, lease=10),
        lambda: store.complete("t", "k", 1, RESPONSE),
        lambda: store.release("t", "k", 1),
        lambda: store.forget("t", "k"),
        lambda: store.inspect("t", "k"),
        store.stats,
        store.count_expired,
        store.purge_expired,
    ]
    for call in calls:
        with pytest.raises(
            StoreNotMigrated, match=r'schema "not_created".*idempotency-mw --schema not_created migrate'
        ):
            await call()
    await store.close()


async def test_a_database_migrated_by_the_first_version_keeps_its_records(fresh_url: str) -> None:
    """0002 moves completed responses to a table of their own: a record completed before the upgrade still
    replays, one in progress is still in progress, and the fence sequence of the first version is gone."""
    sql = bookkeeping("public")
    version, name, first = migrations("public")[0]
    admin = await asyncpg.connect(fresh_url)
    try:
        await admin.execute(sql["create_table"])
        await admin.execute(first)
        await admin.execute(sql["record"], version, name)
        await admin.execute(
            "INSERT INTO idempotency_records (tenant, key, fingerprint, state, fence, lease_expires_at, status, "
            "headers, body, body_size, created_at, completed_at, expires_at) VALUES "
            "('t', 'paid', $1, 'completed', 5, NULL, 201, $2, $3, 9, now(), now(), now() + interval '1 hour'), "
            "('t', 'running', $1, 'in_progress', 6, now() + interval '1 hour', NULL, NULL, NULL, NULL, now(), NULL, "
            "now() + interval '1 hour')",
            FINGERPRINT,
            '[["content-type", "application/json"]]',
            b'{"id": 1}',
        )
    finally:
        await admin.close()
    store = PostgresStore(fresh_url, min_size=1, max_size=1)
    assert await store.migrate() == [name for _, name, _ in migrations("public")[1:]]
    async with store:
        paid = await store.claim("t", "paid", FINGERPRINT, lease=10, ttl=60)
        assert (paid.outcome, paid.response) == (ClaimOutcome.COMPLETED, RESPONSE)
        running = await store.claim("t", "running", FINGERPRINT, lease=10, ttl=60)
        assert running.outcome is ClaimOutcome.IN_PROGRESS
    assert "idempotency_fence" not in await relations_in(fresh_url, "public")


async def test_fences_are_random_tokens_unique_per_claim(migrated_url: str) -> None:
    """Unique per claim, with nothing to rewind: a restore or a promoted standby cannot hand out a fence again."""
    async with PostgresStore(migrated_url, min_size=1, max_size=1) as store:
        fences = set()
        for _ in range(50):
            claim = await store.claim("t-fences", "same-key", FINGERPRINT, lease=10, ttl=60)
            assert claim.outcome is ClaimOutcome.OWNED
            fences.add(claim.fence)
            assert await store.release("t-fences", "same-key", claim.fence)
    assert len(fences) == 50
    assert all(0 < fence < 2**63 for fence in fences)


# -- replays only read -----------------------------------------------------------------------------------------


async def row_version(url: str, tenant: str, key: str) -> tuple[str, str]:
    """The row's ``xmin`` (the transaction that wrote this version) and ``ctid`` (where it lies): both change on
    any write of the row, a lock-only update too."""
    (row,) = await fetch(
        url, "SELECT xmin::text, ctid::text FROM idempotency_records WHERE tenant = $1 AND key = $2", tenant, key
    )
    return row[0], row[1]


def claim_races(store: PostgresStore) -> Counter[str]:
    """From now on, count the statements ``store`` runs on its own connections, by name: ``claim_locked`` runs only
    when a claim lost a race (the store itself counts nothing of the kind)."""
    counts: Counter[str] = Counter()
    run = store.connector.run

    async def counted(name: str, args: tuple[Any, ...], **options: bool) -> Any:
        counts[name] += 1
        return await run(name, args, **options)

    store.connector.run = counted  # type: ignore[method-assign]
    return counts


async def test_a_replay_writes_nothing(migrated_url: str) -> None:
    """A retry storm on completed keys must stay reads: no new row version, so no WAL and no dead tuples."""
    async with opened(PostgresStore(migrated_url, min_size=1, max_size=2)) as store:
        statements = claim_races(store)
        claim = await store.claim("t", "paid", FINGERPRINT, lease=30, ttl=60)
        assert await store.complete("t", "paid", claim.fence, RESPONSE)
        before = await row_version(migrated_url, "t", "paid")
        for _ in range(3):
            replay = await store.claim("t", "paid", FINGERPRINT, lease=30, ttl=60)
            assert (replay.outcome, replay.response, replay.attempts) == (ClaimOutcome.COMPLETED, RESPONSE, 0)
        assert await row_version(migrated_url, "t", "paid") == before
        mismatch = await store.claim("t", "paid", b"other" * 4, lease=30, ttl=60)  # a 422 is counted: it writes
        assert (mismatch.outcome, mismatch.attempts) == (ClaimOutcome.MISMATCH, 1)
        assert await row_version(migrated_url, "t", "paid") != before
        assert statements["claim_locked"] == 0


async def test_replays_are_counted_in_batches_for_inspect(migrated_url: str) -> None:
    """A replay still writes nothing; the count reaches the record in one statement for many replays, with the
    time of the last one, and a batch that fails is counted again the next time."""
    async with opened(PostgresStore(migrated_url, min_size=1, max_size=2)) as store:
        claim = await store.claim("t", "counted", FINGERPRINT, lease=30, ttl=60, request="POST /v1/charges")
        assert await store.complete("t", "counted", claim.fence, RESPONSE)
        before = await row_version(migrated_url, "t", "counted")
        for _ in range(3):
            await store.claim("t", "counted", FINGERPRINT, lease=30, ttl=60, request="POST /v1/charges")
        assert await row_version(migrated_url, "t", "counted") == before  # no write per replay
        await store.count_replays()
        record = await store.inspect("t", "counted")
        assert record is not None
        assert (record.request, record.replays, record.attempts) == ("POST /v1/charges", 3, 0)
        assert record.last_replayed_at is not None
        assert abs(record.last_replayed_at - time.time()) < 60
        await store.claim("t", "counted", FINGERPRINT, lease=30, ttl=60)
    # close() wrote the last replay; a batch that cannot be written is kept for the next one.
    async with opened(PostgresStore(migrated_url, min_size=1, max_size=2)) as store:
        record = await store.inspect("t", "counted")
        assert record is not None
        assert record.replays == 4
        await store.claim("t", "counted", FINGERPRINT, lease=30, ttl=60)
        run = store._connector.run

        async def outage(name: str, args: tuple[Any, ...], **options: bool) -> Any:
            raise StoreUnavailable("the database went away")

        store._connector.run = outage  # type: ignore[method-assign]
        with pytest.raises(StoreUnavailable):
            await store.count_replays()
        store._connector.run = run  # type: ignore[method-assign]
        await store.claim("t", "counted", FINGERPRINT, lease=30, ttl=60)
        await store.count_replays()
        record = await store.inspect("t", "counted")
        assert record is not None
        assert record.replays == 6  # the batch that failed, and the replay after it


async def test_the_store_writes_its_replay_counts_on_its_own(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("idempotency_mw.postgres._store.REPLAYS_EVERY", 0.05)
    async with opened(PostgresStore(migrated_url, min_size=1, max_size=2)) as store:
        claim = await store.claim("t", "timer", FINGERPRINT, lease=30, ttl=60)
        assert await store.complete("t", "timer", claim.fence, RESPONSE)
        await store.claim("t", "timer", FINGERPRINT, lease=30, ttl=60)
        for _ in range(100):
            record = await store.inspect("t", "timer")
            if record is not None and record.replays:
                break
            await asyncio.sleep(0.02)
        assert record is not None
        assert record.replays == 1


async def test_replay_counts_the_database_refuses_are_logged_and_dropped(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A batch the database refuses (a runtime role without its grant on the replays' table, when the migration that
    brought it ran and no GRANT yet; here a constraint no row meets): its counts are dropped and the error logged,
    and the store writes later batches and closes cleanly, rather than keep counts that can never be written until
    memory runs out."""
    monkeypatch.setattr("idempotency_mw.postgres._store.REPLAYS_EVERY", 0.05)
    refuse = "ALTER TABLE idempotency_replays ADD CONSTRAINT refused CHECK (replays < 0) NOT VALID"
    async with opened(PostgresStore(migrated_url, min_size=1, max_size=2)) as store:
        claim = await store.claim("t", "refused", FINGERPRINT, lease=30, ttl=60)
        assert await store.complete("t", "refused", claim.fence, RESPONSE)
        await sql(migrated_url, refuse)
        await store.claim("t", "refused", FINGERPRINT, lease=30, ttl=60)
        with pytest.raises(asyncpg.CheckViolationError):
            await store.count_replays()  # asked directly: the error is the caller's
        await store.claim("t", "refused", FINGERPRINT, lease=30, ttl=60)
        for _ in range(100):
            if "replay counts not written, and dropped" in caplog.text:
                break
            await asyncio.sleep(0.02)
        assert "replay counts not written, and dropped" in caplog.text  # written by the store's own timer
        await sql(migrated_url, "ALTER TABLE idempotency_replays DROP CONSTRAINT refused")
        await store.claim("t", "refused", FINGERPRINT, lease=30, ttl=60)
    async with opened(PostgresStore(migrated_url, min_size=1, max_size=2)) as store:
        record = await store.inspect("t", "refused")
        assert record is not None
        assert record.replays == 1  # the replay after the refusals ended, written as the store closed


async def test_a_replay_batch_that_loses_a_deadlock_is_written_with_the_next(migrated_url: str) -> None:
    """Two batches lock their rows in key order and never deadlock each other; another transaction that locks them
    in the other order can, and the batch PostgreSQL rolls back is counted again, not dropped."""
    async with opened(PostgresStore(migrated_url, min_size=1, max_size=2)) as store:
        for key in ("a", "b"):
            claim = await store.claim("t", key, FINGERPRINT, lease=30, ttl=60)
            assert await store.complete("t", key, claim.fence, RESPONSE)
            await store.claim("t", key, FINGERPRINT, lease=30, ttl=60)
        await store.count_replays()
        for key in ("a", "b"):
            await store.claim("t", key, FINGERPRINT, lease=30, ttl=60)
        other = await asyncpg.connect(migrated_url)
        try:
            await other.execute("SET deadlock_timeout = '10s'")  # the batch's own check finds the deadlock first
            async with other.transaction():
                await other.execute("UPDATE idempotency_replays SET replays = replays WHERE key = 'b'")
                batch = asyncio.create_task(store.count_replays())  # updates a, then waits for b
                await wait_for_lock_wait(other)
                await other.execute("UPDATE idempotency_replays SET replays = replays WHERE key = 'a'")
                with pytest.raises(asyncpg.DeadlockDetectedError):
                    await batch
        finally:
            await other.close()
        await store.count_replays()
        for key in ("a", "b"):
            record = await store.inspect("t", key)
            assert record is not None
            assert record.replays == 2


async def sql(url: str, statement: str) -> None:
    connection = await asyncpg.connect(url)
    try:
        await connection.execute(statement)
    finally:
        await connection.close()


async def test_a_replay_counts_for_the_life_it_replayed(migrated_url: str) -> None:
    """A replay counted in memory, then its record expires and is claimed afresh before the batch: the count belongs
    to the life it replayed, which is gone, and the new life shows none."""
    async with opened(PostgresStore(migrated_url, min_size=1, max_size=2)) as store:
        claim = await store.claim("t", "lives", FINGERPRINT, lease=30, ttl=60)
        assert await store.complete("t", "lives", claim.fence, RESPONSE)
        assert (await store.claim("t", "lives", FINGERPRINT, lease=30, ttl=60)).outcome is ClaimOutcome.COMPLETED
        await sql(migrated_url, "UPDATE idempotency_records SET expires_at = now() - interval '1 second'")
        fresh = await store.claim("t", "lives", FINGERPRINT, lease=30, ttl=60)
        assert fresh.outcome is ClaimOutcome.OWNED
        await store.count_replays()
        record = await store.inspect("t", "lives")
        assert record is not None
        assert (record.state, record.replays, record.last_replayed_at) == ("in_progress", 0, None)


async def test_replay_counts_are_written_in_short_statements_and_kept_through_an_outage_up_to_a_bound(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Counts go out in statements of at most CHUNK records; an outage keeps those not yet written for the next
    batch, up to KEPT records (beyond, dropped and logged: an outage must not grow the memory without bound)."""
    monkeypatch.setattr(Replays, "CHUNK", 2)
    keys = ["k1", "k2", "k3", "k4", "k5"]
    async with opened(PostgresStore(migrated_url, min_size=1, max_size=2)) as store:
        for key in keys:
            claim = await store.claim("t", key, FINGERPRINT, lease=30, ttl=60)
            assert await store.complete("t", key, claim.fence, RESPONSE)
            await store.claim("t", key, FINGERPRINT, lease=30, ttl=60)
        run = store._connector.run
        sizes: list[int] = []

        async def second_statement_fails(name: str, args: tuple[Any, ...], **options: bool) -> Any:
            if name == "count_replays":
                sizes.append(len(args[0]))
                if len(sizes) == 2:
                    raise StoreUnavailable("the database went away")
            return await run(name, args, **options)

        store._connector.run = second_statement_fails  # type: ignore[method-assign]
        with pytest.raises(StoreUnavailable):
            await store.count_replays()  # two written, three kept
        await store.count_replays()
        assert sizes == [2, 2, 2, 1]
        assert [(await inspected(store, key)).replays for key in keys] == [1, 1, 1, 1, 1]

        monkeypatch.setattr(Replays, "KEPT", 1)
        for key in keys:
            await store.claim("t", key, FINGERPRINT, lease=30, ttl=60)

        async def outage(name: str, args: tuple[Any, ...], **options: bool) -> Any:
            if name == "count_replays":
                raise StoreUnavailable("the database went away")
            return await run(name, args, **options)

        store._connector.run = outage  # type: ignore[method-assign]
        with pytest.raises(StoreUnavailable):
            await store.count_replays()
        assert "idempotency replay counts of 4 records dropped" in caplog.text
        store._connector.run = run  # type: ignore[method-assign]
        await store.count_replays()
        assert sum([(await inspected(store, key)).replays for key in keys]) == 5 + 1  # the one kept


async def inspected(store: PostgresStore, key: str) -> RecordInfo:
    record = await store.inspect("t", key)
    assert record is not None
    return record


async def test_a_record_that_starts_afresh_forgets_its_request_and_replays(migrated_url: str) -> None:
    async with opened(PostgresStore(migrated_url, min_size=1, max_size=2)) as store:
        claim = await store.claim("t", "afresh", FINGERPRINT, lease=30, ttl=60, request="POST /v1/old")
        assert await store.complete("t", "afresh", claim.fence, RESPONSE)
        await store.claim("t", "afresh", FINGERPRINT, lease=30, ttl=60)
        await store.count_replays()
        connection = await asyncpg.connect(migrated_url)
        try:
            await connection.execute(
                "UPDATE idempotency_records SET expires_at = now() - interval '1 second' WHERE key = 'afresh'"
            )
        finally:
            await connection.close()
        fresh = await store.claim("t", "afresh", b"other" * 4, lease=30, ttl=60, request="PATCH /v1/new")
        assert fresh.outcome is ClaimOutcome.OWNED
        record = await store.inspect("t", "afresh")
        assert record is not None
        assert (record.request, record.replays, record.last_replayed_at) == ("PATCH /v1/new", 0, None)


async def wait_for_lock_wait(connection: asyncpg.Connection) -> None:
    """Until a session of this database waits for another's transaction (a row it must wait for)."""
    for _ in range(100):
        await asyncio.sleep(0.02)
        waiting = await connection.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event = 'transactionid'"
        )
        if waiting:
            return
    raise AssertionError("no session ever waited for the open transaction")


def counting_statements(store: PostgresStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the statements the store runs on its own connections from now on, in order."""
    names: list[str] = []
    run = store._connector.run

    async def counted(name: str, args: tuple[Any, ...], **options: bool) -> Any:
        names.append(name)
        return await run(name, args, **options)

    monkeypatch.setattr(store._connector, "run", counted)
    return names


async def test_every_answer_but_a_takeover_is_one_statement(migrated_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """claim answers a fresh key, a replay, a 409 and a 422 alone; an expired record or a lapsed lease to take over
    goes on to claim_or_take_over (sql/queries.sql), which PostgreSQL costs more to run for every claim."""
    async with opened(PostgresStore(migrated_url, min_size=1, max_size=2)) as store:
        statements = claim_races(store)
        names = counting_statements(store, monkeypatch)

        async def statements_of(key: str, fingerprint: bytes = FINGERPRINT) -> tuple[ClaimOutcome, list[str]]:
            names.clear()
            claim = await store.claim("t", key, fingerprint, lease=30, ttl=60)
            return claim.outcome, list(names)

        assert await statements_of("paid") == (ClaimOutcome.OWNED, ["claim"])
        assert await statements_of("paid") == (ClaimOutcome.IN_PROGRESS, ["claim"])
        assert await statements_of("paid", b"other" * 4) == (ClaimOutcome.MISMATCH, ["claim"])
        await fetch(migrated_url, "UPDATE idempotency_records SET lease_expires_at = now() - interval '1 s'")
        assert await statements_of("paid", b"other" * 4) == (ClaimOutcome.MISMATCH, ["claim"])
        assert await statements_of("paid") == (ClaimOutcome.OWNED, ["claim", "claim_or_take_over"])
        (fence,) = [row[0] for row in await fetch(migrated_url, "SELECT fence FROM idempotency_records")]
        assert await store.complete("t", "paid", fence, RESPONSE)
        assert await statements_of("paid") == (ClaimOutcome.COMPLETED, ["claim"])
        assert await statements_of("paid", b"other" * 4) == (ClaimOutcome.MISMATCH, ["claim"])
        await fetch(migrated_url, "UPDATE idempotency_records SET expires_at = now() - interval '1 s'")
        assert await statements_of("paid", b"other" * 4) == (ClaimOutcome.OWNED, ["claim", "claim_or_take_over"])
        (attempts,) = [row[0] for row in await fetch(migrated_url, "SELECT attempts FROM idempotency_records")]
        assert attempts == 0  # the record started afresh, for the other request
        assert statements["claim_locked"] == 0


async def test_a_claim_says_when_its_record_expires_from_each_statement(migrated_url: str) -> None:
    """The claim carries the record's expires_at as the database wrote it (the Idempotency-Expires header), from
    claim and from claim_or_take_over: a fresh record's, a lapsed lease's taken over (its first expiry, not a new
    ttl from now), a replay's; no extra statement. (claim_locked: the race test below.)"""
    async with opened(PostgresStore(migrated_url, min_size=1, max_size=2)) as store:

        async def expiry() -> float:
            record = await store.inspect("t", "dated")
            assert record is not None
            return record.expires_at

        fresh = await store.claim("t", "dated", FINGERPRINT, lease=30, ttl=3600)
        assert fresh.expires_at == await expiry()
        assert fresh.expires_at is not None
        assert abs(fresh.expires_at - (time.time() + 3600)) < 60
        await fetch(
            migrated_url,
            "UPDATE idempotency_records SET lease_expires_at = now() - interval '1 s', "
            "expires_at = now() + interval '600 s'",
        )
        taken = await store.claim("t", "dated", FINGERPRINT, lease=30, ttl=3600)
        assert taken.outcome is ClaimOutcome.OWNED
        assert taken.expires_at == await expiry()
        assert taken.expires_at is not None
        assert taken.expires_at < time.time() + 1200  # not now + ttl
        assert await store.complete("t", "dated", taken.fence, RESPONSE)
        replay = await store.claim("t", "dated", FINGERPRINT, lease=30, ttl=3600)
        assert (replay.outcome, replay.expires_at) == (ClaimOutcome.COMPLETED, await expiry())
        assert (await store.claim("t", "dated", b"other" * 4, lease=30, ttl=3600)).expires_at is None  # a 422


async def test_a_claim_that_meets_an_insert_committed_after_its_snapshot_still_answers(migrated_url: str) -> None:
    """claim's INSERT waits for a concurrent insert of the key and then does nothing, while the rest of the statement
    reads the snapshot taken before that insert committed, so it finds no row. claim_or_take_over then reads a newer
    snapshot and answers from the row as it is: here, in progress, 409."""
    other = await asyncpg.connect(migrated_url)
    try:
        async with opened(PostgresStore(migrated_url, min_size=1, max_size=2)) as store:
            statements = claim_races(store)
            transaction = other.transaction()
            await transaction.start()
            await other.execute(
                "INSERT INTO idempotency_records (tenant, key, fingerprint, fence, lease_expires_at, created_at, "
                "expires_at) VALUES ('t', 'raced', $1, 7, now() + interval '30 s', now(), now() + interval '60 s')",
                FINGERPRINT,
            )
            claiming = asyncio.create_task(store.claim("t", "raced", FINGERPRINT, lease=30, ttl=60))
            await wait_for_lock_wait(other)
            await transaction.commit()
            claim = await claiming
            assert claim.outcome is ClaimOutcome.IN_PROGRESS
            assert statements["claim_locked"] == 0
    finally:
        await other.close()


async def test_a_claim_that_meets_a_completion_committed_after_its_snapshot_still_answers(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """claim_or_take_over's UPDATE waits for a completion of the key and re-reads the record, whose lease then ended;
    the response is not in its snapshot, so it finds no row to answer from. It must then look again (claim_locked)
    and answer from the rows as they are: here, completed, a replay. The completion begins as claim_or_take_over is
    about to run, once claim has found a lapsed lease (a takeover is its to decide)."""
    other = await asyncpg.connect(migrated_url)
    try:
        async with opened(PostgresStore(migrated_url, min_size=1, max_size=2)) as store:
            owned = await store.claim("t", "raced", FINGERPRINT, lease=30, ttl=60)
            await fetch(migrated_url, "UPDATE idempotency_records SET lease_expires_at = now() - interval '1 s'")
            completing = other.transaction()
            statements = claim_races(store)
            run = store._connector.run
            committed: list[asyncio.Task[None]] = []

            async def commit_once_claim_waits() -> None:
                await wait_for_lock_wait(other)
                await completing.commit()

            async def completion_races_claim(name: str, args: tuple[Any, ...], **options: bool) -> Any:
                if name == "claim_or_take_over" and not committed:
                    await completing.start()
                    row = ("t", "raced", owned.fence, RESPONSE.status, '[["content-type", "application/json"]]')
                    await other.execute(
                        store._records.sql["complete"], *row, RESPONSE.body, RESPONSE.body_size, None, None
                    )
                    committed.append(asyncio.create_task(commit_once_claim_waits()))
                return await run(name, args, **options)

            monkeypatch.setattr(store._connector, "run", completion_races_claim)
            claim = await store.claim("t", "raced", FINGERPRINT, lease=30, ttl=60)
            await committed[0]
            assert (claim.outcome, claim.response) == (ClaimOutcome.COMPLETED, RESPONSE)
            assert statements["claim_locked"] == 1
            record = await store.inspect("t", "raced")
            assert record is not None
            assert claim.expires_at == record.expires_at
    finally:
        await other.close()


# -- URLs, open and close ----------------------------------------------------------------------------------------


async def test_close_lets_unsettled_claims_finish_and_refuses_new_ones(idempotency_database_url: str) -> None:
    """What a graceful shutdown needs (tests/scenarios/test_shutdown.py has the real one): a claim still being
    settled gets its connection while close() waits; a claim that never settles delays close() by ``grace`` at most."""
    store = PostgresStore(idempotency_database_url, max_size=2)
    key = str(uuid.uuid4())
    claim = await store.claim("t-close", key, b"f" * 32, lease=30, ttl=60)
    closing = asyncio.create_task(store.close(grace=10))
    await asyncio.sleep(0.05)
    assert not closing.done()  # waiting for the claim
    with pytest.raises(StoreUnavailable, match="closing"):
        await store.claim("t-close", str(uuid.uuid4()), b"f" * 32, lease=30, ttl=60)
    assert await store.release("t-close", key, claim.fence)
    await asyncio.wait_for(closing, 5)

    stuck = PostgresStore(idempotency_database_url, max_size=2)
    await stuck.claim("t-close", str(uuid.uuid4()), b"f" * 32, lease=30, ttl=60)  # never settled
    started = time.monotonic()
    await stuck.close(grace=0.2)
    assert time.monotonic() - started < 5  # bounded by the grace, not by the lease


def spelled(url: str, scheme: str) -> str:
    """``url`` with another scheme (``postgresql+asyncpg``, as SQLAlchemy writes it)."""
    return scheme + url[url.index("://") :]


@pytest.mark.parametrize(
    "scheme",
    ["postgresql", "postgres", "postgresql+asyncpg", "postgresql+psycopg", "postgresql+psycopg2", "postgres+pg8000"],
)
async def test_the_sqlalchemy_spellings_of_a_postgresql_url_are_accepted(
    idempotency_database_url: str, scheme: str
) -> None:
    """A deploy shares one DATABASE_URL between the engine and the store, in SQLAlchemy's spelling: asyncpg refused
    it ("scheme is expected to be either postgresql or postgres")."""
    async with PostgresStore(spelled(idempotency_database_url, scheme), min_size=1, max_size=1) as store:
        assert await store.inspect("t-url", "absent") is None


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("mysql://app:s3cret@db/app", "'mysql'"),
        ("sqlite+aiosqlite:///app.db", "'sqlite+aiosqlite'"),
        ("postgresql+://app:s3cret@db/app", "'postgresql+'"),
        ("app:s3cret@db/app", "no scheme"),
    ],
)
def test_a_url_of_another_database_is_refused_with_what_to_give(url: str, named: str) -> None:
    with pytest.raises(ValueError, match="PostgreSQL URL") as refused:
        PostgresStore(url)
    message = str(refused.value)
    assert named in message
    assert "postgresql+asyncpg://" in message  # the spellings it takes
    assert "s3cret" not in message  # never the password


async def test_a_closed_store_opens_again(idempotency_database_url: str) -> None:
    """A module-level store opened and closed in the app's lifespan, run once per test: the second open() found the
    pool closed ("the idempotency store's pool is closed") and the app could not start."""
    store = PostgresStore(idempotency_database_url, min_size=1, max_size=2)
    for _ in range(3):
        await store.open()
        key = str(uuid.uuid4())
        claim = await store.claim("t-reopen", key, FINGERPRINT, lease=30, ttl=60)
        assert await store.complete("t-reopen", key, claim.fence, RESPONSE)
        await store.close()
        with pytest.raises(StoreUnavailable):  # closed means closed, until the next open()
            await store.inspect("t-reopen", key)


def test_a_closed_store_opens_again_on_another_event_loop(idempotency_database_url: str) -> None:
    """The same, each lifespan on an event loop of its own (``with TestClient(app):`` per test): the connections of
    the first loop are closed with it, the second open() makes new ones."""
    store = PostgresStore(idempotency_database_url, min_size=1, max_size=2)

    async def lifespan() -> None:
        async with store:
            key = str(uuid.uuid4())
            claim = await store.claim("t-reopen", key, FINGERPRINT, lease=30, ttl=60)
            assert await store.complete("t-reopen", key, claim.fence, RESPONSE)

    asyncio.run(lifespan())
    asyncio.run(lifespan())


async def test_reopening_keeps_the_grace_for_new_claims_and_not_for_old_ones(idempotency_database_url: str) -> None:
    """close() waits (up to ``grace``) for the claims of the store's current opening: a claim left over from before
    an earlier close() had its grace then, and is not waited for again."""
    store = PostgresStore(idempotency_database_url, max_size=2)
    await store.open()
    await store.claim("t-reopen", str(uuid.uuid4()), FINGERPRINT, lease=30, ttl=60)  # never settled
    await store.close(grace=0.1)
    await store.open()
    started = time.monotonic()
    await store.close(grace=10)
    assert time.monotonic() - started < 5  # the old claim is not waited for a second time

    await store.open()
    key = str(uuid.uuid4())
    claim = await store.claim("t-reopen", key, FINGERPRINT, lease=30, ttl=60)
    closing = asyncio.create_task(store.close(grace=10))
    await asyncio.sleep(0.05)
    assert not closing.done()  # waiting for the new claim, as documented
    assert await store.release("t-reopen", key, claim.fence)
    await asyncio.wait_for(closing, 5)


async def test_a_connection_lent_before_a_reopen_is_closed_when_it_comes_back(idempotency_database_url: str) -> None:
    """A connection still out when the store closed belongs to the pool that was closed: given back after the store
    opened again, it is closed, not mixed into the new pool (where it could outnumber ``max_size``, or belong to an
    event loop that is gone)."""
    store = PostgresStore(idempotency_database_url, min_size=0, max_size=2)
    await store.open()
    async with store.connection() as connection:
        pid = await connection.fetchval("SELECT pg_backend_pid()")
        await store.close(grace=0)
        await store.open()
    for _ in range(100):
        if not await fetch(idempotency_database_url, "SELECT 1 FROM pg_stat_activity WHERE pid = $1", pid):
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError("the connection of the closed pool was kept")
    assert await store.inspect("t-reopen", "absent") is None  # the new pool works
    await store.close()


async def backends(url: str, application_name: str) -> int:
    """How many server processes serve connections named ``application_name``, once those closing have gone."""
    for _ in range(100):
        count = await fetch(url, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", application_name)
        if count[0][0] == 0:
            break
        await asyncio.sleep(0.02)
    return int(count[0][0])


async def migrate(url: str) -> None:
    store = PostgresStore(url, min_size=0, max_size=1)
    try:
        await store.migrate()
    finally:
        await store.close()


@pytest.mark.parametrize("failure", ["not migrated", "not granted", "second connection refused"])
async def test_a_failed_open_leaves_no_connection_open(fresh_url: str, failure: str) -> None:
    """open() failed (StoreNotMigrated, StoreNotGranted, or an error once its first connections were open) and kept
    those connections until close(), which a caller whose startup failed seldom calls: their backends stayed on the
    server. Now nothing of a failed open() stays open, and the store is as before it: close() is harmless, and once
    the cause is fixed it works on demand and opens again."""
    name = f"imw_failed_open_{uuid.uuid4().hex[:8]}"
    role = f"imw_opener_{uuid.uuid4().hex[:8]}"
    tables = f"ALL TABLES IN SCHEMA public TO {role}"
    cause, fix = {
        "not migrated": ("", f"GRANT SELECT, INSERT, UPDATE, DELETE ON {tables}"),
        "not granted": (f"GRANT SELECT ON {tables}", f"GRANT INSERT, UPDATE, DELETE ON {tables}"),
        "second connection refused": (
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON {tables}; ALTER ROLE {role} CONNECTION LIMIT 1",
            f"ALTER ROLE {role} CONNECTION LIMIT -1",
        ),
    }[failure]
    parts = urlsplit(with_setting(fresh_url, "application_name", name))
    url = urlunsplit(parts._replace(netloc=f"{role}:pw@{parts.netloc.rsplit('@', 1)[-1]}"))
    admin = await asyncpg.connect(fresh_url)
    await admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'pw'")
    try:
        if failure != "not migrated":
            await migrate(fresh_url)
        if cause:
            await admin.execute(cause)
        store = PostgresStore(url, min_size=2, max_size=2)
        with pytest.raises(StoreUnavailable):
            await store.open()
        assert await backends(fresh_url, name) == 0
        await store.close()  # harmless
        with pytest.raises(StoreUnavailable):  # tried again
            await store.open()
        assert await backends(fresh_url, name) == 0

        if failure == "not migrated":
            await migrate(fresh_url)
        await admin.execute(fix)
        assert await store.inspect("t", "absent") is None  # on demand, as a store never opened
        await store.open()
        assert await store.inspect("t", "absent") is None
        await store.close()
        assert await backends(fresh_url, name) == 0
    finally:
        await admin.execute(f"DROP OWNED BY {role}; DROP ROLE {role}")
        await admin.close()


async def test_a_failed_open_leaves_the_requests_already_served_alone(migrated_url: str) -> None:
    """A store that already serves requests on demand fails to open (here its open() is cancelled by a startup
    deadline while it waits for the pool's one connection). A completion waiting for that connection still gets it
    and completes its record: the retry replays, and the handler ran once. Closing the pool on a failed open()
    failed that waiting completion (PoolClosed: "the store was closed"), left the record in progress, and ran the
    handler again once its lease lapsed."""
    store = PostgresStore(migrated_url, min_size=1, max_size=1)
    entered, go = asyncio.Event(), asyncio.Event()
    runs = 0

    async def charge(request: Request) -> Response:
        nonlocal runs
        runs += 1
        entered.set()
        await go.wait()
        return JSONResponse({"charged": True}, status_code=201)

    app = Starlette(routes=[Route("/charge", charge, methods=["POST"])])
    client = client_for(IdempotencyMiddleware(app, store=store))
    headers = {"Idempotency-Key": str(uuid.uuid4())}
    try:
        request = asyncio.ensure_future(client.post("/charge", headers=headers))
        await entered.wait()  # claimed on demand: the store was never opened
        async with store.connection():  # the pool's one connection, busy (the app's own use of the store)
            go.set()  # the handler answers: its completion waits for that connection
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(store.open(), 0.3)  # it waits for the connection too, past its deadline
        first = await request
        retry = await client.post("/charge", headers=headers)
        assert (first.status_code, retry.status_code, retry.headers.get("idempotent-replayed")) == (201, 201, "true")
        assert runs == 1
    finally:
        await store.close()


async def test_a_sqlalchemy_store_that_fails_to_open_leaves_no_connection_open(
    migrated_url: str, idempotency_database_url: str
) -> None:
    """The same for SQLAlchemyStore, whose open() refuses an engine that reaches another database once the store's
    own connections are open."""
    from sqlalchemy.ext.asyncio import create_async_engine

    from idempotency_mw.sqlalchemy import SQLAlchemyStore

    name = f"imw_failed_open_{uuid.uuid4().hex[:8]}"
    engine = create_async_engine(spelled(idempotency_database_url, "postgresql+asyncpg"))
    own = PostgresStore(with_setting(migrated_url, "application_name", name), min_size=2, max_size=2)
    store = SQLAlchemyStore(own, engine)
    try:
        with pytest.raises(ValueError, match="both must use the same database"):
            await store.open()
        assert await backends(migrated_url, name) == 0
    finally:
        await store.close()
        await engine.dispose()


# -- what the database refuses to store -------------------------------------------------------------------------


async def test_a_response_the_database_cannot_store_still_completes_the_key(pg_store: PostgresStore) -> None:
    """A header value with a NUL byte cannot be stored (jsonb refuses \\u0000). The effect has happened all the same:
    the key must not stay in progress until its lease lapses and then run again. It completes without a response
    to replay, and the retry is told so."""
    runs = 0

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal runs
        runs += 1
        await receive()
        await send({"type": "http.response.start", "status": 201, "headers": [(b"x-odd", b"a\x00b")]})
        await send({"type": "http.response.body", "body": b"charged"})

    client = client_for(IdempotencyMiddleware(app, store=pg_store, lease=0.3))
    key = str(uuid.uuid4())
    assert (await client.post("/charges", headers={"Idempotency-Key": key})).status_code == 201
    await asyncio.sleep(0.5)  # past the lease
    retry = await client.post("/charges", headers={"Idempotency-Key": key})
    assert retry.status_code == 409
    assert retry.json()["code"] == "idempotency_response_not_replayable"
    assert runs == 1


# -- fences -----------------------------------------------------------------------------------------------------


async def test_a_completed_record_replays_even_if_its_fence_is_drawn_again(
    pg_store: PostgresStore, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fences are random 63-bit tokens, so a fresh claim draws a stored record's fence once in 2^63 (or when rows
    were loaded by hand). Then the record must still replay, not run again."""
    from idempotency_mw import StoredResponse
    from idempotency_mw.postgres import _records

    fp = b"r" * 32
    claim = await pg_store.claim("t", key, fp, lease=60, ttl=60)
    assert await pg_store.complete("t", key, claim.fence, StoredResponse(201, [], b"done", 4))
    monkeypatch.setattr(_records, "new_fence", lambda: claim.fence)  # the next draw: its fence
    again = await pg_store.claim("t", key, fp, lease=60, ttl=60)
    assert again.outcome.value == "completed"
    assert again.response is not None
    assert again.response.body == b"done"


# -- transactional mode on asyncpg (what both flavours share is in test_transaction.py) ---------------------------


@pytest.fixture
async def db(idempotency_database_url: str) -> AsyncIterator[asyncpg.Connection]:
    connection = await asyncpg.connect(idempotency_database_url)
    await connection.execute("CREATE TABLE IF NOT EXISTS tx_effects (key text, note text)")
    yield connection
    await connection.close()


async def effects(db: asyncpg.Connection, key: str) -> int:
    return int(await db.fetchval("SELECT count(*) FROM tx_effects WHERE key = $1", key))


def writing_app(store: PostgresStore) -> Starlette:
    """``POST /write``: one effect, written through the connection the handler is lent."""

    async def write(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        assert context.connection is not None
        await context.connection.execute("INSERT INTO tx_effects VALUES ($1, 'ok')", context.key or "none")
        return JSONResponse({"written": "ok"}, status_code=201)

    app = Starlette(routes=[Route("/write", write, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=True)
    return app


async def test_a_connection_lost_before_begin_is_store_unavailable(pg_store: PostgresStore) -> None:
    async with pg_store.transaction() as transaction:
        assert isinstance(transaction, PostgresTransaction)
        transaction.connection.terminate()
        with pytest.raises(StoreUnavailable):
            await transaction.begin()
        assert transaction.lost


async def test_a_handler_that_changes_search_path_still_completes(
    pg_store: PostgresStore, db: asyncpg.Connection
) -> None:
    """Schema-per-tenant apps set the search_path on the connection they are lent; the record's completion, on the
    same connection, names its table in full and does not care."""
    await db.execute("CREATE SCHEMA IF NOT EXISTS imw_tenant_schema")
    key = str(uuid.uuid4())

    async def write(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        assert context.connection is not None
        await context.connection.execute("SET search_path = imw_tenant_schema")
        await context.connection.execute("INSERT INTO public.tx_effects VALUES ($1, 'schema')", context.key)
        return JSONResponse({"ok": True}, status_code=201)

    app = Starlette(routes=[Route("/write", write, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=pg_store, transactional=True)
    client = client_for(app)
    assert (await client.post("/write", headers={"Idempotency-Key": key})).status_code == 201
    again = await client.post("/write", headers={"Idempotency-Key": key})
    assert again.headers["idempotent-replayed"] == "true"
    assert await effects(db, key) == 1


# The flushes sessions wait for at their commits: those of the WAL writer, autovacuum and the checkpointer (an
# asynchronous commit's flush among them, done in the background) keep no request waiting.
WAL_FSYNCS = "SELECT sum(fsyncs)::bigint FROM pg_stat_io WHERE object = 'wal' AND backend_type = 'client backend'"
REQUESTS = 40


async def wal_flushes_per_request(url: str, app: Starlette, store: PostgresStore, path: str) -> float:
    """The WAL flushes sessions waited for, per fresh keyed request to ``path``, as PostgreSQL counts them (its
    statistics flushed as the store's connections close)."""
    client = client_for(app)
    admin = await asyncpg.connect(url)
    try:
        await client.post(path, headers={"Idempotency-Key": str(uuid.uuid4())})  # statements prepared
        before = await admin.fetchval(WAL_FSYNCS)
        for _ in range(REQUESTS):
            assert (await client.post(path, headers={"Idempotency-Key": str(uuid.uuid4())})).status_code == 201
        await store.close()
        await admin.execute("SELECT pg_stat_force_next_flush()")
        await asyncio.sleep(0.1)
        return float(await admin.fetchval(WAL_FSYNCS) - before) / REQUESTS
    finally:
        await admin.close()


async def test_a_fresh_transactional_request_waits_for_one_wal_flush(migrated_url: str) -> None:
    """The claim commits at once, for duplicates to see, but does not wait for its WAL flush: the handler's COMMIT
    flushes it, WAL being flushed in order, so the claim is durable whenever the effect is. 2 flushes per request
    before; 1 now."""
    admin = await asyncpg.connect(migrated_url)
    try:
        await admin.execute("CREATE TABLE IF NOT EXISTS tx_effects (key text, note text)")
    finally:
        await admin.close()
    store = PostgresStore(migrated_url, min_size=1, max_size=2)
    flushes = await wal_flushes_per_request(migrated_url, writing_app(store), store, "/write")
    assert flushes < 1.3, f"{flushes:.2f} WAL flushes per fresh transactional request"


async def test_a_plain_claim_still_waits_for_its_flush(migrated_url: str) -> None:
    """Plain mode's effect is outside the database: a claim lost in a crash could let the retry run it again, so its
    claim and its completion each wait for their flush, as before."""
    store = PostgresStore(migrated_url, min_size=1, max_size=2)
    app = Starlette(routes=[Route("/plain", lambda request: JSONResponse({}, status_code=201), methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store)
    flushes = await wal_flushes_per_request(migrated_url, app, store, "/plain")
    assert flushes >= 1.9, f"{flushes:.2f} WAL flushes per fresh plain request"


def test_the_store_names_its_tables_with_its_schema(pg_store: PostgresStore) -> None:
    assert 'INSERT INTO "public".idempotency_responses' in pg_store._records.sql["complete_in_transaction"]
