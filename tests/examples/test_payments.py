"""The payments example (examples.payments): Stripe's wire conventions, the ledger, transactional mode."""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI

from examples.payments import app as payments_app
from examples.payments import wire
from examples.payments.app import create_app
from idempotency_mw import PostgresStore
from idempotency_mw._fingerprint import fingerprint
from idempotency_mw.client import should_retry
from idempotency_mw.testing import assert_idempotent

REPOSITORY = Path(__file__).resolve().parents[2]


@pytest.fixture
async def app(idempotency_database_url: str) -> AsyncIterator[FastAPI]:
    app = create_app(idempotency_database_url, pool_size=16)
    async with app.router.lifespan_context(app):
        yield app


@pytest.fixture
def api_key() -> str:
    """A fresh account per test, so balances start at zero."""
    return f"sk_test_{uuid.uuid4().hex}"


@pytest.fixture
async def client(app: FastAPI, api_key: str) -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(app, api_key) as client:
        yield client


def client_for(app: FastAPI, api_key: str | None, *, raise_app_exceptions: bool = True) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
    return httpx.AsyncClient(transport=transport, base_url="http://payments.test", headers=headers)


def keyed() -> dict[str, str]:
    return {"Idempotency-Key": str(uuid.uuid4())}


def error(response: httpx.Response, status: int) -> dict[str, Any]:
    """The Stripe envelope of an error answer."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"}
    assert {"type", "message"} <= set(body["error"])
    return dict(body["error"])


async def pay(client: httpx.AsyncClient, amount: int = 1000, currency: str = "usd", **extra: str) -> dict[str, Any]:
    data = {"amount": str(amount), "currency": currency, "confirm": "true", **extra}
    response = await client.post("/v1/payment_intents", data=data, headers=keyed())
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def ledger_entries(db: asyncpg.Connection, payment_intent: str) -> list[asyncpg.Record]:
    return await db.fetch("SELECT * FROM payments.ledger WHERE payment_intent = $1 ORDER BY id", payment_intent)


# -- objects and form parsing ------------------------------------------------------------------------------------


async def test_customer_from_a_form_with_nested_metadata(client: httpx.AsyncClient) -> None:
    data = {
        "email": "jenny@example.com",
        "name": "Jenny Rosen",
        "metadata[order_id]": "6735",
        "metadata[note]": "a&b=c",
    }
    created = await client.post("/v1/customers", data=data, headers=keyed())
    assert created.status_code == 200
    customer = created.json()
    assert customer["id"].startswith("cus_")
    assert customer["object"] == "customer"
    assert customer["email"] == "jenny@example.com"
    assert customer["metadata"] == {"order_id": "6735", "note": "a&b=c"}
    fetched = await client.get(f"/v1/customers/{customer['id']}")
    assert fetched.json() == customer


async def test_confirmed_payment_intent_captures_and_credits_the_balance(
    client: httpx.AsyncClient, db: asyncpg.Connection
) -> None:
    customer = (await client.post("/v1/customers", data={"email": "a@example.com"})).json()["id"]
    intent = await pay(client, 2500, "EUR", customer=customer, payment_method_types="card", **{"metadata[order]": "17"})
    assert intent["id"].startswith("pi_")
    assert intent["object"] == "payment_intent"
    assert intent["status"] == "succeeded"
    assert (intent["amount"], intent["amount_received"], intent["currency"]) == (2500, 2500, "eur")
    assert intent["customer"] == customer
    assert intent["payment_method"] == "pm_card_visa"
    assert intent["metadata"] == {"order": "17"}
    assert (await client.get(f"/v1/payment_intents/{intent['id']}")).json() == intent
    entries = await ledger_entries(db, intent["id"])
    assert [(e["kind"], e["amount"], e["currency"]) for e in entries] == [("charge", 2500, "eur")]
    balance = (await client.get("/v1/balance")).json()
    assert balance["object"] == "balance"
    assert balance["available"] == [{"amount": 2500, "currency": "eur", "source_types": {"card": 2500}}]


async def test_unconfirmed_intent_is_captured_by_confirm(client: httpx.AsyncClient) -> None:
    created = await client.post("/v1/payment_intents", data={"amount": "900", "currency": "usd"}, headers=keyed())
    intent = created.json()
    assert (intent["status"], intent["amount_received"]) == ("requires_payment_method", 0)
    assert (await client.get("/v1/balance")).json()["available"][0]["amount"] == 0
    confirm = f"/v1/payment_intents/{intent['id']}/confirm"
    confirmed = await client.post(confirm, data={"payment_method": "pm_card_mastercard"}, headers=keyed())
    assert confirmed.json()["status"] == "succeeded"
    assert confirmed.json()["amount_received"] == 900
    again = await client.post(confirm, headers=keyed())
    assert error(again, 400)["code"] == "payment_intent_unexpected_state"
    assert (await client.get("/v1/balance")).json()["available"][0]["amount"] == 900


async def test_decode_form_nests_brackets_and_lists() -> None:
    decoded = wire.decode_form([("a", "1"), ("m[x]", "2"), ("m[y][z]", "3"), ("l[]", "4"), ("l[]", "5")])
    assert decoded == {"a": "1", "m": {"x": "2", "y": {"z": "3"}}, "l": ["4", "5"]}
    lists = wire.Params(wire.decode_form([("t[1]", "b"), ("t[0]", "a"), ("r", "x"), ("r", "y"), ("s", "z")]))
    assert (lists.string_list("t"), lists.string_list("r"), lists.string_list("s")) == (["a", "b"], ["x", "y"], ["z"])
    with pytest.raises(wire.StripeError, match="single plain value"):
        wire.Params(wire.decode_form([("a", "1"), ("a", "2")])).string("a")
    for pairs in (
        [("a", "1"), ("a[b]", "2")],
        [("a[b]", "1"), ("a[]", "2")],
        [("a[b]", "1"), ("a", "2")],
        [("a]", "1")],
    ):
        with pytest.raises(wire.StripeError) as refused:
            wire.decode_form(pairs)
        assert refused.value.status == 400


# -- errors ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("authorization", "works"),
    [
        (None, False),
        ("Bearer sk_live_abc", False),
        ("Bearer garbage", False),
        ("Token sk_test_abc", False),
        ("Basic !!!", False),
        ("Bearer sk_test_ok", True),
        ("Basic " + base64.b64encode(b"sk_test_ok:").decode(), True),
    ],
)
async def test_authentication(app: FastAPI, authorization: str | None, works: bool) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    async with client_for(app, None) as client:
        response = await client.post(
            "/v1/customers", data={"name": "x"}, headers={**headers, "Idempotency-Key": str(uuid.uuid4())}
        )
    if works:
        assert response.status_code == 200
    else:
        body = error(response, 401)
        assert (body["type"], body["code"]) == ("invalid_request_error", "api_key_invalid")
        assert response.headers["www-authenticate"].startswith("Bearer")


async def test_bearer_and_basic_are_the_same_account(client: httpx.AsyncClient, app: FastAPI, api_key: str) -> None:
    intent = await pay(client, 700)
    basic = "Basic " + base64.b64encode(f"{api_key}:".encode()).decode()
    async with client_for(app, None) as other:
        fetched = await other.get(f"/v1/payment_intents/{intent['id']}", headers={"Authorization": basic})
    assert fetched.json()["id"] == intent["id"]


@pytest.mark.parametrize(
    ("data", "code", "param"),
    [
        ({}, "parameter_missing", "amount"),
        ({"amount": "1000"}, "parameter_missing", "currency"),
        ({"amount": "12x", "currency": "usd"}, "parameter_invalid_integer", "amount"),
        ({"amount": "", "currency": "usd"}, "parameter_invalid_empty", "amount"),
        ({"amount": "1000", "currency": "xyz"}, "parameter_invalid", "currency"),
        ({"amount": "10", "currency": "usd"}, "amount_too_small", "amount"),
        ({"amount": "100000000", "currency": "usd"}, "amount_too_large", "amount"),
        ({"amount": "1000", "currency": "usd", "colour": "red"}, "parameter_unknown", "colour"),
        ({"amount": "1000", "currency": "usd", "confirm": "yes"}, "parameter_invalid_boolean", "confirm"),
        ({"amount": "1000", "currency": "usd", "metadata": "x"}, "parameter_invalid", "metadata"),
        ({"amount": "1000", "currency": "usd", "metadata[a][b]": "x"}, "parameter_invalid", "metadata[a]"),
        ({"amount": "1000", "currency": "usd", "metadata[k]": "v" * 501}, "parameter_invalid", "metadata[k]"),
        ({"amount": "1000", "currency": "usd", "payment_method_types[]": "sepa"}, "parameter_invalid", None),
        ({"amount": "1000", "currency": "usd", "description": "a\x00b"}, "parameter_invalid", "description"),
        ({"amount": "1000", "currency": "usd", "metadata[a\x00]": "b"}, "parameter_invalid", "metadata"),
    ],
)
async def test_invalid_parameters(client: httpx.AsyncClient, data: dict[str, str], code: str, param: str) -> None:
    body = error(await client.post("/v1/payment_intents", data=data, headers=keyed()), 400)
    assert body["type"] == "invalid_request_error"
    assert body["code"] == code
    if param is not None:
        assert body["param"] == param


async def test_invalid_parameters_do_not_burn_the_key(client: httpx.AsyncClient, db: asyncpg.Connection) -> None:
    """Nothing ran, so the corrected request may reuse the key (Stripe's rule), and it then takes effect once."""
    headers = keyed()
    refused = await client.post("/v1/payment_intents", data={"amount": "1000"}, headers=headers)
    assert error(refused, 400)["code"] == "parameter_missing"
    fixed = {"amount": "1000", "currency": "usd", "confirm": "true"}
    first = await client.post("/v1/payment_intents", data=fixed, headers=headers)
    assert first.status_code == 200
    assert "idempotent-replayed" not in first.headers
    again = await client.post("/v1/payment_intents", data=fixed, headers=headers)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert len(await ledger_entries(db, first.json()["id"])) == 1


async def test_unknown_objects_are_404(client: httpx.AsyncClient, app: FastAPI) -> None:
    missing = error(await client.get("/v1/payment_intents/pi_nope"), 404)
    assert (missing["code"], missing["param"]) == ("resource_missing", "intent")
    assert "pi_nope" in missing["message"]
    no_customer = await client.post(
        "/v1/payment_intents", data={"amount": "1000", "currency": "usd", "customer": "cus_nope"}, headers=keyed()
    )
    assert error(no_customer, 404)["param"] == "customer"
    no_intent = await client.post("/v1/refunds", data={"payment_intent": "pi_nope"}, headers=keyed())
    assert error(no_intent, 404)["param"] == "payment_intent"
    no_method = await client.post(
        "/v1/payment_intents", data={"amount": "1000", "currency": "usd", "payment_method": "pm_x"}, headers=keyed()
    )
    assert error(no_method, 404)["param"] == "payment_method"
    assert error(await client.get("/v1/payment_intents/pi_%00"), 404)["code"] == "resource_missing"  # NUL: no such id
    no_route = error(await client.post("/v1/charges", data={"amount": "1"}), 404)
    assert "Unrecognized request URL" in no_route["message"]


async def test_accounts_are_isolated(client: httpx.AsyncClient, app: FastAPI) -> None:
    """The secret key is the tenant: the same Idempotency-Key in two accounts names two operations."""
    headers = keyed()
    data = {"amount": "1000", "currency": "usd", "confirm": "true"}
    mine = await client.post("/v1/payment_intents", data=data, headers=headers)
    async with client_for(app, f"sk_test_{uuid.uuid4().hex}") as other:
        theirs = await other.post("/v1/payment_intents", data=data, headers=headers)
        assert "idempotent-replayed" not in theirs.headers
        assert theirs.json()["id"] != mine.json()["id"]
        assert error(await other.get(f"/v1/payment_intents/{mine.json()['id']}"), 404)["code"] == "resource_missing"


async def test_declined_card_is_recorded_and_replayed(client: httpx.AsyncClient, db: asyncpg.Connection) -> None:
    headers = keyed()
    data = {"amount": "1500", "currency": "usd", "confirm": "true", "payment_method": "pm_card_chargeDeclined"}
    declined = await client.post("/v1/payment_intents", data=data, headers=headers)
    body = error(declined, 402)
    assert (body["type"], body["code"], body["decline_code"]) == ("card_error", "card_declined", "generic_decline")
    intent = body["payment_intent"]
    assert (intent["status"], intent["amount_received"]) == ("requires_payment_method", 0)
    assert intent["last_payment_error"]["decline_code"] == "generic_decline"
    again = await client.post("/v1/payment_intents", data=data, headers=headers)
    assert again.status_code == 402
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == declined.content
    assert await ledger_entries(db, intent["id"]) == []
    assert (await client.get("/v1/balance")).json()["available"][0]["amount"] == 0


async def test_key_reused_for_another_request_is_stripes_400_idempotency_error(client: httpx.AsyncClient) -> None:
    """The middleware answers 422 (the IETF draft); Stripe answers 400 idempotency_error, and so does the example."""
    headers = keyed()
    await client.post("/v1/customers", data={"name": "first"}, headers=headers)
    reused = await client.post("/v1/customers", data={"name": "second"}, headers=headers)
    body = error(reused, 400)
    assert (body["type"], body["code"]) == ("idempotency_error", "idempotency_key_reused")
    assert reused.headers["stripe-should-retry"] == "false"
    assert reused.headers["request-id"].startswith("req_")
    assert reused.headers["idempotency-key"] == headers["Idempotency-Key"]


async def test_in_progress_is_stripes_409_idempotency_key_in_use_with_retry_after(
    client: httpx.AsyncClient, api_key: str, idempotency_store: PostgresStore
) -> None:
    """A retry that meets its original still running: Stripe's 409 idempotency_key_in_use, which Stripe's clients
    retry (Stripe-Should-Retry), with Retry-After for the retrying client of this repository."""
    key = str(uuid.uuid4())
    content = b"amount=1000&currency=usd"
    content_type = b"application/x-www-form-urlencoded"
    digest = fingerprint("POST", "/v1/payment_intents", b"", content_type, content)
    await idempotency_store.claim(wire.account_id(api_key), key, digest, lease=60, ttl=600)  # "still running"
    response = await client.post(
        "/v1/payment_intents",
        content=content,
        headers={"Idempotency-Key": key, "Content-Type": content_type.decode()},
    )
    body = error(response, 409)
    assert (body["type"], body["code"]) == ("idempotency_error", "idempotency_key_in_use")
    assert response.headers["retry-after"]
    assert response.headers["stripe-should-retry"] == "true"
    assert should_retry(response)


# -- refunds -----------------------------------------------------------------------------------------------------


async def test_refunds(client: httpx.AsyncClient, db: asyncpg.Connection) -> None:
    intent = await pay(client, 1000)
    partial = await client.post(
        "/v1/refunds",
        data={"payment_intent": intent["id"], "amount": "300", "reason": "requested_by_customer", "metadata[t]": "1"},
        headers=keyed(),
    )
    refund = partial.json()
    assert refund["id"].startswith("re_")
    assert (refund["object"], refund["amount"], refund["payment_intent"]) == ("refund", 300, intent["id"])
    assert (refund["reason"], refund["metadata"], refund["status"]) == (
        "requested_by_customer",
        {"t": "1"},
        "succeeded",
    )
    assert (await client.get(f"/v1/refunds/{refund['id']}")).json() == refund

    too_much = await client.post("/v1/refunds", data={"payment_intent": intent["id"], "amount": "701"}, headers=keyed())
    assert (error(too_much, 400)["code"], error(too_much, 400)["param"]) == ("amount_too_large", "amount")
    rest = await client.post("/v1/refunds", data={"payment_intent": intent["id"]}, headers=keyed())
    assert rest.json()["amount"] == 700  # by default, whatever is left
    done = await client.post("/v1/refunds", data={"payment_intent": intent["id"], "amount": "1"}, headers=keyed())
    assert error(done, 400)["code"] == "charge_already_refunded"

    unpaid = (await client.post("/v1/payment_intents", data={"amount": "500", "currency": "usd"})).json()
    refused = await client.post("/v1/refunds", data={"payment_intent": unpaid["id"]}, headers=keyed())
    assert error(refused, 400)["code"] == "payment_intent_unexpected_state"

    entries = await ledger_entries(db, intent["id"])
    assert [(e["kind"], e["amount"]) for e in entries] == [("charge", 1000), ("refund", -300), ("refund", -700)]
    assert all(e["refund"] for e in entries[1:])
    assert (await client.get("/v1/balance")).json()["available"][0]["amount"] == 0


async def test_refund_refused_by_the_ledger_is_recorded(client: httpx.AsyncClient) -> None:
    """A refund refused because of what the ledger holds ran: its answer is replayed, not re-decided."""
    intent = await pay(client, 1000)
    headers = keyed()
    refused = await client.post("/v1/refunds", data={"payment_intent": intent["id"], "amount": "5000"}, headers=headers)
    assert error(refused, 400)["code"] == "amount_too_large"
    again = await client.post("/v1/refunds", data={"payment_intent": intent["id"], "amount": "5000"}, headers=headers)
    assert again.headers["idempotent-replayed"] == "true"


async def test_concurrent_refunds_never_exceed_the_capture(client: httpx.AsyncClient, db: asyncpg.Connection) -> None:
    intent = await pay(client, 1000)

    async def refund(data: dict[str, str]) -> httpx.Response:
        return await client.post("/v1/refunds", data={"payment_intent": intent["id"], **data}, headers=keyed())

    answers = await asyncio.gather(*(refund({"amount": "300"}) for _ in range(8)))
    statuses = sorted(a.status_code for a in answers)
    assert statuses == [200] * 3 + [400] * 5
    assert {a.json()["error"]["code"] for a in answers if a.status_code == 400} == {"amount_too_large"}
    rests = await asyncio.gather(*(refund({}) for _ in range(4)))  # "the rest", four times at once
    assert sorted(a.status_code for a in rests) == [200, 400, 400, 400]
    assert next(a.json()["amount"] for a in rests if a.status_code == 200) == 100

    row = await db.fetchrow(
        "SELECT amount_received, amount_refunded FROM payments.payment_intents WHERE id = $1", intent["id"]
    )
    assert row is not None
    assert (row["amount_received"], row["amount_refunded"]) == (1000, 1000)
    assert sum(e["amount"] for e in await ledger_entries(db, intent["id"])) == 0


async def test_the_database_refuses_an_over_refund_on_its_own(
    db: asyncpg.Connection, client: httpx.AsyncClient
) -> None:
    """The CHECK constraint holds even for a write that skips the application's checks."""
    intent = await pay(client, 1000)
    with pytest.raises(asyncpg.CheckViolationError):
        await db.execute("UPDATE payments.payment_intents SET amount_refunded = 1001 WHERE id = $1", intent["id"])


# -- transactional mode ------------------------------------------------------------------------------------------


async def test_retried_payment_intent_is_one_payment(client: httpx.AsyncClient, db: asyncpg.Connection) -> None:
    data = {"amount": "4200", "currency": "usd", "confirm": "true", "metadata[op]": uuid.uuid4().hex}
    report = await assert_idempotent(client, "POST", "/v1/payment_intents", times=6, data=data)
    assert report.executed == 1
    intents = await db.fetch("SELECT id FROM payments.payment_intents WHERE metadata->>'op' = $1", data["metadata[op]"])
    assert len(intents) == 1
    entries = await ledger_entries(db, intents[0]["id"])
    assert len(entries) == 1
    assert entries[0]["idempotency_key"] is not None
    assert (await client.get("/v1/balance")).json()["available"][0]["amount"] == 4200


async def test_a_failing_write_rolls_back_the_effect_and_the_record(
    app: FastAPI, api_key: str, db: asyncpg.Connection, idempotency_store: PostgresStore
) -> None:
    """The ledger refuses the charge after the payment intent was written: both roll back, and the key is free."""
    account = wire.account_id(api_key)
    constraint = f"test_refuse_{uuid.uuid4().hex[:12]}"
    await db.execute(
        f"ALTER TABLE payments.ledger ADD CONSTRAINT {constraint} CHECK (account <> '{account}') NOT VALID"
    )
    key = str(uuid.uuid4())
    marker = uuid.uuid4().hex
    data = {"amount": "1000", "currency": "usd", "confirm": "true", "metadata[op]": marker}
    try:
        async with client_for(app, api_key, raise_app_exceptions=False) as client:
            failed = await client.post("/v1/payment_intents", data=data, headers={"Idempotency-Key": key})
        assert error(failed, 500)["type"] == "api_error"
        assert (
            await db.fetchval("SELECT count(*) FROM payments.payment_intents WHERE metadata->>'op' = $1", marker) == 0
        )
        assert await idempotency_store.inspect(account, key) is None
    finally:
        await db.execute(f"ALTER TABLE payments.ledger DROP CONSTRAINT {constraint}")
    async with client_for(app, api_key) as client:
        retried = await client.post("/v1/payment_intents", data=data, headers={"Idempotency-Key": key})
    assert retried.status_code == 200
    assert "idempotent-replayed" not in retried.headers
    assert await db.fetchval("SELECT count(*) FROM payments.payment_intents WHERE metadata->>'op' = $1", marker) == 1
    assert len(await ledger_entries(db, retried.json()["id"])) == 1


# -- OpenAPI -----------------------------------------------------------------------------------------------------


async def test_openapi_documents_form_bodies_keys_and_envelopes(client: httpx.AsyncClient) -> None:
    schema = (await client.get("/openapi.json")).json()
    operation = schema["paths"]["/v1/payment_intents"]["post"]
    form = operation["requestBody"]["content"]["application/x-www-form-urlencoded"]
    assert form["schema"]["required"] == ["amount", "currency"]
    assert form["encoding"]["metadata"] == {"style": "deepObject", "explode": True}
    assert any(p["name"] == "Idempotency-Key" and p["in"] == "header" for p in operation["parameters"])
    assert operation["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/PaymentIntent")
    for status in ("400", "402", "404", "409", "503"):
        content = operation["responses"][status]["content"]
        assert set(content) == {"application/json"}
        assert content["application/json"]["schema"]["$ref"].endswith("/ErrorEnvelope")
        assert "Request-Id" in operation["responses"][status]["headers"]
    assert "problem+json" not in str(schema)
    assert "Idempotency-Problem" not in str(schema)  # the edge answers in Stripe's words, and drops the header
    assert set(schema["components"]["securitySchemes"]) == {"secretKey", "basic"}
    for path in schema["paths"].values():
        for documented in path.values():
            assert "422" not in documented["responses"]  # a reused key is Stripe's 400 idempotency_error
    listing = schema["paths"]["/v1/payment_intents"]["get"]
    assert {p["name"] for p in listing["parameters"]} == {
        "expand",
        "limit",
        "starting_after",
        "ending_before",
        "created",
        "customer",
    }
    expand = next(p for p in listing["parameters"] if p["name"] == "expand")
    assert expand["schema"]["items"]["enum"] == ["data.customer"]
    refund_form = schema["paths"]["/v1/refunds"]["post"]["requestBody"]["content"]["application/x-www-form-urlencoded"]
    assert refund_form["schema"]["properties"]["expand"]["items"]["enum"] == [
        "payment_intent",
        "payment_intent.customer",
    ]


def documented_schema(schema: dict[str, Any], method: str, path: str, name: str) -> dict[str, Any]:
    """The documented schema of parameter ``name``: a form field of the body, or a query parameter."""
    operation = schema["paths"][path][method.lower()]
    if method == "POST":
        form = operation["requestBody"]["content"]["application/x-www-form-urlencoded"]["schema"]
        found: dict[str, Any] = form["properties"][name]
        return found
    (parameter,) = [p for p in operation["parameters"] if p["name"] == name]
    return dict(parameter["schema"])


async def request_with(client: httpx.AsyncClient, method: str, path: str, name: str, value: str) -> httpx.Response:
    """A request that is valid but for ``name=value``: required parameters and path ids are filled in."""
    if method == "GET":
        return await client.get(path, params={name: value})
    data: dict[str, str] = {}
    if path == "/v1/payment_intents":
        data = {"amount": "1000", "currency": "usd"}
    elif path == "/v1/refunds":
        data = {"payment_intent": (await pay(client))["id"]}
    elif path == "/v1/customers/{customer}":
        created = await client.post("/v1/customers", data={"name": "Ada"}, headers=keyed())
        path = path.replace("{customer}", created.json()["id"])
    elif "{intent}" in path:
        created = await client.post("/v1/payment_intents", data={"amount": "900", "currency": "usd"}, headers=keyed())
        path = path.replace("{intent}", created.json()["id"])
    return await client.post(path, data={**data, name: value}, headers=keyed())


# Stripe refuses an empty string for a parameter that cannot be unset (400 parameter_invalid_empty): an id, a
# number, a flag, a choice, a filter, a cursor. The schema must refuse it too.
CANNOT_BE_EMPTY = [
    ("POST", "/v1/payment_intents", "customer"),
    ("POST", "/v1/payment_intents", "payment_method"),
    ("POST", "/v1/payment_intents", "confirm"),
    ("POST", "/v1/payment_intents/{intent}/confirm", "payment_method"),
    ("POST", "/v1/refunds", "amount"),
    ("POST", "/v1/refunds", "reason"),
    ("GET", "/v1/payment_intents", "customer"),
    ("GET", "/v1/refunds", "payment_intent"),
    ("GET", "/v1/customers", "email"),
    ("GET", "/v1/customers", "starting_after"),
    ("GET", "/v1/customers", "ending_before"),
    ("GET", "/v1/customers", "limit"),
]
# Text a create or an update may leave empty: the field is then unset (null), and the schema allows it.
MAY_BE_EMPTY = [
    ("POST", "/v1/customers", "email"),
    ("POST", "/v1/customers", "name"),
    ("POST", "/v1/customers", "description"),
    ("POST", "/v1/payment_intents", "description"),
    ("POST", "/v1/customers/{customer}", "name"),
    ("POST", "/v1/payment_intents/{intent}", "description"),
]


@pytest.mark.parametrize(("method", "path", "name"), CANNOT_BE_EMPTY)
async def test_an_empty_value_that_cannot_unset_is_refused_as_documented(
    client: httpx.AsyncClient, method: str, path: str, name: str
) -> None:
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    schema = (await client.get("/openapi.json")).json()
    assert not jsonschema_rs.is_valid(documented_schema(schema, method, path, name), "")
    body = error(await request_with(client, method, path, name, ""), 400)
    assert (body["code"], body["param"]) == ("parameter_invalid_empty", name)


@pytest.mark.parametrize(("method", "path", "name"), MAY_BE_EMPTY)
async def test_an_empty_text_value_unsets_as_documented(
    client: httpx.AsyncClient, method: str, path: str, name: str
) -> None:
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    schema = (await client.get("/openapi.json")).json()
    documented = documented_schema(schema, method, path, name)
    assert jsonschema_rs.is_valid(documented, "")
    assert "empty" in documented["description"]
    response = await request_with(client, method, path, name, "")
    assert response.status_code == 200, response.text
    assert response.json()[name] is None


@pytest.mark.parametrize(("path", "name"), [("/v1/payment_intents", "customer"), ("/v1/refunds", "payment_intent")])
@pytest.mark.parametrize("value", ["cus", "pi_x", "x" * 512, "x" * 513])
async def test_list_filters_are_documented_as_accepted(
    client: httpx.AsyncClient, path: str, name: str, value: str
) -> None:
    """A filter naming no object of the account finds nothing (200, an empty list); one too long is refused."""
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    schema = (await client.get("/openapi.json")).json()
    documented = jsonschema_rs.is_valid(documented_schema(schema, "GET", path, name), value)
    response = await client.get(path, params={name: value})
    assert response.status_code == (200 if documented else 400), response.text
    if documented:
        assert response.json()["data"] == []


@pytest.mark.parametrize("comparison", ["gt", "gte", "lt", "lte"])
@pytest.mark.parametrize("value", [999_999_999_999_999_999, 10**18, -999_999_999_999_999_999, -(10**18), 0])
async def test_created_bounds_are_documented_as_accepted(
    client: httpx.AsyncClient, comparison: str, value: int
) -> None:
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    schema = (await client.get("/openapi.json")).json()
    created = documented_schema(schema, "GET", "/v1/payment_intents", "created")
    documented = jsonschema_rs.is_valid(created, {comparison: value})
    response = await client.get("/v1/payment_intents", params={f"created[{comparison}]": str(value)})
    assert response.status_code == (200 if documented else 400), response.text
    if not documented:
        assert error(response, 400)["code"] == "parameter_invalid_integer"


@pytest.mark.parametrize(
    ("method", "path", "template", "headers"),
    [
        ("PUT", "/v1/customers", "/v1/customers", {}),
        ("DELETE", "/v1/customers/cus_x", "/v1/customers/{customer}", {}),
        ("PATCH", "/v1/payment_intents/pi_x", "/v1/payment_intents/{intent}", keyed()),  # through the middleware
        ("GET", "/v1/payment_intents/pi_x/confirm", "/v1/payment_intents/{intent}/confirm", {}),
        ("POST", "/v1/balance", "/v1/balance", {}),
    ],
)
async def test_405_allows_every_method_of_the_path(
    client: httpx.AsyncClient, method: str, path: str, template: str, headers: dict[str, str]
) -> None:
    """RFC 9110 §15.5.6: Allow lists the methods the resource supports, not only those of the first route that
    matched the path (Starlette's router)."""
    schema = (await client.get("/openapi.json")).json()
    documented = {m.upper() for m in schema["paths"][template]}  # FastAPI's routes answer no HEAD of their own
    response = await client.request(method, path, headers=headers)
    assert error(response, 405)["type"] == "invalid_request_error"
    assert set(response.headers["allow"].split(", ")) == documented


def test_allowed_methods_reads_every_route_of_the_path_through_mounts_and_root_path() -> None:
    api = FastAPI()

    @api.get("/items/{item}")
    async def read(item: str) -> dict[str, str]:
        return {}

    @api.delete("/items/{item}")
    async def delete(item: str) -> dict[str, str]:
        return {}

    app = FastAPI()
    app.mount("/api", api)
    assert payments_app.allowed_methods(app.routes, {"path": "/api/items/3"}) == ["DELETE", "GET"]
    assert payments_app.allowed_methods(app.routes, {"path": "/v2/api/items/3", "root_path": "/v2"}) == [
        "DELETE",
        "GET",
    ]
    assert payments_app.allowed_methods(app.routes, {"path": "/api/other"}) == []


# -- startup, migrations and health -------------------------------------------------------------------------------

TABLES = "SELECT to_regclass('idempotency_records') IS NOT NULL, to_regclass('payments.ledger') IS NOT NULL"


async def test_startup_without_migrate_runs_no_ddl(fresh_url: str) -> None:
    """docker-compose.yml serves the app as a role that cannot create tables: its startup must not try."""
    app = create_app(fresh_url, migrate=False)
    async with app.router.lifespan_context(app), client_for(app, None) as client:
        assert (await client.get("/healthz")).json() == {"status": "ok"}
    connection = await asyncpg.connect(fresh_url)
    try:
        tables = await connection.fetchrow(TABLES)
        assert tables is not None
        assert tuple(tables) == (False, False)
    finally:
        await connection.close()


async def test_startup_migrates_by_default(fresh_url: str) -> None:
    app = create_app(fresh_url.replace("postgresql://", "postgresql+asyncpg://", 1))  # one DATABASE_URL for all
    async with app.router.lifespan_context(app), client_for(app, f"sk_test_{uuid.uuid4().hex}") as client:
        assert (await pay(client))["status"] == "succeeded"
    connection = await asyncpg.connect(fresh_url)
    try:
        tables = await connection.fetchrow(TABLES)
        assert tables is not None
        assert tuple(tables) == (True, True)
    finally:
        await connection.close()


@pytest.mark.slow
def test_the_migrate_command_creates_the_tables_then_is_up_to_date(fresh_url: str) -> None:
    def migrate(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "examples.payments.migrate"],
            cwd=REPOSITORY,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=120,
        )

    first = migrate({"DATABASE_URL": fresh_url})
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("idempotency tables: applied 0001_initial.sql")
    assert first.stdout.endswith("\npayments schema: up to date\n")
    again = migrate({"DATABASE_URL": fresh_url.replace("postgresql://", "postgresql+psycopg://", 1)})
    assert again.stdout == "idempotency tables: up to date\npayments schema: up to date\n"
    missing = migrate({"DATABASE_URL": ""})
    assert missing.returncode == 2
    assert "set DATABASE_URL" in missing.stderr


async def test_health_says_when_the_database_does_not_answer(app: FastAPI) -> None:
    async with client_for(app, None) as client:
        assert (await client.get("/healthz")).status_code == 200
        await app.state.pool.close()  # what the app sees of a database that went away
        answer = await client.get("/healthz")
    assert answer.status_code == 503
    assert answer.json()["status"] == "unavailable"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PAYMENTS_MIGRATE": "maybe"}, "PAYMENTS_MIGRATE must be 1 or 0"),
        ({"PAYMENTS_POOL_SIZE": "0"}, "PAYMENTS_POOL_SIZE must be a positive integer"),
    ],
)
def test_the_module_app_refuses_bad_settings(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str
) -> None:
    monkeypatch.setenv("DATABASE_URL", "postgresql://app@127.0.0.1:1/app")
    monkeypatch.setattr(payments_app, "_default_app", None)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        payments_app.app  # noqa: B018  (the module attribute builds the app)
