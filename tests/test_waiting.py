"""Waiting for a running original instead of answering 409 (``on_conflict="wait"``, waiting.py), on every store."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import asyncpg
import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idempotency_mw import IdempotencyMiddleware, PostgresStore, Store
from idempotency_mw.waiting import Waiters, settlement_tag
from tests.conftest import client_for


class Original:
    """A handler that holds until told, and answers with the status it is told."""

    def __init__(self, *statuses: int) -> None:
        self.runs = 0
        self.entered = asyncio.Event()
        self.go = asyncio.Event()
        self.statuses = list(statuses)  # of the runs in turn; 201 after them

    async def handle(self, request: Request) -> Response:
        self.runs += 1
        run = self.runs
        self.entered.set()
        await self.go.wait()
        return JSONResponse({"run": run}, status_code=self.statuses.pop(0) if self.statuses else 201)


def waiting_app(store: Store, original: Original, **options: Any) -> Starlette:
    app = Starlette(routes=[Route("/pay", original.handle, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, on_conflict="wait", **options)
    return app


async def started(client: httpx.AsyncClient, original: Original, key: str) -> asyncio.Task[httpx.Response]:
    """The original request, held inside its handler."""
    first = asyncio.create_task(client.post("/pay", json={"amount": 5}, headers={"Idempotency-Key": key}))
    await asyncio.wait_for(original.entered.wait(), 5)
    return first


async def test_a_duplicate_waits_and_gets_the_replay(store: Store, key: str) -> None:
    original = Original()
    client = client_for(waiting_app(store, original, wait=10))
    first = await started(client, original, key)
    duplicate = asyncio.create_task(client.post("/pay", json={"amount": 5}, headers={"Idempotency-Key": key}))
    await asyncio.sleep(0.2)
    assert not duplicate.done(), "the duplicate answered instead of waiting"
    original.go.set()
    live, replay = await first, await duplicate
    assert live.status_code == 201
    assert (replay.status_code, replay.headers["idempotent-replayed"], replay.content) == (201, "true", live.content)
    assert original.runs == 1


async def test_a_duplicate_runs_when_the_original_was_released(store: Store, key: str) -> None:
    original = Original(503)  # transient: the key is released, and the waiting duplicate runs
    client = client_for(waiting_app(store, original, wait=10))
    first = await started(client, original, key)
    duplicate = asyncio.create_task(client.post("/pay", json={"amount": 5}, headers={"Idempotency-Key": key}))
    await asyncio.sleep(0.2)
    original.go.set()
    assert (await first).status_code == 503
    retried = await duplicate
    assert (retried.status_code, retried.json(), "idempotent-replayed" in retried.headers) == (201, {"run": 2}, False)
    assert original.runs == 2


async def test_after_the_bound_a_waiting_duplicate_gets_409(store: Store, key: str) -> None:
    original = Original()
    client = client_for(waiting_app(store, original, wait=0.3))
    first = await started(client, original, key)
    began = time.monotonic()
    duplicate = await client.post("/pay", json={"amount": 5}, headers={"Idempotency-Key": key})
    waited = time.monotonic() - began
    assert duplicate.status_code == 409
    assert duplicate.json()["code"] == "idempotency_request_in_progress"
    assert 0.3 <= waited < 5
    original.go.set()
    assert (await first).status_code == 201


async def test_a_different_request_with_the_key_does_not_wait(store: Store, key: str) -> None:
    original = Original()
    client = client_for(waiting_app(store, original, wait=10))
    first = await started(client, original, key)
    other = await asyncio.wait_for(client.post("/pay", json={"amount": 6}, headers={"Idempotency-Key": key}), timeout=2)
    assert other.status_code == 422
    original.go.set()
    await first


async def test_a_waiter_in_another_process_is_woken_by_the_database(idempotency_database_url: str, key: str) -> None:
    """Two stores stand for two processes: the original runs in one, the duplicate waits in the other, and wakes
    when the database tells of the completion (LISTEN/NOTIFY), long before its bound."""
    original = Original()
    async with PostgresStore(idempotency_database_url) as here, PostgresStore(idempotency_database_url) as there:
        first = await started(client_for(waiting_app(here, original, wait=30)), original, key)
        elsewhere = client_for(waiting_app(there, Original(), wait=30))
        duplicate = asyncio.create_task(elsewhere.post("/pay", json={"amount": 5}, headers={"Idempotency-Key": key}))
        await asyncio.sleep(0.5)  # it claimed (409 inside), and waits
        assert not duplicate.done()
        released = time.monotonic()
        original.go.set()
        live = await first
        replay = await asyncio.wait_for(duplicate, 10)
        assert time.monotonic() - released < 5
        assert (replay.headers["idempotent-replayed"], replay.content) == ("true", live.content)
        assert original.runs == 1


async def test_five_hundred_waiting_duplicates_hold_no_connection(idempotency_database_url: str, key: str) -> None:
    """A storm of duplicates that wait holds no connection while it waits: with a pool of 6, 500 of them all get the
    replay, none a 503, and the server saw no more of the store's connections than its pool (and its listener)."""
    original = Original()
    name = f"imw-waiters-{uuid.uuid4().hex[:8]}"
    separator = "&" if "?" in idempotency_database_url else "?"
    dsn = f"{idempotency_database_url}{separator}application_name={name}"
    async with PostgresStore(dsn, min_size=1, max_size=6) as store:
        client = client_for(waiting_app(store, original, wait=30))
        first = await started(client, original, key)
        duplicates = [
            asyncio.create_task(client.post("/pay", json={"amount": 5}, headers={"Idempotency-Key": key}))
            for _ in range(500)
        ]
        await asyncio.sleep(1.0)
        admin = await asyncpg.connect(idempotency_database_url)
        try:
            connections = await admin.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", name
            )
        finally:
            await admin.close()
        original.go.set()
        live = await first
        answers = await asyncio.gather(*duplicates)
    assert [a.status_code for a in answers] == [201] * 500
    assert all(a.content == live.content for a in answers)
    assert original.runs == 1
    assert connections <= 6 + 1  # the store's pool, and its listener


