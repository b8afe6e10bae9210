"""What the payments example shares with Stripe's API v1 beyond single objects (issue 12): Request-Id and the key
echo, expand[], lists, updates, and GET parameters checked like POST ones. In-process; the official SDK drives the
same things over a lossy network in test_stripe_sdk.py."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI

from examples.payments.app import create_app
from tests.examples.test_payments import client_for, error, keyed, pay


@pytest.fixture
async def app(idempotency_database_url: str) -> AsyncIterator[FastAPI]:
    app = create_app(idempotency_database_url, pool_size=8)
    async with app.router.lifespan_context(app):
        yield app


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(app, f"sk_test_{uuid.uuid4().hex}") as client:
        yield client


async def customer(client: httpx.AsyncClient, **data: str) -> dict[str, Any]:
    created = await client.post("/v1/customers", data=data, headers=keyed())
    assert created.status_code == 200, created.text
    body: dict[str, Any] = created.json()
    return body


# -- headers -----------------------------------------------------------------------------------------------------


async def test_every_answer_has_a_request_id_and_keyed_ones_echo_the_key(client: httpx.AsyncClient) -> None:
    headers = keyed()
    created = await client.post("/v1/customers", data={"name": "a"}, headers=headers)
    assert created.headers["request-id"].startswith("req_")
    assert created.headers["idempotency-key"] == headers["Idempotency-Key"]
    fetched = await client.get(f"/v1/customers/{created.json()['id']}")
    assert fetched.headers["request-id"].startswith("req_")
    assert fetched.headers["request-id"] != created.headers["request-id"]
    assert "idempotency-key" not in fetched.headers
    refused = await client.post("/v1/payment_intents", data={"amount": "1"}, headers=keyed())
    assert refused.headers["request-id"].startswith("req_")
    no_route = await client.get("/v1/charges")
    assert no_route.headers["request-id"].startswith("req_")


async def test_a_replay_is_the_original_byte_for_byte_request_id_included(client: httpx.AsyncClient) -> None:
    """Stripe answers a replay with the original request's id: recorded with the answer, it comes back with it."""
    headers = keyed()
    data = {"amount": "1200", "currency": "usd", "confirm": "true"}
    first = await client.post("/v1/payment_intents", data=data, headers=headers)
    again = await client.post("/v1/payment_intents", data=data, headers=headers)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert again.headers["request-id"] == first.headers["request-id"]
    replayed = [(k, v) for k, v in again.headers.multi_items() if k != "idempotent-replayed"]
    assert replayed == first.headers.multi_items()


async def test_a_server_error_names_its_request_and_asks_for_a_retry(app: FastAPI) -> None:
    async def broken() -> None:
        raise RuntimeError("the disk is on fire")

    app.router.add_api_route("/v1/broken", broken, methods=["POST"])
    async with client_for(app, "sk_test_broken", raise_app_exceptions=False) as client:
        failed = await client.post("/v1/broken", headers=keyed())
    assert error(failed, 500)["type"] == "api_error"
    assert failed.headers["request-id"].startswith("req_")
    assert failed.headers["stripe-should-retry"] == "true"


# -- expand ------------------------------------------------------------------------------------------------------


async def test_expand_on_create_confirm_retrieve_and_list(client: httpx.AsyncClient) -> None:
    jenny = await customer(client, email="jenny@example.com")
    data = {"amount": "1000", "currency": "usd", "customer": jenny["id"], "expand[0]": "customer"}
    created = await client.post("/v1/payment_intents", data=data, headers=keyed())
    intent = created.json()
    assert intent["customer"] == jenny
    confirmed = await client.post(
        f"/v1/payment_intents/{intent['id']}/confirm", data={"expand[]": "customer"}, headers=keyed()
    )
    assert (confirmed.json()["status"], confirmed.json()["customer"]) == ("succeeded", jenny)
    plain = (await client.get(f"/v1/payment_intents/{intent['id']}")).json()
    assert plain["customer"] == jenny["id"]
    expanded = (await client.get(f"/v1/payment_intents/{intent['id']}", params={"expand[0]": "customer"})).json()
    assert expanded == {**plain, "customer": jenny}

    refund = (await client.post("/v1/refunds", data={"payment_intent": intent["id"]}, headers=keyed())).json()
    nested = await client.get(f"/v1/refunds/{refund['id']}", params={"expand[]": "payment_intent.customer"})
    expanded_intent = nested.json()["payment_intent"]
    assert (expanded_intent["id"], expanded_intent["customer"]) == (intent["id"], jenny)
    listed = await client.get("/v1/payment_intents", params={"expand[]": "data.customer", "customer": jenny["id"]})
    assert [item["customer"] for item in listed.json()["data"]] == [jenny]
    unpaid = await pay(client, 500)  # no customer: expanding it leaves null
    again = await client.get(f"/v1/payment_intents/{unpaid['id']}", params={"expand[]": "customer"})
    assert again.json()["customer"] is None


