"""idempotency_mw.fastapi: the transaction dependency, validation errors that free the key, and OpenAPI."""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg
from fastapi import APIRouter, FastAPI
from pydantic import BaseModel

from idempotency_mw import IdempotencyMiddleware, PostgresStore, idempotent
from idempotency_mw.fastapi import Idempotency, IdempotencyConnection, setup
from idempotency_mw.wire import ProblemCode
from tests.conftest import client_for


class Charge(BaseModel):
    amount: int


def build(store: Any, calls: list[int], **options: Any) -> FastAPI:
    app = FastAPI()
    router = APIRouter(prefix="/v1")

    @router.post("/charges", status_code=201)
    async def charge(body: Charge, info: Idempotency) -> dict[str, Any]:
        calls.append(body.amount)
        return {"amount": body.amount, "key": info.key}

    @router.post("/refunds", status_code=201)
    @idempotent(required=True, transactional=True)
    async def refund(body: Charge, db: IdempotencyConnection) -> dict[str, Any]:
        await db.execute("CREATE TABLE IF NOT EXISTS fastapi_refunds (amount int)")
        await db.execute("INSERT INTO fastapi_refunds VALUES ($1)", body.amount)
        calls.append(body.amount)
        return {"refunded": body.amount}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"ok": "yes"}

    app.include_router(router)
    app.add_middleware(IdempotencyMiddleware, store=store, **options)
    setup(app)
    return app


async def test_validation_error_releases_the_key_so_a_corrected_retry_runs(pg_store: PostgresStore) -> None:
    calls: list[int] = []
    client = client_for(build(pg_store, calls))
    key = str(uuid.uuid4())
    bad = await client.post("/v1/charges", json={"amount": "lots"}, headers={"Idempotency-Key": key})
    assert bad.status_code == 422
    assert "detail" in bad.json()  # FastAPI's own error, not ours
    # The corrected request is a different payload, yet not a 422 reuse: nothing ran the first time.
    good = await client.post("/v1/charges", json={"amount": 5}, headers={"Idempotency-Key": key})
    assert good.status_code == 201
    assert good.json() == {"amount": 5, "key": key}
    again = await client.post("/v1/charges", json={"amount": 5}, headers={"Idempotency-Key": key})
    assert again.headers["idempotent-replayed"] == "true"
    assert calls == [5]


async def test_transaction_dependency(pg_store: PostgresStore, idempotency_database_url: str) -> None:
    calls: list[int] = []
    client = client_for(build(pg_store, calls))
    key = str(uuid.uuid4())
    amount = int(uuid.uuid4().int % 1_000_000) + 1000
    for _ in range(2):
        response = await client.post("/v1/refunds", json={"amount": amount}, headers={"Idempotency-Key": key})
        assert response.status_code == 201
    assert calls == [amount]
    connection = await asyncpg.connect(idempotency_database_url)
    try:
        assert await connection.fetchval("SELECT count(*) FROM fastapi_refunds WHERE amount = $1", amount) == 1
    finally:
        await connection.close()
    assert (await client.post("/v1/refunds", json={"amount": 1})).status_code == 400  # required


async def test_openapi_documents_covered_operations(pg_store: PostgresStore) -> None:
    schema = (await client_for(build(pg_store, [])).get("/openapi.json")).json()
    charge = schema["paths"]["/v1/charges"]["post"]
    refund = schema["paths"]["/v1/refunds"]["post"]
    (charge_key,) = [p for p in charge["parameters"] if p["name"] == "Idempotency-Key"]
    (refund_key,) = [p for p in refund["parameters"] if p["name"] == "Idempotency-Key"]
    assert charge_key["in"] == "header"
    assert charge_key["required"] is False
    assert refund_key["required"] is True
    assert charge_key["schema"]["maxLength"] == 255
    for status in ("400", "409", "413", "422", "503"):
        assert "application/problem+json" in charge["responses"][status]["content"]
    assert "Idempotent-Replayed" in charge["responses"]["201"]["headers"]
    assert "IdempotencyProblem" in schema["components"]["schemas"]
    # Every code the middleware may answer is named under its status, and enumerated in the schema.
    described = {status: charge["responses"][status]["description"] for status in charge["responses"]}
    assert "idempotency_key_invalid" in described["400"]
    assert "idempotency_tenant_unknown" in described["400"]
    assert "idempotency_key_missing" not in described["400"]  # not required on this route
    assert "idempotency_key_missing" in refund["responses"]["400"]["description"]
    assert "idempotency_request_in_progress" in described["409"]
    assert "idempotency_response_not_replayable" in described["409"]
    assert described["422"].startswith("Validation Error; or")  # FastAPI's own 422 is kept, and ours added
    assert "idempotency_key_reused" in described["422"]
    assert "application/json" in charge["responses"]["422"]["content"]  # FastAPI's validation body too
    for status in ("409", "503"):
        assert charge["responses"][status]["headers"]["Retry-After"]["schema"]["type"] == "integer"
    codes = schema["components"]["schemas"]["IdempotencyProblem"]["properties"]["code"]["enum"]
    assert set(codes) == {code.value for code in ProblemCode}
    assert "parameters" not in schema["paths"]["/health"]["get"]  # GET is not covered


def test_openapi_without_the_middleware_is_untouched() -> None:
    app = FastAPI()

    @app.post("/x")
    async def x() -> dict[str, str]:
        return {}

    setup(app)
    assert "parameters" not in app.openapi()["paths"]["/x"]["post"]
