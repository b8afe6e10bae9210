"""The SQLAlchemy ledger example (examples.sqlalchemy_ledger): transfers written through IdempotencySession move
money once, whatever the retries."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI

from examples.sqlalchemy_ledger.app import create_app
from examples.sqlalchemy_ledger.models import SCHEMA


@pytest.fixture
async def app(idempotency_database_url: str) -> AsyncIterator[FastAPI]:
    app = create_app(idempotency_database_url, pool_size=8)
    async with app.router.lifespan_context(app):
        yield app


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    headers = {"Authorization": f"Bearer {uuid.uuid4().hex}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://ledger.test", headers=headers) as client:
        yield client


async def post(client: httpx.AsyncClient, path: str, body: dict[str, Any], key: str | None = None) -> httpx.Response:
    return await client.post(path, json=body, headers={"Idempotency-Key": key or str(uuid.uuid4())})


async def account(client: httpx.AsyncClient, balance: int) -> int:
    response = await post(client, "/accounts", {"owner": "someone", "opening_balance": balance})
    assert response.status_code == 201
    return int(response.json()["id"])


async def balance(client: httpx.AsyncClient, account_id: int) -> int:
    return int((await client.get(f"/accounts/{account_id}")).json()["balance"])


async def transfers_of(db: asyncpg.Connection, source: int) -> int:
    return int(await db.fetchval(f"SELECT count(*) FROM {SCHEMA}.transfers WHERE source_id = $1", source))


async def test_a_retried_transfer_moves_money_once(client: httpx.AsyncClient, db: asyncpg.Connection) -> None:
    source, target = await account(client, 1000), await account(client, 0)
    key = str(uuid.uuid4())
    body = {"source": source, "target": target, "amount": 300, "memo": "rent"}
    first = await post(client, "/transfers", body, key)
    assert first.status_code == 201
    again = await post(client, "/transfers", body, key)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert (await balance(client, source), await balance(client, target)) == (700, 300)
    assert await transfers_of(db, source) == 1
    fetched = await client.get(f"/transfers/{first.json()['id']}")
    assert fetched.json() == first.json()


async def test_concurrent_copies_of_a_transfer_move_money_once(
    client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    source, target = await account(client, 1000), await account(client, 0)
    key = str(uuid.uuid4())
    body = {"source": source, "target": target, "amount": 100}
    answers = await asyncio.gather(*(post(client, "/transfers", body, key) for _ in range(5)))
    executed = [r for r in answers if r.status_code == 201 and "idempotent-replayed" not in r.headers]
    assert len(executed) == 1
    assert all(r.status_code == 409 or r.content == executed[0].content for r in answers)
    assert (await balance(client, source), await balance(client, target)) == (900, 100)
    assert await transfers_of(db, source) == 1


async def test_insufficient_funds_is_a_recorded_answer(client: httpx.AsyncClient, db: asyncpg.Connection) -> None:
    """The refusal is the outcome of this request: its retry is told the same, even after money arrived."""
    source, target = await account(client, 50), await account(client, 0)
    key = str(uuid.uuid4())
    body = {"source": source, "target": target, "amount": 80}
    refused = await post(client, "/transfers", body, key)
    assert (refused.status_code, refused.json()) == (422, {"detail": "insufficient funds"})
    donor = await account(client, 100)
    arrived = await post(client, "/transfers", {"source": donor, "target": source, "amount": 100})
    assert arrived.status_code == 201
    again = await post(client, "/transfers", body, key)
    assert again.headers["idempotent-replayed"] == "true"
    assert await transfers_of(db, source) == 0
    assert await balance(client, source) == 150


async def test_a_transfer_to_an_unknown_account_frees_its_key(
    client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    source = await account(client, 500)
    key = str(uuid.uuid4())
    missing = await post(client, "/transfers", {"source": source, "target": 2**62, "amount": 10}, key)
    assert missing.status_code == 404
    target = await account(client, 0)
    retry = await post(client, "/transfers", {"source": source, "target": target, "amount": 10}, key)
    assert retry.status_code == 201
    assert await transfers_of(db, source) == 1


async def test_invalid_transfers_free_the_key_and_move_nothing(
    client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    source = await account(client, 500)
    key = str(uuid.uuid4())
    invalid = await post(client, "/transfers", {"source": source, "target": source, "amount": 10}, key)
    assert invalid.status_code == 422
    assert "different accounts" in invalid.text
    target = await account(client, 0)
    retry = await post(client, "/transfers", {"source": source, "target": target, "amount": 10}, key)
    assert retry.status_code == 201


async def test_writes_need_a_key_and_openapi_says_so(client: httpx.AsyncClient) -> None:
    response = await client.post("/transfers", json={"source": 1, "target": 2, "amount": 1})
    assert response.status_code == 400
    assert response.json()["code"] == "idempotency_key_missing"
    schema = (await client.get("/openapi.json")).json()
    parameters = schema["paths"]["/transfers"]["post"]["parameters"]
    assert any(p["name"] == "Idempotency-Key" and p["required"] for p in parameters)