@pytest.mark.parametrize(
    ("path", "params"),
    [
        ("/v1/payment_intents/{intent}", {"expand[]": "payment_method"}),
        ("/v1/payment_intents/{intent}", {"expand[]": "customer.invoice_settings"}),
        ("/v1/payment_intents", {"expand[]": "customer"}),  # in a list: data.customer
        ("/v1/customers", {"expand[]": "data"}),
        ("/v1/balance", {"expand[]": "available"}),
    ],
)
async def test_what_cannot_be_expanded_is_refused(client: httpx.AsyncClient, path: str, params: dict[str, str]) -> None:
    intent = await pay(client, 600)
    body = error(await client.get(path.format(intent=intent["id"]), params=params), 400)
    assert (body["type"], body["param"]) == ("invalid_request_error", "expand")
    assert "cannot be expanded" in body["message"]


async def test_a_bad_expand_on_a_write_frees_the_key(client: httpx.AsyncClient) -> None:
    headers = keyed()
    data = {"amount": "1000", "currency": "usd", "confirm": "true"}
    refused = await client.post("/v1/payment_intents", data={**data, "expand[0]": "charges"}, headers=headers)
    assert error(refused, 400)["param"] == "expand"
    fixed = await client.post("/v1/payment_intents", data=data, headers=headers)
    assert fixed.status_code == 200
    assert "idempotent-replayed" not in fixed.headers


# -- GET parameters ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path", ["/v1/customers/{customer}", "/v1/customers", "/v1/payment_intents", "/v1/refunds", "/v1/balance"]
)
async def test_get_refuses_unknown_parameters(client: httpx.AsyncClient, path: str) -> None:
    jenny = await customer(client)
    body = error(await client.get(path.format(customer=jenny["id"]), params={"colour": "red"}), 400)
    assert (body["type"], body["code"], body["param"]) == ("invalid_request_error", "parameter_unknown", "colour")


# -- lists -------------------------------------------------------------------------------------------------------


async def test_lists_page_newest_first_both_ways(client: httpx.AsyncClient) -> None:
    made = [(await customer(client, name=f"c{n}"))["id"] for n in range(7)]
    newest_first = made[::-1]
    first = (await client.get("/v1/customers", params={"limit": "3"})).json()
    assert (first["object"], first["url"], first["has_more"]) == ("list", "/v1/customers", True)
    assert [c["id"] for c in first["data"]] == newest_first[:3]
    second = (await client.get("/v1/customers", params={"limit": "3", "starting_after": newest_first[2]})).json()
    assert ([c["id"] for c in second["data"]], second["has_more"]) == (newest_first[3:6], True)
    last = (await client.get("/v1/customers", params={"limit": "3", "starting_after": newest_first[5]})).json()
    assert ([c["id"] for c in last["data"]], last["has_more"]) == (newest_first[6:], False)
    back = (await client.get("/v1/customers", params={"limit": "2", "ending_before": newest_first[3]})).json()
    assert ([c["id"] for c in back["data"]], back["has_more"]) == (newest_first[1:3], True)
    top = (await client.get("/v1/customers", params={"limit": "2", "ending_before": newest_first[1]})).json()
    assert ([c["id"] for c in top["data"]], top["has_more"]) == (newest_first[:1], False)
    everything = (await client.get("/v1/customers")).json()
    assert [c["id"] for c in everything["data"]] == newest_first  # the default limit, 10, holds them all
    assert everything["has_more"] is False


async def test_list_filters(client: httpx.AsyncClient) -> None:
    jenny = await customer(client, email="jenny@example.com")
    await customer(client, email="other@example.com")
    by_email = (await client.get("/v1/customers", params={"email": "jenny@example.com"})).json()
    assert [c["id"] for c in by_email["data"]] == [jenny["id"]]
    hers = await pay(client, 700, customer=jenny["id"])
    mine = await pay(client, 800)
    listed = (await client.get("/v1/payment_intents", params={"customer": jenny["id"]})).json()
    assert [i["id"] for i in listed["data"]] == [hers["id"]]
    refund = (await client.post("/v1/refunds", data={"payment_intent": mine["id"]}, headers=keyed())).json()
    await client.post("/v1/refunds", data={"payment_intent": hers["id"], "amount": "100"}, headers=keyed())
    refunds = (await client.get("/v1/refunds", params={"payment_intent": mine["id"]})).json()
    assert [r["id"] for r in refunds["data"]] == [refund["id"]]
    created = hers["created"]
    window = {"created[gte]": str(created - 1), "created[lte]": str(created + 120)}
    assert len((await client.get("/v1/payment_intents", params=window)).json()["data"]) == 2
    assert (await client.get("/v1/payment_intents", params={"created[gt]": str(created + 120)})).json()["data"] == []
    exactly = (await client.get("/v1/payment_intents", params={"created": str(mine["created"])})).json()["data"]
    assert mine["id"] in [i["id"] for i in exactly]


