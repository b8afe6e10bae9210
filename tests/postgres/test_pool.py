"""The store's own connection pool (connections.py): order, deadlines, hand-overs and broken connections."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator

import asyncpg
import pytest

from idempotency_mw import PostgresStore
from idempotency_mw.postgres._pool import ConnectionPool, OwnPool, PoolClosed
from idempotency_mw.store import PoolExhausted, StoreUnavailable


@pytest.fixture
async def pool(idempotency_database_url: str) -> AsyncIterator[ConnectionPool]:
    created = ConnectionPool(idempotency_database_url, min_size=0, max_size=1, timeout=2.0)
    yield created
    await created.close()


async def test_connections_are_reused_and_bounded(idempotency_database_url: str) -> None:
    pool = ConnectionPool(idempotency_database_url, min_size=2, max_size=3, timeout=2.0)
    await pool.open()
    assert (pool.size, pool.idle) == (2, 2)
    held = [await pool.acquire(), await pool.acquire(), await pool.acquire(urgent=True)]
    assert pool.size == 3
    assert len({connection.get_server_pid() for connection in held}) == 3
    for connection in held:
        pool.release(connection)
    again = await pool.acquire()
    assert await again.fetchval("SELECT 1") == 1
    pool.release(again)
    assert (pool.size, pool.idle) == (3, 3)
    await pool.close()
    assert (pool.size, pool.idle) == (0, 0)


async def test_the_last_connection_is_kept_for_work_that_finishes_requests(idempotency_database_url: str) -> None:
    """New claims and transactional handlers can take every connection but one; a lease renewal, a completion or a
    release always finds that one (after other urgent work only)."""
    pool = ConnectionPool(idempotency_database_url, min_size=0, max_size=3, timeout=0.3)
    handlers = [await pool.acquire(), await pool.acquire()]
    with pytest.raises(PoolExhausted):
        await pool.acquire()  # a third request waits although a connection could still be opened
    renewal = await pool.acquire(urgent=True)
    assert pool.size == 3
    pool.release(renewal)
    assert pool.idle == 1  # kept for urgent work, not handed to a request
    pool.release(handlers.pop())
    claim = await pool.acquire()  # a request got its place back
    for connection in (claim, *handlers):
        pool.release(connection)
    await pool.close()


async def test_urgent_waiters_go_first(pool: ConnectionPool) -> None:
    held = await pool.acquire()  # max_size 1: nothing is reserved, so urgent work waits like the rest
    served: list[str] = []

    async def wait(name: str, urgent: bool) -> None:
        connection = await pool.acquire(urgent=urgent)
        served.append(name)
        await asyncio.sleep(0)
        pool.release(connection)

    tasks = []
    for name, urgent in (("claim 1", False), ("claim 2", False), ("renewal", True), ("release", True)):
        tasks.append(asyncio.create_task(wait(name, urgent)))
        await asyncio.sleep(0)
    pool.release(held)
    await asyncio.gather(*tasks)
    assert served == ["renewal", "release", "claim 1", "claim 2"]


async def test_waiters_are_served_in_arrival_order(pool: ConnectionPool) -> None:
    held = await pool.acquire()
    served: list[int] = []

    async def wait(number: int) -> None:
        connection = await pool.acquire()
        served.append(number)
        await asyncio.sleep(0)
        pool.release(connection)

    waiters = []
    for number in range(5):
        waiters.append(asyncio.create_task(wait(number)))
        await asyncio.sleep(0)  # each one queues before the next starts
    pool.release(held)
    await asyncio.gather(*waiters)
    assert served == [0, 1, 2, 3, 4]


async def test_a_checkout_waits_no_longer_than_the_timeout(idempotency_database_url: str) -> None:
    pool = ConnectionPool(idempotency_database_url, min_size=0, max_size=1, timeout=0.2)
    held = await pool.acquire()
    with pytest.raises(PoolExhausted):
        await pool.acquire()
    pool.release(held)
    assert pool.idle == 1  # the waiter that gave up left nothing behind
    pool.release(await pool.acquire())
    await pool.close()


async def test_a_connection_handed_to_a_waiter_that_just_gave_up_is_not_lost(pool: ConnectionPool) -> None:
    held = await pool.acquire()
    waiter = asyncio.create_task(pool.acquire())
    await asyncio.sleep(0)  # the waiter is queued
    pool.release(held)  # handed over to the waiter...
    waiter.cancel()  # ...which is cancelled before it could run
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert (pool.size, pool.idle) == (1, 1)
    connection = await pool.acquire()
    assert connection is held
    pool.release(connection)


async def test_a_broken_connection_is_closed_and_its_place_goes_to_a_waiter(pool: ConnectionPool) -> None:
    broken = await pool.acquire()
    waiter = asyncio.create_task(pool.acquire())
    await asyncio.sleep(0)
    pool.release(broken, broken=True)
    fresh = await asyncio.wait_for(waiter, 2)
    assert broken.is_closed()
    assert fresh is not broken
    assert await fresh.fetchval("SELECT 1") == 1
    assert pool.size == 1
    pool.release(fresh)


async def test_an_idle_connection_the_server_closed_is_replaced(
    pool: ConnectionPool, idempotency_database_url: str
) -> None:
    connection = await pool.acquire()
    pid = connection.get_server_pid()
    pool.release(connection)
    admin = await asyncpg.connect(idempotency_database_url)
    try:
        await admin.execute("SELECT pg_terminate_backend($1)", pid)
    finally:
        await admin.close()
    for _ in range(100):  # the event loop notices the closed socket
        if connection.is_closed():
            break
        await asyncio.sleep(0.01)
    replacement = await pool.acquire()
    assert replacement.get_server_pid() != pid
    assert await replacement.fetchval("SELECT 1") == 1
    assert pool.size == 1
    pool.release(replacement)


async def test_closing_fails_the_waiters_and_later_checkouts(pool: ConnectionPool) -> None:
    held = await pool.acquire()
    waiter = asyncio.create_task(pool.acquire())
    await asyncio.sleep(0)
    await pool.close()
    with pytest.raises(PoolClosed):
        await waiter
    with pytest.raises(PoolClosed):
        await pool.acquire()
    pool.release(held)  # comes back after the close: closed, not kept
    assert held.is_closed()
    assert pool.size == 0


async def test_a_database_that_cannot_be_reached_fails_the_checkout() -> None:
    pool = ConnectionPool("postgresql://nobody@127.0.0.1:1/none", min_size=0, max_size=2, timeout=1.0)
    for _ in range(2):
        with pytest.raises(ConnectionRefusedError):
            await pool.acquire()
    assert pool.size == 0  # failed attempts hold no place
    await pool.close()


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A DSN whose server accepts connections (the kernel does) and never says a word: connecting times out."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        yield f"postgresql://nobody@127.0.0.1:{silent.getsockname()[1]}/none"


async def test_a_busy_pool_and_a_database_that_does_not_answer_fail_differently(
    idempotency_database_url: str, silent_server: str
) -> None:
    """Waiting out the timeout for a busy pool says "raise max_size"; connecting for that long stays a timeout."""
    busy = ConnectionPool(idempotency_database_url, min_size=0, max_size=1, timeout=0.2)
    held = await busy.acquire()
    with pytest.raises(PoolExhausted) as exhausted:
        await busy.acquire(urgent=True)
    assert (exhausted.value.max_size, exhausted.value.timeout) == (1, 0.2)
    assert str(exhausted.value) == (
        "the idempotency store's connection pool is exhausted: no connection came free within 0.2s (max_size=1). "
        "If the database answers promptly, the pool is too small for the load: raise max_size"
    )
    busy.release(held)
    await busy.close()

    silent = ConnectionPool(silent_server, min_size=0, max_size=1, timeout=0.2)
    with pytest.raises(TimeoutError) as timed_out:
        await silent.acquire()
    assert not isinstance(timed_out.value, PoolExhausted)
    assert silent.size == 0
    await silent.close()


async def test_a_store_with_every_connection_busy_raises_pool_exhausted(
    idempotency_database_url: str, silent_server: str
) -> None:
    store = PostgresStore(idempotency_database_url, min_size=0, max_size=2, timeout=0.2)
    async with store.connection():  # one handler holds the only connection new requests may use
        with pytest.raises(PoolExhausted, match=r"within 0\.2s \(max_size=2\).*raise max_size") as exhausted:
            await store.claim("t", "k", b"f", lease=10, ttl=60)
    assert isinstance(exhausted.value, StoreUnavailable)  # the middleware still answers 503
    assert exhausted.value.pool == "the idempotency store's connection pool"
    await store.close()

    unreachable = PostgresStore(silent_server, min_size=0, max_size=2, timeout=0.2)
    with pytest.raises(StoreUnavailable) as unavailable:
        await unreachable.claim("t", "k", b"f", lease=10, ttl=60)
    assert not isinstance(unavailable.value, PoolExhausted)
    assert isinstance(unavailable.value.__cause__, TimeoutError)
    await unreachable.close()


def test_sizes_are_checked() -> None:
    with pytest.raises(ValueError, match="pool sizes"):
        ConnectionPool("postgresql://x/y", min_size=3, max_size=2, timeout=1.0)


async def test_a_closed_store_refuses_calls_and_closes_connections_that_come_back(
    idempotency_database_url: str,
) -> None:
    store = PostgresStore(idempotency_database_url, min_size=1, max_size=2)
    await store.open()
    async with store.connection() as connection:
        await store.close()
        assert await connection.fetchval("SELECT 1") == 1  # a request still using it finishes its work
        backend = connection.get_server_pid()
    admin = await asyncpg.connect(idempotency_database_url)
    try:
        for _ in range(100):  # closed as it came back: its server process ends
            if not await admin.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = $1", backend):
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the connection that came back to a closed store was not closed")
    finally:
        await admin.close()
    with pytest.raises(StoreUnavailable):
        await store.inspect("t", "k")


async def test_connections_being_opened_count_against_the_share_of_other_work(idempotency_database_url: str) -> None:
    """A cold burst opens connections concurrently; the ones still connecting count, so the reserve survives."""
    pool = ConnectionPool(idempotency_database_url, min_size=0, max_size=3, timeout=0.3)
    results = await asyncio.gather(*(pool.acquire() for _ in range(3)), return_exceptions=True)
    held = [r for r in results if isinstance(r, asyncpg.Connection)]
    assert len(held) == 2
    assert sum(isinstance(r, PoolExhausted) for r in results) == 1
    renewal = await pool.acquire(urgent=True)  # the reserved one is still there
    for connection in (renewal, *held):
        pool.release(connection)
    await pool.close()


async def test_a_lent_connection_goes_back_even_when_its_reset_is_cancelled(idempotency_database_url: str) -> None:
    store = PostgresStore(idempotency_database_url, min_size=0, max_size=2, timeout=1)
    connector = store._connector
    assert isinstance(connector, OwnPool)
    pool = connector.pool

    async def handler() -> None:
        async with store.connection():
            await asyncio.sleep(10)

    task = asyncio.create_task(handler())
    await asyncio.sleep(0.1)
    task.cancel()  # the handler is cancelled...
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    task.cancel()  # ...and cancelled again while the connection is being reset
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (pool.size, pool.idle) == (0, 0)  # closed, not leaked
    async with store.connection() as connection:  # and its place is free again
        assert await connection.fetchval("SELECT 1") == 1
    await store.close()


async def test_forget_on_a_lost_connection_is_store_unavailable(pg_store: PostgresStore) -> None:
    async with pg_store.connection() as connection:
        pid = connection.get_server_pid()
        async with pg_store.connection() as killer:
            await killer.execute("SELECT pg_terminate_backend($1)", pid)
        for _ in range(100):
            if connection.is_closed():
                break
            await asyncio.sleep(0.01)
        with pytest.raises(StoreUnavailable):
            await pg_store.forget("t", "k", connection=connection)


async def test_a_connection_opened_as_the_deadline_passes_is_closed_not_leaked(idempotency_database_url: str) -> None:
    """The checkout's deadline can pass just as the connection is made: whatever the pool did with it so far (here its
    set-up, held past the deadline), the server connection is closed, not left open with nobody to close it."""
    name = "imw-deadline-leak"

    async def slow_setup(connection: asyncpg.Connection) -> None:
        await connection.execute(f"SET application_name = '{name}'")
        await asyncio.sleep(0.5)  # the checkout's deadline passes here

    pool = ConnectionPool(idempotency_database_url, min_size=0, max_size=1, timeout=0.2, setup=slow_setup)
    admin = await asyncpg.connect(idempotency_database_url)
    try:
        with pytest.raises(TimeoutError):
            await pool.acquire()
        for _ in range(100):
            if not await admin.fetchval("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", name):
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the connection opened past the deadline is still open")
        assert pool.size == 0
    finally:
        await admin.close()
        await pool.close()