async def test_waiters_of_one_key_share_one_event() -> None:
    waiters = Waiters()
    woken = asyncio.gather(*(waiters.wait("t", "k", 5) for _ in range(3)))
    await asyncio.sleep(0)
    assert waiters.waiting
    waiters.wake("t", "k")
    await asyncio.wait_for(woken, 1)
    assert not waiters.waiting


def test_the_settlement_tag_tells_tenants_and_keys_apart() -> None:
    assert settlement_tag("ab", "c") != settlement_tag("a", "bc")
    assert len(settlement_tag("t", "k")) == 32


async def test_the_database_computes_the_same_settlement_tag(idempotency_database_url: str) -> None:
    connection = await asyncpg.connect(idempotency_database_url)
    try:
        for tenant, key in (("t", "k"), ("tenant-é", "evt_1"), ("", "x")):
            tag = await connection.fetchval(
                "SELECT left(encode(sha256(convert_to(length($1::text)::text || ':' || $1 || $2, 'UTF8')), 'hex'), 32)",
                tenant,
                key,
            )
            assert tag == settlement_tag(tenant, key)
    finally:
        await connection.close()


async def test_a_store_closed_as_its_listener_starts_keeps_no_connection(
    idempotency_database_url: str, key: str
) -> None:
    """A wait starts the listener and the store closes before the listener has connected: the listener still ends,
    and the connection it opens goes with it, instead of listening on after the close."""
    name = f"imw-listener-{uuid.uuid4().hex[:8]}"
    separator = "&" if "?" in idempotency_database_url else "?"
    store = PostgresStore(f"{idempotency_database_url}{separator}application_name={name}", min_size=1, max_size=2)
    await store.open()
    waiting = asyncio.create_task(store.wait("t", key, 30))
    await asyncio.sleep(0)  # the wait starts the listener
    await store.close()
    waiting.cancel()
    admin = await asyncpg.connect(idempotency_database_url)
    try:
        for _ in range(50):
            left = await admin.fetchval("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", name)
            if left == 0:
                break
            await asyncio.sleep(0.1)
    finally:
        await admin.close()
    assert left == 0