@pytest.mark.parametrize(
    ("params", "status", "param"),
    [
        ({"limit": "0"}, 400, "limit"),
        ({"limit": "101"}, 400, "limit"),
        ({"limit": "ten"}, 400, "limit"),
        ({"starting_after": "cus_a", "ending_before": "cus_b"}, 400, "ending_before"),
        ({"starting_after": "cus_nope"}, 404, "starting_after"),
        ({"ending_before": "cus_nope"}, 404, "ending_before"),
        ({"created[after]": "1"}, 400, "created"),
        ({"created[gt]": "soon"}, 400, "created[gt]"),
        ({"created": "soon"}, 400, "created"),
    ],
)
async def test_bad_list_parameters(client: httpx.AsyncClient, params: dict[str, str], status: int, param: str) -> None:
    assert error(await client.get("/v1/customers", params=params), status)["param"] == param


async def test_lists_belong_to_their_account(client: httpx.AsyncClient, app: FastAPI) -> None:
    mine = await customer(client)
    async with client_for(app, f"sk_test_{uuid.uuid4().hex}") as other:
        assert (await other.get("/v1/customers")).json()["data"] == []
        assert error(await other.get("/v1/customers", params={"starting_after": mine["id"]}), 404)["code"] == (
            "resource_missing"
        )


# -- updates -----------------------------------------------------------------------------------------------------


async def test_update_sets_unsets_and_merges_metadata(client: httpx.AsyncClient) -> None:
    jenny = await customer(client, email="j@example.com", name="Jenny", **{"metadata[a]": "1", "metadata[b]": "2"})
    path = f"/v1/customers/{jenny['id']}"
    updated = await client.post(
        path, data={"name": "Jenny Rosen", "email": "", "metadata[b]": "", "metadata[c]": "3"}, headers=keyed()
    )
    body = updated.json()
    assert (body["name"], body["email"], body["metadata"]) == ("Jenny Rosen", None, {"a": "1", "c": "3"})
    assert (await client.get(path)).json() == body
    cleared = await client.post(path, data={"metadata": ""}, headers=keyed())
    assert cleared.json()["metadata"] == {}
    unchanged = await client.post(path, headers=keyed())
    assert unchanged.json() == cleared.json()

    intent = await pay(client, 900, customer=jenny["id"])
    described = await client.post(
        f"/v1/payment_intents/{intent['id']}",
        data={"description": "order 6735", "metadata[order]": "6735", "expand[]": "customer"},
        headers=keyed(),
    )
    assert described.json()["description"] == "order 6735"
    assert described.json()["metadata"] == {"order": "6735"}
    assert described.json()["customer"]["id"] == jenny["id"]
    refund = (await client.post("/v1/refunds", data={"payment_intent": intent["id"]}, headers=keyed())).json()
    tagged = await client.post(f"/v1/refunds/{refund['id']}", data={"metadata[why]": "late"}, headers=keyed())
    assert tagged.json()["metadata"] == {"why": "late"}
    refused = await client.post(f"/v1/refunds/{refund['id']}", data={"amount": "1"}, headers=keyed())
    assert error(refused, 400)["code"] == "parameter_unknown"


async def test_updates_that_cannot_be_made_change_nothing_and_free_the_key(
    client: httpx.AsyncClient, db_connection: asyncpg.Connection
) -> None:
    missing = error(await client.post("/v1/customers/cus_nope", data={"name": "x"}, headers=keyed()), 404)
    assert (missing["code"], missing["param"]) == ("resource_missing", "customer")
    jenny = await customer(client, **{f"metadata[k{n}]": "v" for n in range(50)})
    headers = keyed()
    too_many = await client.post(f"/v1/customers/{jenny['id']}", data={"metadata[one_more]": "v"}, headers=headers)
    assert error(too_many, 400)["param"] == "metadata"
    row = await db_connection.fetchrow("SELECT metadata FROM payments.customers WHERE id = $1", jenny["id"])
    assert row is not None
    assert "one_more" not in row["metadata"]  # the update rolled back with the refusal
    fixed = await client.post(f"/v1/customers/{jenny['id']}", data={"metadata[k0]": ""}, headers=headers)
    assert fixed.status_code == 200
    assert len(fixed.json()["metadata"]) == 49


@pytest.fixture
async def db_connection(idempotency_database_url: str) -> AsyncIterator[asyncpg.Connection]:
    connection = await asyncpg.connect(idempotency_database_url)
    yield connection
    await connection.close()
