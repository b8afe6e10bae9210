"""Switching from another package (docs/migrating.md), with the real package serving first: fastapi-idempotency on
its Tortoise store in PostgreSQL, then this middleware on the same database with
``earlier=fastapi_idempotency(pool)``; asgi-idempotency-header on Redis, drained, then this middleware with
``earlier=asgi_idempotency_header(redis)``. No key that the old package completed, or was still running, runs
again."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import asyncpg
import fakeredis
import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi_idempotency import IdempotencyMiddleware as OldMiddleware
from fastapi_idempotency.stores.tortoise import TortoiseStore
from idempotency_header_middleware import IdempotencyHeaderMiddleware
from idempotency_header_middleware.backends import RedisBackend
from starlette.types import Scope
from tortoise import Tortoise

from idempotency_mw import IdempotencyMiddleware, PostgresStore
from idempotency_mw.cutover import asgi_idempotency_header, fastapi_idempotency
from idempotency_mw.testing import run_lifespan
from tests.conftest import opened, tenant_of
from tests.test_docs import recipe

TOKEN = "Bearer sk_live_migrating"


def tortoise_config(url: str) -> dict[str, Any]:
    """The suite's database in Tortoise's terms (its URLs take no Unix socket)."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    return {
        "connections": {
            "default": {
                "engine": "tortoise.backends.asyncpg",
                "credentials": {
                    "host": parts.hostname or query["host"][0],
                    "port": parts.port or int(query.get("port", ["5432"])[0]),
                    "user": parts.username or "postgres",
                    "password": parts.password or "",
                    "database": parts.path.lstrip("/"),
                },
            }
        },
        "apps": {"models": {"models": ["fastapi_idempotency.stores.tortoise"], "default_connection": "default"}},
    }


def the_callers_credential(request: Request) -> str:
    """The ``scope`` function the old app gave fastapi-idempotency: each caller's keys apart."""
    return request.headers.get("authorization", "")


def the_same_on_the_asgi_scope(scope: Scope) -> str:
    """The same function, written on the ASGI scope, for the lookup."""
    return next((value.decode("latin-1") for name, value in scope["headers"] if name == b"authorization"), "")


