"""A key format per route (``key_format``): a route that takes UUIDs only, or keys of a minimum length, refuses any
other with 400 ``idempotency_key_invalid`` before the store, on every store and in both modes."""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idempotency_mw import IdempotencyMiddleware, MemoryStore, idempotent
from idempotency_mw.fastapi import setup
from idempotency_mw.store import Store
from tests.conftest import client_for, tenant_of

UUID_KEYS = "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


def long_enough(key: str) -> bool:
    """idempot's rule: 21 characters or more."""
    return len(key) >= 21


def app_with_formats(store: Store, transactional: bool, runs: Counter[str]) -> Starlette:
    @idempotent(key_format=UUID_KEYS)
    async def payouts(request: Request) -> Response:
        runs["payouts"] += 1
        return JSONResponse({"id": "po_1"}, status_code=201)

    @idempotent(key_format=long_enough)
    async def transfers(request: Request) -> Response:
        runs["transfers"] += 1
        return JSONResponse({"id": "tr_1"}, status_code=201)

    async def charges(request: Request) -> Response:
        runs["charges"] += 1
        return JSONResponse({"id": "ch_1"}, status_code=201)

    app = Starlette(
        routes=[
            Route("/v1/payouts", payouts, methods=["POST"]),
            Route("/v1/transfers", transfers, methods=["POST"]),
            Route("/v1/charges", charges, methods=["POST"]),
        ]
    )
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=transactional)
    return app


async def test_a_route_takes_the_keys_of_its_format_only(store_and_mode: tuple[Store, bool]) -> None:
    store, transactional = store_and_mode
    runs: Counter[str] = Counter()
    unique = uuid.uuid4().hex  # the store is the suite's: keys of this run only
    async with client_for(app_with_formats(store, transactional, runs)) as client:
        good = str(uuid.uuid4())
        first = await client.post("/v1/payouts", headers={"Idempotency-Key": good})
        again = await client.post("/v1/payouts", headers={"Idempotency-Key": good})
        assert (first.status_code, again.status_code, again.headers["idempotent-replayed"]) == (201, 201, "true")
        refused = await client.post("/v1/payouts", headers={"Idempotency-Key": f"order-{unique}"})
        assert refused.status_code == 400
        assert refused.json()["code"] == "idempotency_key_invalid"
        assert refused.json()["detail"] == f"this route's idempotency keys match the pattern '{UUID_KEYS}'."
        short = await client.post("/v1/transfers", headers={"Idempotency-Key": unique[:12]})
        assert (short.status_code, short.json()["code"]) == (400, "idempotency_key_invalid")
        assert short.json()["detail"] == "the idempotency key is not in the format this route takes."
        taken = await client.post("/v1/transfers", headers={"Idempotency-Key": unique})
        assert taken.status_code == 201
        anything = await client.post("/v1/charges", headers={"Idempotency-Key": f"order-{unique}"})
        assert anything.status_code == 201  # a route without a format takes any key the header rules allow
    assert runs == Counter({"payouts": 1, "transfers": 1, "charges": 1})
    assert await store.inspect(tenant_of(), f"order-{unique}") is not None  # the charge's, not the refused payout's
    assert await store.inspect(tenant_of(), unique[:12]) is None  # refused before the store


@pytest.mark.parametrize(
    ("key_format", "message"),
    [("[0-9", "key_format is not a regular expression"), (42, "a regular expression or a function")],
)
def test_a_bad_key_format_stops_the_app_at_startup(key_format: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        IdempotencyMiddleware(Starlette(), MemoryStore(), routes={"/v1/*": {"key_format": key_format}})


async def test_openapi_documents_the_format_of_each_route() -> None:
    app = FastAPI()

    @app.post("/v1/payouts", status_code=201)
    @idempotent(key_format=UUID_KEYS)
    async def create_payout() -> dict[str, str]:
        return {"id": "po_1"}

    @app.post("/v1/charges", status_code=201)
    async def create_charge() -> dict[str, str]:
        return {"id": "ch_1"}

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    setup(app)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        schema = (await client.get("/openapi.json")).json()

    def key_header(path: str) -> dict[str, Any]:
        (header,) = [p for p in schema["paths"][path]["post"]["parameters"] if p["name"] == "Idempotency-Key"]
        found: dict[str, Any] = header
        return found

    payouts, charges = key_header("/v1/payouts"), key_header("/v1/charges")
    assert payouts["schema"]["pattern"] == f"^(?:{UUID_KEYS})$"
    assert f"takes keys that match {UUID_KEYS}" in str(payouts["description"])
    assert charges["schema"]["pattern"] != payouts["schema"]["pattern"]
    assert "takes keys that match" not in str(charges["description"])


async def test_an_app_wide_key_format_is_a_middleware_setting(store_and_mode: tuple[Store, bool]) -> None:
    """``key_format=`` on the middleware holds on every route that does not name its own."""
    store, transactional = store_and_mode
    runs: Counter[str] = Counter()

    async def charges(request: Request) -> Response:
        runs["charges"] += 1
        return JSONResponse({"id": "ch_1"}, status_code=201)

    app = Starlette(routes=[Route("/v1/charges", charges, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=transactional, key_format=long_enough)
    async with client_for(app) as client:
        short = await client.post("/v1/charges", headers={"Idempotency-Key": "k" + uuid.uuid4().hex[:8]})
        assert short.status_code == 400
        assert short.json()["code"] == "idempotency_key_invalid"
        fine = await client.post("/v1/charges", headers={"Idempotency-Key": uuid.uuid4().hex})
        assert fine.status_code == 201
    assert runs["charges"] == 1
