"""Waiting (``on_conflict="wait"``) when something goes wrong around it: the store's LISTEN connection lost, a
cutover's earlier package still running the request, a takeover racing a transactional original's commit."""

from __future__ import annotations

import asyncio
import time

import asyncpg
from starlette.types import Scope

from idempotency_mw import MemoryStore, PostgresStore, Store
from idempotency_mw.cutover import Earlier
from tests.conftest import client_for
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
