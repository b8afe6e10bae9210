"""Waiting (``on_conflict="wait"``) when something goes wrong around it: the store's LISTEN connection lost, a
cutover's earlier package still running the request, a takeover racing a transactional original's commit, an
original that wins over its taker under REPEATABLE READ."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import asyncpg
from starlette.types import Scope

from idempotency_mw import MemoryStore, PostgresStore, Store, StoredResponse
from idempotency_mw._claim import ClaimOrWait
from idempotency_mw.cutover import Earlier
from idempotency_mw.postgres._lending import PostgresTransaction
from idempotency_mw.store import ClaimOutcome
from tests.conftest import client_for, tenant_of
from tests.postgres.test_store import wait_for_lock_wait
from tests.test_waiting import Original, started, waiting_app

WAIT = 2.0  # every wait here is bounded by this


async def test_a_lost_listener_connection_wakes_its_waiters(idempotency_database_url: str, key: str) -> None:
    """The waiting process's LISTEN connection is killed (a failover, an idle-session killer) while a request waits,
    then the original completes in another process: the waiter claims again, listens again, and gets the replay
    at once, not when its wait runs out."""
    original = Original()
    async with PostgresStore(idempotency_database_url) as here, PostgresStore(idempotency_database_url) as there:
        first = await started(client_for(waiting_app(here, original, wait=WAIT)), original, key)
        elsewhere = client_for(waiting_app(there, Original(), wait=WAIT))
        duplicate = asyncio.create_task(elsewhere.post("/pay", json={"amount": 5}, headers={"Idempotency-Key": key}))
        await asyncio.sleep(0.3)  # it waits, its store listening
        assert not duplicate.done()
        admin = await asyncpg.connect(idempotency_database_url)
        try:
            killed = await admin.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE query ILIKE 'LISTEN%idempotency_mw_settled%' AND pid <> pg_backend_pid()"
            )
        finally:
            await admin.close()
        assert killed >= 1
        await asyncio.sleep(0.2)  # the waiter has claimed again and listens again
        settled = time.monotonic()
        original.go.set()
        live = await first
        replay = await asyncio.wait_for(duplicate, 5)
        took = time.monotonic() - settled
    assert live.status_code == 201
    assert (replay.status_code, replay.headers.get("idempotent-replayed")) == (201, "true")
    assert took < 1.0, f"the waiter answered {took:.2f}s after the original completed (wait={WAIT})"


async def answer_while_the_earlier_package_runs(store: Store, key: str) -> tuple[int, float, int]:
    """A waiting route in a cutover (``earlier=``) whose previous package still runs the request: the status, the
    seconds it took, and how often the previous package was asked."""
    lookups = 0

    async def earlier(scope: Scope, body: bytes, key: str) -> Earlier:
        nonlocal lookups
        lookups += 1
        return Earlier(running=True)

    app = waiting_app(store, Original(), wait=1.0, earlier=earlier)
    began = time.monotonic()
    answer = await client_for(app).post("/pay", json={"amount": 5}, headers={"Idempotency-Key": key})
    return answer.status_code, time.monotonic() - began, lookups


async def test_a_waiter_on_a_request_the_earlier_package_runs_answers_409_at_once(
    idempotency_database_url: str, key: str
) -> None:
    """Nothing tells this store when the previous package's run ends, and the claim it released names no claim to
    watch: the waiter answers 409 at once (the client retries after Retry-After), instead of claiming, asking and
    releasing again and again until its wait runs out (tens of thousands of times a second on MemoryStore)."""
    async with PostgresStore(idempotency_database_url) as postgres:
        for store in (MemoryStore(), postgres):
            status, took, lookups = await asyncio.wait_for(answer_while_the_earlier_package_runs(store, key), 5)
            assert (status, lookups) == (409, 1), f"{type(store).__name__}: {lookups} lookups in {took:.2f}s"
            assert took < 0.5


@contextlib.asynccontextmanager
async def row_held(url: str, tenant: str, key: str) -> AsyncIterator[asyncpg.Connection]:
    """The record row locked as a renewal or a duplicate's count locks it (FOR NO KEY UPDATE), until the block ends:
    a claim that waits for the row then acts on a snapshot taken before it waited."""
    admin = await asyncpg.connect(url)
    try:
        async with admin.transaction():
            await admin.execute(
                "SELECT FROM idempotency_records WHERE tenant = $1 AND key = $2 FOR NO KEY UPDATE", tenant, key
            )
            yield admin
    finally:
        await admin.close()


async def test_a_takeover_of_a_lapsed_lease_replays_a_transactional_completion_that_commits_meanwhile(
    idempotency_database_url: str, key: str
) -> None:
    """A transactional original whose lease lapsed commits its effect and response while a duplicate's takeover has
    its snapshot and waits for the row: the duplicate gets the replay, and does not run the request again."""
    response = StoredResponse(201, [], b'{"run":1}', 9)
    async with PostgresStore(idempotency_database_url) as a, PostgresStore(idempotency_database_url) as b:
        async with a.transaction() as original:
            owned = await original.claim("t", key, b"f" * 40, lease=0.5, ttl=60)
            assert owned.outcome is ClaimOutcome.OWNED
            await original.begin()
            assert await original.complete("t", key, owned.fence, response)
            await asyncio.sleep(0.7)  # its lease lapses while it finishes (a slow commit, a pause)
            async with row_held(idempotency_database_url, "t", key) as admin:
                duplicate = asyncio.create_task(b.claim("t", key, b"f" * 40, lease=30, ttl=60))
                await wait_for_lock_wait(admin)
                await original.commit()
        claim = await asyncio.wait_for(duplicate, 5)
        record = await a.inspect("t", key)
    assert record is not None
    assert (record.state, record.fence) == ("completed", owned.fence)
    assert (claim.outcome, claim.response) == (ClaimOutcome.COMPLETED, response)


async def test_a_waiter_replays_a_transactional_original_that_commits_as_its_lease_is_taken_over(
    idempotency_database_url: str, key: str
) -> None:
    """As above, through the middleware (transactional, on_conflict="wait"): the duplicate answers the original's
    response, and its handler never runs."""
    async with PostgresStore(idempotency_database_url) as a, PostgresStore(idempotency_database_url) as b:
        second = Original()
        second.go.set()
        client = client_for(waiting_app(b, second, wait=WAIT, transactional=True))
        probe = await client.post("/pay", json={"amount": 5}, headers={"Idempotency-Key": f"{key}-probe"})
        assert probe.status_code == 201
        found = await b.inspect(tenant_of(), f"{key}-probe")  # the tenant and fingerprint the middleware writes
        assert found is not None
        tenant, fingerprint, runs = found.tenant, found.fingerprint, second.runs
        response = StoredResponse(201, [], b'{"run":"original"}', 18)
        async with a.transaction() as original:
            owned = await original.claim(tenant, key, fingerprint, lease=0.5, ttl=60)
            assert owned.outcome is ClaimOutcome.OWNED
            await original.begin()
            assert await original.complete(tenant, key, owned.fence, response)
            await asyncio.sleep(0.7)
            async with row_held(idempotency_database_url, tenant, key) as admin:
                duplicate = asyncio.create_task(
                    client.post("/pay", json={"amount": 5}, headers={"Idempotency-Key": key})
                )
                await wait_for_lock_wait(admin)
                await original.commit()
        answer = await asyncio.wait_for(duplicate, 5)
    assert second.runs == runs, "the duplicate ran the handler although the original had committed"
    assert (answer.status_code, answer.content) == (201, response.body)


async def test_a_waiter_that_followed_a_takeover_hears_the_original_win_it(
    isolation_urls: dict[str, str], key: str
) -> None:
    """REPEATABLE READ: a transactional original (A) stalls past its lease, C takes the key over and the waiter (B)
    follows C's claim; A's snapshot predates the takeover, so A's completion commits first and wins, and C's is
    refused and released. The waiter is told (A's notice names the record's current fence, and C's refused release
    notifies too), and replays A's response at once instead of sleeping out its wait."""
    url = isolation_urls["repeatable read"]
    response = StoredResponse(201, [], b'{"run":"A"}', 11)
    async with PostgresStore(url) as a, PostgresStore(url) as b, PostgresStore(url) as c:
        async with a.transaction() as original:
            assert isinstance(original, PostgresTransaction)
            owned = await original.claim("t", key, b"f" * 40, lease=0.5, ttl=60)
            assert owned.outcome is ClaimOutcome.OWNED
            await original.begin()
            await original.connection.execute("SELECT 1")  # the handler's first statement: its snapshot
            waiter = asyncio.create_task(
                ClaimOrWait(lambda: b.claim("t", key, b"f" * 40, lease=30, ttl=60), b.watch, WAIT).run()
            )
            await asyncio.sleep(0.7)  # A's lease lapses
            async with c.transaction() as taker:
                assert isinstance(taker, PostgresTransaction)
                taken = await taker.claim("t", key, b"f" * 40, lease=30, ttl=60)
                assert taken.outcome is ClaimOutcome.OWNED
                assert taken.fence != owned.fence
                await taker.begin()
                await taker.connection.execute("SELECT 1")
                await asyncio.sleep(0.1)  # the waiter follows the takeover
                assert await original.complete("t", key, owned.fence, response)
                await original.commit()  # A's effect and response commit first
                settled = time.monotonic()
                with contextlib.suppress(asyncpg.SerializationError):
                    assert not await taker.complete("t", key, taken.fence, StoredResponse(201, [], b"{}", 2))
                await taker.rollback()
            assert not await c.release("t", key, taken.fence)  # what the middleware does after a refused completion
        claim = await asyncio.wait_for(waiter, 5)
        took = time.monotonic() - settled
    assert (claim.outcome, claim.response) == (ClaimOutcome.COMPLETED, response)
    assert took < 1.0, f"the waiter replayed {took:.2f}s after the key completed (wait={WAIT})"
