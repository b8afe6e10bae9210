"""Behind PgBouncer in transaction pooling mode (issue 13): the storm across processes, and transactional mode with a
store built from a DSN and with one on the app's own asyncpg pool.

The conformance suite runs through the same PgBouncer too: ``store`` in tests/conftest.py has ``pgbouncer`` and
``pgbouncer-pool`` parameters. A machine that cannot get PgBouncer fails here (the fixture raises), never skips.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import asyncpg
import httpx
import pytest

from faults.ledger_app import create_app
from faults.storm import run_storm
from faults.workers import effects_per_key, violations
from idempotency_mw import PostgresStore
from idempotency_mw.postgres._lending import PostgresTransaction

pytestmark = pytest.mark.slow


@pytest.mark.no_cover  # untraced, as the storms of tests/faults/test_storm.py, for the same reason
async def test_storm_through_pgbouncer_takes_every_payment_once(
    idempotency_database_url: str, pgbouncer_url: str
) -> None:
    result, answers = await run_storm(idempotency_database_url, payments=60, copies=5, pgbouncer=pgbouncer_url)
    assert result.duplicates == 0
    assert result.lost == 0
    assert not answers.other, f"copies answered with something else than 409 or a replay: {answers.other}"
    assert answers.mismatched_replays == 0
    assert answers.originals == 60 - answers.payments_without_original
    assert answers.originals + answers.replays + answers.conflicts == 60 * 5


@contextlib.asynccontextmanager
async def store_through(url: str, kind: str) -> AsyncIterator[PostgresStore]:
    if kind == "dsn":
        async with PostgresStore(url, prepared_statements=False) as store:
            yield store
    else:
        pool = await asyncpg.create_pool(url, min_size=1, max_size=20, statement_cache_size=0)
        try:
            async with PostgresStore(pool) as store:
                yield store
        finally:
            await pool.close()


@pytest.mark.parametrize("kind", ["dsn", "pool"])
async def test_transactional_requests_through_pgbouncer_take_effect_once(
    idempotency_database_url: str, pgbouncer_url: str, kind: str
) -> None:
    """Each handler writes its effect on the connection the store lends it, inside the transaction that completes
    its record: all of it through PgBouncer. Three concurrent copies of each request; one effect per key."""
    run = uuid.uuid4().hex[:12]
    keys = [f"bouncer-{kind}-{run}-{i}" for i in range(30)]
    async with store_through(pgbouncer_url, kind) as store:
        # The app's own pool (entries, checks) goes to the server directly; the store and the handler's
        # transaction go through PgBouncer.
        app = create_app(idempotency_database_url, transactional=True, lease=2.0, store=store)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://ledger") as client:

                async def send(key: str) -> int:
                    reply = await client.post("/effects", json={"key": key}, headers={"Idempotency-Key": key})
                    return reply.status_code

                statuses = await asyncio.gather(*(send(key) for key in keys for _ in range(3)))
                assert set(statuses) <= {201, 409}, statuses
                again = await asyncio.gather(*(send(key) for key in keys))  # all settled: every one replays
                assert set(again) == {201}
    counts = await effects_per_key(idempotency_database_url, keys)
    assert [counts[key] for key in keys] == [1] * len(keys)
    assert await violations(idempotency_database_url, keys) == []


async def test_a_lent_connection_comes_back_healthy_through_pgbouncer(pgbouncer_url: str) -> None:
    """The full session reset (sql/reset_session.sql) is one simple query: PgBouncer runs it on whichever server
    connection it picks, and the store keeps the connection. A reset that failed would have closed it."""
    async with PostgresStore(pgbouncer_url, prepared_statements=False, min_size=1, max_size=2) as store:
        async with store.connection() as connection:
            await connection.execute("SET application_name = 'lent'")
            lent = connection.get_server_pid()  # PgBouncer's own key for this client connection
        async with store.transaction() as transaction:
            assert isinstance(transaction, PostgresTransaction)
            await transaction.begin()
            assert transaction.connection.get_server_pid() == lent  # the same connection, kept
            assert await transaction.connection.fetchval("SELECT 1") == 1
            await transaction.commit()
        assert not transaction.connection.is_closed()


def test_prepared_statements_false_with_a_pool_is_refused() -> None:
    with pytest.raises(ValueError, match="statement_cache_size=0"):
        PostgresStore(object(), prepared_statements=False)  # type: ignore[arg-type]