class Charges:
    """The payments handler both apps run: one row per run, so a second run of a key shows."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self.hold = asyncio.Event()
        self.holding = asyncio.Event()  # a slow charge is running (its row written)
        self.fail = True  # a charge of a "boom" amount raises (until a test says otherwise)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/charges", status_code=201)
        async def charge(request: Request) -> dict[str, Any]:
            key = request.headers["idempotency-key"]
            await self.pool.execute("INSERT INTO cutover_effects (key) VALUES ($1)", key)
            if key.startswith("slow"):
                self.holding.set()
                await self.hold.wait()
            amount = (await request.json())["amount"]
            if amount == "boom" and self.fail:
                raise RuntimeError("the charge failed")
            return {"id": f"ch_{uuid.uuid4().hex[:12]}", "amount": amount}

        return app


@pytest.fixture
async def database(migrated_url: str) -> AsyncIterator[tuple[str, asyncpg.Pool]]:
    await Tortoise.init(config=tortoise_config(migrated_url))
    await Tortoise.generate_schemas()
    pool = await asyncpg.create_pool(migrated_url, min_size=1, max_size=5)
    await pool.execute("CREATE TABLE cutover_effects (key text NOT NULL)")
    try:
        yield migrated_url, pool
    finally:
        await pool.close()
        await Tortoise.close_connections()


def client(app: Any) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app)
    return httpx.AsyncClient(transport=transport, base_url="http://test", headers={"Authorization": TOKEN})


async def test_no_key_the_old_package_completed_or_ran_runs_again(database: tuple[str, asyncpg.Pool]) -> None:
    url, pool = database
    charges = Charges(pool)
    old_app = charges.app()
    old_app.add_middleware(OldMiddleware, store=TortoiseStore(), scope=the_callers_credential)
    new_app = charges.app()
    lookup = fastapi_idempotency(pool, scope=the_same_on_the_asgi_scope)
    async with opened(PostgresStore(url)) as store:
        new_app.add_middleware(IdempotencyMiddleware, store=store, earlier=lookup)
        async with client(old_app) as old, client(new_app) as new:
            # Before the switch: one charge completed, one still running under the old package.
            done = await old.post("/v1/charges", json={"amount": 500}, headers={"Idempotency-Key": "order-1"})
            assert done.status_code == 201
            running = asyncio.create_task(
                old.post("/v1/charges", json={"amount": 700}, headers={"Idempotency-Key": "slow-1"})
            )
            await charges.holding.wait()
            # After it: retries reach the new middleware.
            replayed = await new.post("/v1/charges", json={"amount": 500}, headers={"Idempotency-Key": "order-1"})
            assert (replayed.status_code, replayed.content) == (201, done.content)
            assert replayed.headers["idempotent-replayed"] == "true"
            other = await new.post("/v1/charges", json={"amount": 999}, headers={"Idempotency-Key": "order-1"})
            assert other.status_code == 422  # a different request with that key, as the old package said too
            in_flight = await new.post("/v1/charges", json={"amount": 700}, headers={"Idempotency-Key": "slow-1"})
            assert in_flight.status_code == 409
            assert in_flight.json()["code"] == "idempotency_request_in_progress"
            charges.hold.set()
            finished = await running
            settled = await new.post("/v1/charges", json={"amount": 700}, headers={"Idempotency-Key": "slow-1"})
            assert (settled.status_code, settled.content) == (201, finished.content)
            fresh = await new.post("/v1/charges", json={"amount": 100}, headers={"Idempotency-Key": "order-2"})
            assert fresh.status_code == 201
            assert "idempotent-replayed" not in fresh.headers
        # The old package's response is this store's record now: later retries no longer need the lookup.
        record = await store.inspect(tenant_of("sk_live_migrating"), "order-1")
        assert record is not None
        assert record.response is not None
        assert json.loads(record.response.body or b"") == json.loads(done.content)
    runs = Counter(row["key"] for row in await pool.fetch("SELECT key FROM cutover_effects"))
    assert runs == {"order-1": 1, "slow-1": 1, "order-2": 1}


async def test_the_documented_switch_builds_and_serves(
    database: tuple[str, asyncpg.Pool], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/migrating.md's app, as written, on a database that holds the old package's table."""
    url, _ = database
    with recipe("switching", tmp_path, monkeypatch, DATABASE_URL=url) as module:

        async def charge() -> dict[str, str]:
            return {"id": f"ch_{uuid.uuid4().hex[:12]}"}

        module.app.add_api_route("/v1/charges", charge, methods=["POST"], status_code=201)

        async with run_lifespan(module.app), client(module.app) as http:
            first = await http.post("/v1/charges", json={}, headers={"Idempotency-Key": "switch-1"})
            again = await http.post("/v1/charges", json={}, headers={"Idempotency-Key": "switch-1"})
    assert first.status_code == 201
    assert (again.content, again.headers["idempotent-replayed"]) == (first.content, "true")


async def test_no_key_asgi_idempotency_header_completed_runs_again_after_a_drain(
    database: tuple[str, asyncpg.Pool],
) -> None:
    url, pool = database
    redis = fakeredis.FakeAsyncRedis()
    charges = Charges(pool)
    old_app = charges.app()
    old_app.add_middleware(IdempotencyHeaderMiddleware, backend=RedisBackend(redis))  # type: ignore[arg-type]
    async with client(old_app) as old:
        done = await old.post("/v1/charges", json={"amount": 500}, headers={"Idempotency-Key": "order-1"})
        assert done.status_code == 201
        with pytest.raises(RuntimeError):  # a request that failed under it: its key stays pending there for ever
            await old.post("/v1/charges", json={"amount": "boom"}, headers={"Idempotency-Key": "order-2"})
    # The drain is over: nothing runs under the old package any more.
    async with opened(PostgresStore(url)) as store:
        new_app = charges.app()
        new_app.add_middleware(IdempotencyMiddleware, store=store, earlier=asgi_idempotency_header(redis))
        async with client(new_app) as new:
            replayed = await new.post("/v1/charges", json={"amount": 500}, headers={"Idempotency-Key": "order-1"})
            assert (replayed.status_code, replayed.content) == (201, done.content)
            assert replayed.headers["idempotent-replayed"] == "true"
            charges.fail = False
            retried = await new.post("/v1/charges", json={"amount": 700}, headers={"Idempotency-Key": "order-2"})
            assert retried.status_code == 201  # failed under the old package, never completed: it runs
            assert "idempotent-replayed" not in retried.headers
    runs = Counter(row["key"] for row in await pool.fetch("SELECT key FROM cutover_effects"))
    assert runs == {"order-1": 1, "order-2": 2}  # order-2: the failed run under the old package, and this one
