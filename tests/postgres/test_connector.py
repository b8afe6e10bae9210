"""connectors.py: where a PostgresStore's connections come from (a pool of its own, or the app's asyncpg pool), and
the promises both keep: a statement's deadline is the store's ``timeout``, a busy pool and a database that does not
answer fail differently, a terminated server process is the store being unavailable, the last connection stays for
the work that finishes requests, and the store's statements run under READ COMMITTED whatever the database's
default isolation level."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any

import asyncpg
import pytest

from idempotency_mw import PostgresStore, StoredResponse
from idempotency_mw.store import ClaimOutcome, PoolExhausted, StoreUnavailable

FINGERPRINT = bytes(range(32))
RESPONSE = StoredResponse(201, [(b"content-type", b"application/json")], b'{"id": 1}', 9)


async def test_a_statement_that_gets_no_answer_within_the_timeout_is_store_unavailable(migrated_url: str) -> None:
    """The store's statements have no timer of their own (connections.Deadlines keeps one per pool): a statement
    stuck behind a lock it will never get must still end as StoreUnavailable soon after ``timeout``."""
    locker = await asyncpg.connect(migrated_url)
    try:
        async with PostgresStore(migrated_url, min_size=1, max_size=1, timeout=0.4) as store:
            await store.claim("t", "warm-up", FINGERPRINT, lease=10, ttl=60)  # the claim is prepared by now
            transaction = locker.transaction()
            await transaction.start()
            await locker.execute("LOCK TABLE idempotency_records IN ACCESS EXCLUSIVE MODE")
            started = time.monotonic()
            with pytest.raises(StoreUnavailable) as unavailable:
                await store.claim("t", "locked-out", FINGERPRINT, lease=10, ttl=60)
            waited = time.monotonic() - started
            assert isinstance(unavailable.value.__cause__, TimeoutError)
            assert "did not answer within 0.4s" in str(unavailable.value)
            assert waited < 5  # did not hang (about 0.4 to 0.5 s)
            await transaction.rollback()
            # A fresh connection serves the next claim. (The abandoned one may still land once its server process
            # gets the lock, as with asyncpg's own deadline: a 503 never says that nothing happened.)
            claim = await store.claim("t", "after-the-lock", FINGERPRINT, lease=10, ttl=60)
            assert claim.outcome is ClaimOutcome.OWNED
    finally:
        await locker.close()


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A DSN whose server accepts connections (the kernel does) and never says a word: connecting times out."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        yield f"postgresql://nobody@127.0.0.1:{silent.getsockname()[1]}/none"


async def test_an_exhausted_app_pool_raises_pool_exhausted(idempotency_database_url: str) -> None:
    async with asyncpg.create_pool(idempotency_database_url, min_size=1, max_size=2) as pool:
        store = PostgresStore(pool, timeout=0.2)
        async with pool.acquire(), pool.acquire():  # the app's own work holds every connection
            with pytest.raises(PoolExhausted) as exhausted:
                await store.claim("t", str(uuid.uuid4()), FINGERPRINT, lease=10, ttl=60)
        assert str(exhausted.value) == (
            "the asyncpg pool passed to PostgresStore is exhausted: no connection came free within 0.2s "
            "(max_size=2). If the database answers promptly, the pool is too small for the load: raise max_size"
        )
        assert (exhausted.value.pool, exhausted.value.max_size, exhausted.value.timeout) == (
            "the asyncpg pool passed to PostgresStore",
            2,
            0.2,
        )
        assert isinstance(exhausted.value, StoreUnavailable)


async def test_on_an_app_pool_lent_transactions_leave_a_connection_for_renewals(idempotency_database_url: str) -> None:
    """A transactional handler holds a connection for as long as it runs. The store keeps the last connection of
    its pool for the work that finishes requests (renewals, completions, releases), on an app's pool as on its own:
    otherwise handlers holding every connection would keep a running handler's lease from being renewed, it would
    lapse, and a retry would run the handler again."""
    key = str(uuid.uuid4())
    async with asyncpg.create_pool(idempotency_database_url, min_size=1, max_size=2) as pool:
        store = PostgresStore(pool, timeout=0.3)
        claim = await store.claim("t", key, FINGERPRINT, lease=30, ttl=60)
        async with store.transaction():
            with pytest.raises(PoolExhausted):
                async with store.transaction():
                    pass
            with pytest.raises(PoolExhausted):
                await store.claim("t", str(uuid.uuid4()), FINGERPRINT, lease=30, ttl=60)
            assert await store.renew("t", key, claim.fence, lease=30)
            assert await store.complete("t", key, claim.fence, RESPONSE)


async def test_an_app_pool_that_cannot_connect_is_not_called_exhausted(silent_server: str) -> None:
    async with asyncpg.create_pool(silent_server, min_size=0, max_size=2) as pool:
        store = PostgresStore(pool, timeout=0.2)
        with pytest.raises(StoreUnavailable) as unavailable:
            await store.claim("t", "k", FINGERPRINT, lease=10, ttl=60)
        assert not isinstance(unavailable.value, PoolExhausted)
        assert isinstance(unavailable.value.__cause__, TimeoutError)


async def test_a_backend_terminated_between_two_statements_is_store_unavailable(idempotency_database_url: str) -> None:
    """The claim's connection goes back to the pool; its server process is terminated; the next statement takes it.
    Depending on how far the server's goodbye has got, asyncpg raised ConnectionDoesNotExistError or, while still
    reading that FATAL error, InternalClientError ("cannot switch to state 11"), which escaped as a 500."""
    store = PostgresStore(idempotency_database_url, min_size=1, max_size=1)
    admin = await asyncpg.connect(idempotency_database_url)
    unavailable = 0
    try:
        for attempt in range(20):
            key = f"terminated-{uuid.uuid4()}"
            claim = await store.claim("t", key, FINGERPRINT, lease=30, ttl=60)
            async with store.connection() as connection:
                pid = connection.get_server_pid()
            await admin.execute("SELECT pg_terminate_backend($1)", pid)
            for _ in range(attempt):  # let the server's FATAL error in, at different points
                await asyncio.sleep(0)
            try:
                assert await store.renew("t", key, claim.fence, lease=30)
            except StoreUnavailable:
                unavailable += 1
            assert await store.complete("t", key, claim.fence, RESPONSE)  # the next statement gets a new connection
    finally:
        await admin.close()
        await store.close()
    assert unavailable > 0  # the termination was seen (otherwise this test tested nothing)


async def test_checkouts_behind_connection_attempts_to_a_silent_database_are_not_pool_exhausted(
    silent_server: str,
) -> None:
    """Every place in the pool is a connection being opened to a database that does not answer; the checkouts
    waiting behind them time out as waiters. An outside review found them told PoolExhausted ("raise max_size"):
    in a partition or a frozen server, all but the first requests pointed the operator at the pool instead of the
    database. No connection is in use, so none of them waited for the pool."""
    store = PostgresStore(silent_server, timeout=0.5, min_size=0, max_size=2)
    try:
        results = await asyncio.gather(
            *(store.claim("t", f"k{i}", FINGERPRINT, lease=30, ttl=60) for i in range(3)), return_exceptions=True
        )
    finally:
        await store.close(grace=0)
    assert all(isinstance(result, StoreUnavailable) for result in results), results
    assert [result for result in results if isinstance(result, PoolExhausted)] == []


async def wait_for_a_lock_wait(connection: asyncpg.Connection) -> None:
    """Until some session of this database waits for a row lock (the statement under test, behind ``connection``)."""
    for _ in range(250):
        waiting = await connection.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        if waiting:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the statement under test never waited for the row lock")


@contextlib.asynccontextmanager
async def store_on(url: str, pool_kind: str) -> AsyncIterator[PostgresStore]:
    """A store on its own connections, on the app's asyncpg pool, or without prepared statements (the way it runs
    behind a transaction-pooling PgBouncer)."""
    if pool_kind == "app pool":
        pool = await asyncpg.create_pool(url, min_size=1, max_size=4)
        try:
            async with PostgresStore(pool) as store:
                yield store
        finally:
            await pool.close()
    else:
        async with PostgresStore(url, min_size=1, max_size=4, prepared_statements=pool_kind == "own") as store:
            yield store


@pytest.mark.parametrize("pool_kind", ["own", "app pool", "unprepared"])
@pytest.mark.parametrize("operation", ["renew", "complete", "release", "duplicate claim"])
async def test_bookkeeping_that_waits_for_a_concurrent_update_of_its_row_lands(
    isolated_url: str, pool_kind: str, operation: str
) -> None:
    """Under REPEATABLE READ or SERIALIZABLE as the database's default, a statement that waits for a concurrent
    update of its row (here a duplicate's claim counting its attempt) fails with a serialization error once that
    commits. A renewal that failed so would let the lease lapse, a completion would leave the key in progress: the
    store's own statements behave as under READ COMMITTED whatever the default."""
    key = str(uuid.uuid4())
    other = await asyncpg.connect(isolated_url)
    try:
        async with store_on(isolated_url, pool_kind) as store:
            claim = await store.claim("t", key, FINGERPRINT, lease=30, ttl=60)
            duplicate = other.transaction(isolation="read_committed")
            await duplicate.start()
            await other.execute(
                "UPDATE idempotency_records SET attempts = attempts + 1 WHERE tenant = 't' AND key = $1", key
            )
            operations: dict[str, Callable[[], Coroutine[Any, Any, Any]]] = {
                "renew": lambda: store.renew("t", key, claim.fence, lease=30),
                "complete": lambda: store.complete("t", key, claim.fence, RESPONSE),
                "release": lambda: store.release("t", key, claim.fence),
                "duplicate claim": lambda: store.claim("t", key, FINGERPRINT, lease=30, ttl=60),
            }
            pending = asyncio.create_task(operations[operation]())
            await wait_for_a_lock_wait(other)
            await duplicate.commit()
            result = await pending
            if operation == "duplicate claim":
                assert result.outcome is ClaimOutcome.IN_PROGRESS
            else:
                assert result is True
            if operation in ("renew", "duplicate claim"):  # settled, so the close has no claim to give grace to
                await store.release("t", key, claim.fence)
    finally:
        await other.close()
