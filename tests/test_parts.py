"""A 422 that says what changed (``explain_mismatch``, ``_parts.py``): the method, the path, the query, or which body
fields differ from the first request with the key, from the request's parts stored with its claim as keyed digests;
on both stores (and SQLAlchemyStore) and in both modes. Bounded for large bodies, unreadable without the server's
secret, refused where callers share a namespace, and the plain 422 where a record has no parts to compare."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import asyncpg
import httpx
import orjson
import pytest
from fastapi import FastAPI
from sqlalchemy.ext.asyncio import create_async_engine
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message

from idempotency_mw import (
    AuthorizationTenant,
    CookieTenant,
    FingerprintKeys,
    IdempotencyMiddleware,
    MemoryStore,
    PostgresStore,
    header_tenant,
    idempotent,
    legacy_sha256_fallback,
)
from idempotency_mw._cli_display import format_record, record_to_dict
from idempotency_mw._parts import MAX_FIELDS, explain, read_parts, request_parts
from idempotency_mw._problems import key_reused
from idempotency_mw.fastapi import setup
from idempotency_mw.sqlalchemy import SQLAlchemyStore
from idempotency_mw.store import RecordInfo, Store
from tests.conftest import client_for, http_scope, tenant_of
from tests.orm import sqlalchemy_url
from tests.test_fastapi import build_with_auth

KEYS = "k1:" + "a" * 32
ORDER: dict[str, Any] = {
    "amount": 500,
    "currency": "eur",
    "customer": {"email": "ada@example.com", "name": "Ada"},
    "items": [{"sku": "tea", "quantity": 2}],
}
FORM = "application/x-www-form-urlencoded"


def shop(store: Store, transactional: bool, runs: Counter[str], **options: Any) -> Starlette:
    """Charges (POST and PATCH) and refunds explain a reused key; quiet charges do not."""

    async def handle(request: Request) -> Response:
        runs[request.url.path] += 1
        return JSONResponse({"id": f"ch_{uuid.uuid4().hex[:8]}"}, status_code=201)

    @idempotent(explain_mismatch=False)
    async def quiet(request: Request) -> Response:
        return await handle(request)

    app = Starlette(
        routes=[
            Route("/v1/charges", handle, methods=["POST", "PATCH"]),
            Route("/v1/refunds", handle, methods=["POST"]),
            Route("/v1/quiet", quiet, methods=["POST"]),
        ]
    )
    options = {"explain_mismatch": True, "fingerprint_keys": KEYS, **options}
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=transactional, **options)
    return app


def changed(answer: httpx.Response) -> dict[str, Any]:
    assert (answer.status_code, answer.json()["code"]) == (422, "idempotency_key_reused"), answer.text
    found: dict[str, Any] = answer.json()["changed"]
    return found


def nothing_but(**differs: Any) -> dict[str, Any]:
    """The ``changed`` member when only ``differs`` differ (compared field by field)."""
    return {
        "method": False,
        "path": False,
        "query": False,
        "body": False,
        "fields": [],
        "missing_fields": 0,
        "compared": "fields",
        **differs,
    }


async def test_a_reused_key_says_what_changed(store_and_mode: tuple[Store, bool]) -> None:
    store, transactional = store_and_mode
    runs: Counter[str] = Counter()
    async with client_for(shop(store, transactional, runs)) as client:
        headers = {"Idempotency-Key": f"order-{uuid.uuid4()}"}
        assert (await client.post("/v1/charges", json=ORDER, headers=headers)).status_code == 201

        moved = {**ORDER, "amount": 501, "customer": {**ORDER["customer"], "email": "bob@example.com"}}
        both = await client.post("/v1/charges", json=moved, headers=headers)
        assert changed(both) == nothing_but(body=True, fields=["/amount", "/customer/email"])
        assert both.json()["detail"] == (
            'This Idempotency-Key was already used with a different request: the body (changed or added: "/amount", '
            '"/customer/email") differs from the first request with this key. Use a new key for a new request.'
        )

        other = {key: value for key, value in ORDER.items() if key != "currency"} | {"coupon": "SPRING"}
        other["items"] = [{"sku": "tea", "quantity": 2}, {"sku": "cake", "quantity": 1}]
        added = changed(await client.post("/v1/charges", json=other, headers=headers))
        # Named: what this request sent (the coupon, the cake). Counted: the currency it no longer sends.
        assert added == nothing_but(
            body=True, fields=["/coupon", "/items/1/quantity", "/items/1/sku"], missing_fields=1
        )

        query = await client.post("/v1/charges?expand=customer", json=ORDER, headers=headers)
        assert changed(query) == nothing_but(query=True)
        assert changed(await client.patch("/v1/charges", json=ORDER, headers=headers)) == nothing_but(method=True)
        assert changed(await client.post("/v1/refunds", json=ORDER, headers=headers)) == nothing_but(path=True)
        several = await client.patch("/v1/charges?expand=customer", json={**ORDER, "amount": 1}, headers=headers)
        assert changed(several) == nothing_but(method=True, query=True, body=True, fields=["/amount"])
        assert 'the method, the query and the body (changed or added: "/amount") differ' in several.json()["detail"]

        whole = await client.post("/v1/charges", content=orjson.dumps(ORDER), headers={**headers, "content-type": FORM})
        assert changed(whole) == nothing_but(body=True, compared="whole")  # a JSON body then, another kind now

        replay = await client.post("/v1/charges", json=dict(reversed(ORDER.items())), headers=headers)
        assert replay.headers["idempotent-replayed"] == "true"  # the same request, in another key order
    assert runs == Counter({"/v1/charges": 1})


async def test_a_form_is_compared_field_by_field(store_and_mode: tuple[Store, bool]) -> None:
    store, transactional = store_and_mode
    async with client_for(shop(store, transactional, Counter())) as client:
        headers = {"Idempotency-Key": f"form-{uuid.uuid4()}", "content-type": FORM}
        sent = [("amount", "500"), ("metadata[order]", "42"), ("tag", "a"), ("tag", "b")]
        assert (await client.post("/v1/charges", content=urlencode(sent), headers=headers)).status_code == 201
        again = [("amount", "500"), ("metadata[order]", "43"), ("tag", "b"), ("tag", "a"), ("note", "x")]
        found = changed(await client.post("/v1/charges", content=urlencode(again), headers=headers))
        # A repeated name is one field, its values in order: ["b", "a"] is not ["a", "b"].
        assert found == nothing_but(body=True, fields=["metadata[order]", "note", "tag"])


async def test_fields_left_out_of_the_fingerprint_are_not_compared(store_and_mode: tuple[Store, bool]) -> None:
    store, transactional = store_and_mode
    runs: Counter[str] = Counter()
    app = shop(store, transactional, runs, fingerprint_exclude={"sent_at", "client.attempt"})
    async with client_for(app) as client:
        headers = {"Idempotency-Key": f"stamped-{uuid.uuid4()}"}
        first = {**ORDER, "sent_at": 1, "client": {"attempt": 1, "sdk": "py"}}
        assert (await client.post("/v1/charges", json=first, headers=headers)).status_code == 201
        retry = {**first, "sent_at": 2, "client": {"attempt": 2, "sdk": "py"}}
        assert (await client.post("/v1/charges", json=retry, headers=headers)).headers["idempotent-replayed"] == "true"
        other = {**retry, "amount": 7, "sent_at": 3}
        assert changed(await client.post("/v1/charges", json=other, headers=headers)) == nothing_but(
            body=True, fields=["/amount"]
        )
    assert runs == Counter({"/v1/charges": 1})


async def stored_parts(store: Store, key: str, token: str = "sk_test_alice") -> bytes | None:
    record = await store.inspect(tenant_of(token), key)
    assert record is not None
    return record.parts


async def test_a_large_body_is_compared_by_member_then_as_a_whole_within_a_bound(
    store_and_mode: tuple[Store, bool],
) -> None:
    store, transactional = store_and_mode
    unique = uuid.uuid4().hex
    key_id = FingerprintKeys.parse(KEYS).current
    header = 8 + 2 + len(key_id) + 2 + 4 * 8  # binding, version and length, key id, mode and count, four parts
    async with client_for(shop(store, transactional, Counter())) as client:
        typical = {f"field_{i}": i for i in range(10)}  # what a typical JSON body costs: 16 bytes a field
        await client.post("/v1/charges", json=typical, headers={"Idempotency-Key": f"typical-{unique}"})
        assert len(await stored_parts(store, f"typical-{unique}") or b"") == header + 10 * 16

        widest = {f"field_{i}": i for i in range(MAX_FIELDS)}  # the most a record holds: 64 fields
        await client.post("/v1/charges", json=widest, headers={"Idempotency-Key": f"widest-{unique}"})
        largest = len(await stored_parts(store, f"widest-{unique}") or b"")
        assert largest == header + MAX_FIELDS * 16 < 1200

        # 1000 leaves: compared by top-level member (the metadata as one value), in 2 fields.
        metadata = {f"k{i}": f"v{i}" for i in range(1000)}
        nested = {"amount": 5, "metadata": metadata}
        headers = {"Idempotency-Key": f"nested-{unique}"}
        await client.post("/v1/charges", json=nested, headers=headers)
        assert len(await stored_parts(store, f"nested-{unique}") or b"") == header + 2 * 16
        one_more = {"amount": 5, "metadata": {**metadata, "k500": "changed"}}
        by_member = changed(await client.post("/v1/charges", json=one_more, headers=headers))
        assert by_member == nothing_but(body=True, fields=["/metadata"], compared="members")

        # 1000 top-level members: compared as a whole; the record holds the four parts alone.
        flat = {f"k{i}": i for i in range(1000)}
        headers = {"Idempotency-Key": f"flat-{unique}"}
        await client.post("/v1/charges", json=flat, headers=headers)
        assert len(await stored_parts(store, f"flat-{unique}") or b"") == header
        as_whole = changed(await client.post("/v1/charges", json={**flat, "k1": -1}, headers=headers))
        assert as_whole == nothing_but(body=True, compared="whole")


async def test_the_stored_parts_name_no_field_and_no_value(
    store_and_mode: tuple[Store, bool], idempotency_database_url: str
) -> None:
    """What the table holds of a request: keyed digests only. No name, no value, not even its unkeyed hash: a plain
    hash of an amount or a CVC is inverted by a dictionary by anyone who reads the table."""
    store, transactional = store_and_mode
    key = f"secret-{uuid.uuid4()}"
    order = {"amount": 424242, "card": {"cvc": "737", "holder": "Ada Lovelace"}, "memo": "birthday"}
    async with client_for(shop(store, transactional, Counter())) as client:
        assert (await client.post("/v1/charges", json=order, headers={"Idempotency-Key": key})).status_code == 201
    if isinstance(store, MemoryStore):
        raw = await stored_parts(store, key)
    else:  # as the database holds it, read by anyone with SELECT on the table
        connection = await asyncpg.connect(idempotency_database_url)
        try:
            raw = await connection.fetchval("SELECT request_parts FROM idempotency_records WHERE key = $1", key)
        finally:
            await connection.close()
    assert raw is not None
    for clear in ("amount", "424242", "card", "cvc", "737", "holder", "Ada", "memo", "birthday", "/card/cvc", "POST"):
        assert clear.encode() not in raw, clear
        assert clear.encode("utf-16-le") not in raw, clear
    own = parts_of(orjson.dumps(order))
    unkeyed = {digest[:8] for digest in (own.method, own.path, own.query, own.body)}
    unkeyed |= {digest[:8] for _, name, value in own.fields for digest in (name, value)}
    assert not any(digest in raw for digest in unkeyed)
    parts = read_parts(raw)
    assert parts is not None
    assert (parts.key_id, len(parts.fields)) == ("k1", 4)


async def test_a_record_without_parts_gets_the_plain_422(store_and_mode: tuple[Store, bool]) -> None:
    """A record written before this, or by a route that does not opt in, holds no parts (not a byte): a mismatch
    with it is the 422 of before. So is a mismatch on a route that does not opt in, with parts or without."""
    store, transactional = store_and_mode
    unique = uuid.uuid4().hex
    plain = "This Idempotency-Key was already used with a different request (method, path, query or body). Use a new key for a new request."  # noqa: E501
    async with (
        client_for(shop(store, transactional, Counter(), explain_mismatch=False)) as before,
        client_for(shop(store, transactional, Counter())) as after,
    ):
        written_before = {"Idempotency-Key": f"before-{unique}"}
        await before.post("/v1/charges", json=ORDER, headers=written_before)
        assert await stored_parts(store, f"before-{unique}") is None
        answer = await after.post("/v1/charges", json={**ORDER, "amount": 1}, headers=written_before)
        assert (answer.status_code, answer.json()["detail"]) == (422, plain)
        assert "changed" not in answer.json()

        quiet = {"Idempotency-Key": f"quiet-{unique}"}
        await after.post("/v1/quiet", json=ORDER, headers=quiet)  # @idempotent(explain_mismatch=False)
        assert await stored_parts(store, f"quiet-{unique}") is None
        assert "changed" not in (await after.post("/v1/quiet", json={}, headers=quiet)).json()

        explained = {"Idempotency-Key": f"explained-{unique}"}
        await after.post("/v1/charges", json=ORDER, headers=explained)
        assert await stored_parts(store, f"explained-{unique}") is not None
        elsewhere = await after.post("/v1/quiet", json=ORDER, headers=explained)  # the same key on a quiet route
        assert (elsewhere.status_code, elsewhere.json()["detail"]) == (422, plain)
        assert "changed" not in elsewhere.json()
        assert "changed" in (await after.post("/v1/refunds", json=ORDER, headers=explained)).json()


async def test_parts_under_a_key_no_longer_given_get_the_plain_422(store_and_mode: tuple[Store, bool]) -> None:
    store, transactional = store_and_mode
    old, new = "old:" + "o" * 32, "new:" + "n" * 32
    headers = {"Idempotency-Key": f"rotated-{uuid.uuid4()}"}
    async with client_for(shop(store, transactional, Counter(), fingerprint_keys=old)) as client:
        await client.post("/v1/charges", json=ORDER, headers=headers)
    async with client_for(shop(store, transactional, Counter(), fingerprint_keys=f"{new},{old}")) as client:
        rotating = await client.post("/v1/charges", json={**ORDER, "amount": 1}, headers=headers)
        assert changed(rotating) == nothing_but(body=True, fields=["/amount"])  # compared under the old key
    async with client_for(shop(store, transactional, Counter(), fingerprint_keys=new)) as client:
        dropped = await client.post("/v1/charges", json={**ORDER, "amount": 1}, headers=headers)
        assert (dropped.status_code, "changed" in dropped.json()) == (422, False)


async def test_parts_of_a_records_earlier_life_are_never_compared(pg_store: PostgresStore) -> None:
    """An instance of the previous version that takes an expired record over writes a new fingerprint and leaves the
    parts column alone: those parts describe another request, and a mismatch with the new one gets the plain 422."""
    runs: Counter[str] = Counter()
    headers = {"Idempotency-Key": f"relived-{uuid.uuid4()}"}
    async with client_for(shop(pg_store, False, runs)) as client:
        await client.post("/v1/charges", json=ORDER, headers=headers)
        async with pg_store.connection() as connection:  # the previous version's takeover, as its statement writes it
            await connection.execute(
                "UPDATE idempotency_records SET fingerprint = fingerprint || '\\x00'::bytea WHERE key = $1",
                headers["Idempotency-Key"],
            )
        assert await stored_parts(pg_store, headers["Idempotency-Key"]) is None  # inspect does not show them either
        answer = await client.post("/v1/charges", json={**ORDER, "amount": 1}, headers=headers)
        assert (answer.status_code, "changed" in answer.json()) == (422, False)


@pytest.fixture
async def sqlalchemy_store(idempotency_database_url: str) -> AsyncIterator[SQLAlchemyStore]:
    engine = create_async_engine(sqlalchemy_url(idempotency_database_url), pool_size=2, max_overflow=0)
    store = SQLAlchemyStore(PostgresStore(idempotency_database_url), engine)
    await store.open()
    try:
        yield store
    finally:
        await store.close(grace=0)
        await engine.dispose()


async def test_a_sqlalchemy_store_says_what_changed(sqlalchemy_store: SQLAlchemyStore) -> None:
    runs: Counter[str] = Counter()
    headers = {"Idempotency-Key": f"orm-{uuid.uuid4()}"}
    async with client_for(shop(sqlalchemy_store, True, runs)) as client:
        assert (await client.post("/v1/charges", json=ORDER, headers=headers)).status_code == 201
        moved = await client.post("/v1/charges?page=2", json={**ORDER, "currency": "usd"}, headers=headers)
        assert changed(moved) == nothing_but(query=True, body=True, fields=["/currency"])
    assert runs == Counter({"/v1/charges": 1})


# -- where callers share a namespace: refused at startup ------------------------------------------------------------


def explaining_app(**options: Any) -> Starlette:
    async def handle(request: Request) -> Response:
        return JSONResponse({}, status_code=201)

    app = Starlette(routes=[Route("/v1/charges", handle, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), **options)
    return app


@pytest.mark.parametrize(
    "tenant",
    [
        AuthorizationTenant(anonymous="public"),
        AuthorizationTenant(anonymous=""),  # the namespace of 0.1's requests without Authorization
        header_tenant("x-account-id", anonymous="guests"),
        CookieTenant("session", anonymous="visitors"),
        legacy_sha256_fallback(MemoryStore(), AuthorizationTenant(anonymous="public")),
    ],
    ids=["authorization", "empty", "header", "cookie", "legacy"],
)
def test_a_resolver_that_shares_a_namespace_is_refused(tenant: Any) -> None:
    with pytest.raises(ValueError, match="explain_mismatch cannot be combined with the tenant resolver") as refused:
        IdempotencyMiddleware(explaining_app(), MemoryStore(), tenant=tenant, explain_mismatch=True)
    assert "anonymous=" in str(refused.value)
    with pytest.raises(ValueError, match="explain_mismatch"):  # a route's own opt-in, by pattern
        IdempotencyMiddleware(
            explaining_app(), MemoryStore(), tenant=tenant, routes={"/v1/*": {"explain_mismatch": True}}
        )
    IdempotencyMiddleware(explaining_app(), MemoryStore(), tenant=tenant)  # without it, the resolver is fine


async def test_a_declared_route_that_explains_stops_a_shared_namespace_at_startup() -> None:
    @idempotent(explain_mismatch=True)
    async def handle(request: Request) -> Response:
        return JSONResponse({}, status_code=201)

    app = Starlette(routes=[Route("/v1/charges", handle, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), tenant=AuthorizationTenant(anonymous="public"))
    messages: list[Message] = []

    async def receive() -> Message:
        return {"type": "lifespan.startup"}

    async def send(message: Message) -> None:
        messages.append(message)

    await app({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send)
    assert messages[0]["type"] == "lifespan.startup.failed"
    assert "explain_mismatch cannot be combined with the tenant resolver" in messages[0]["message"]


def test_a_route_with_its_own_tenant_is_refused() -> None:
    """A route's own tenant is one namespace for all its callers (a provider's webhooks)."""
    with pytest.raises(ValueError, match="own tenant=") as refused:
        IdempotencyMiddleware(
            explaining_app(),
            MemoryStore(),
            explain_mismatch=True,
            routes={"/webhooks/*": {"tenant": lambda scope: "payments-provider"}},
        )
    assert "explain_mismatch=False on that route" in str(refused.value)
    with pytest.raises(ValueError, match="True or False"):
        IdempotencyMiddleware(explaining_app(), MemoryStore(), explain_mismatch="yes")  # type: ignore[arg-type]


# -- the parts themselves -------------------------------------------------------------------------------------------


def parts_of(body: bytes, content_type: bytes = b"application/json", keys: str = KEYS) -> Any:
    scope = http_scope("/v1/charges", "k")
    return request_parts(scope, content_type, body, frozenset(), FingerprintKeys.parse(keys), b"\0" * 40)


def differ(first: bytes, second: bytes, content_type: bytes = b"application/json") -> dict[str, Any] | None:
    found = explain(parts_of(second, content_type), parts_of(first, content_type).stored)
    return None if found is None else found.member()


def test_names_are_json_pointers_and_values_compare_as_the_fingerprint_reads_them() -> None:
    assert differ(b'{"a/b": 1, "m~n": 2}', b'{"a/b": 2, "m~n": 3}') == nothing_but(body=True, fields=["/a~1b", "/m~0n"])
    # An array's element is not an object's member of the same name, though their pointers read alike.
    assert differ(b'{"a": [1]}', b'{"a": {"0": 1}}') == nothing_but(body=True, fields=["/a/0"], missing_fields=1)
    assert differ(b'{"a": {}}', b'{"a": []}') == nothing_but(body=True, fields=["/a"])
    assert differ(b"5", b"6") == nothing_but(body=True, fields=[""])  # the whole document's pointer
    assert differ(b'{"n": 1e2}', b'{"n": 100.0}') is None  # one number to the fingerprint: nothing differs
    assert differ(b'{"n": 1}', b'{"n": 1.0}') == nothing_but(body=True, fields=["/n"])  # two to the fingerprint
    exact = b'{"n": 12345678901234567890.5}'  # read exactly, as the fingerprint reads it
    assert differ(exact, b'{"n": 12345678901234567890.50}') == nothing_but(body=True, fields=["/n"])
    assert differ(b"a=1&b=%FF", b"a=1&b=%FE", FORM.encode()) == nothing_but(body=True, fields=["b"])
    assert differ(b"a=1&%FF=2", b"a=1&%FF=3", FORM.encode()) == nothing_but(body=True, fields=["\ufffd"])


def test_parts_in_another_format_are_not_read() -> None:
    stored = parts_of(orjson.dumps(ORDER)).stored
    assert read_parts(stored) is not None
    for other in (b"", stored[:20], stored[:-1], stored[:8] + b"\x02" + stored[9:], stored + b"\0" * 16):
        assert read_parts(other) is None
        assert explain(parts_of(b"{}"), other) is None
    assert key_reused(changes=None).changed is None


def test_inspect_shows_that_parts_are_stored_and_nothing_of_them() -> None:
    stored = parts_of(orjson.dumps(ORDER)).stored
    shown = record_to_dict(_record(stored), now=0)
    assert shown["request_parts"] == {"key": "k1", "fields": 6, "body_compared": "fields", "bytes": len(stored)}
    text = format_record(shown)
    assert f"request parts  {len(stored)} bytes: method, path, query, body (6 fields), under key 'k1'" in text
    assert stored[-8:].hex() not in text
    assert record_to_dict(_record(None), now=0)["request_parts"] is None
    assert "request parts" not in format_record(record_to_dict(_record(None), now=0))


def _record(parts: bytes | None) -> RecordInfo:
    return RecordInfo("t", "k", "in_progress", 1, b"k1:" + b"\0" * 32, 0, 0.0, 1.0, 1.0, None, parts=parts)


async def test_openapi_documents_the_changed_member() -> None:
    app = FastAPI()

    @app.post("/v1/charges", status_code=201)
    @idempotent(explain_mismatch=True)
    async def create_charge() -> dict[str, str]:
        return {"id": "ch_1"}

    @app.post("/v1/payouts", status_code=201)
    async def create_payout() -> dict[str, str]:
        return {"id": "po_1"}

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    setup(app)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        schema = (await client.get("/openapi.json")).json()
    problem = schema["components"]["schemas"]["IdempotencyProblem"]
    assert "changed" not in problem["required"]  # only a reused key's, and only where a route explains it
    assert problem["properties"]["changed"]["required"] == [
        "method", "path", "query", "body", "fields", "missing_fields", "compared"
    ]  # fmt: skip
    assert problem["properties"]["changed"]["properties"]["compared"]["enum"] == ["fields", "members", "whole"]
    charges = schema["paths"]["/v1/charges"]["post"]["responses"]["422"]["description"]
    payouts = schema["paths"]["/v1/payouts"]["post"]["responses"]["422"]["description"]
    assert "changed member says what differs" in charges
    assert "changed member" not in payouts


async def test_the_answer_docs_semantics_shows_is_the_answer() -> None:
    text = (Path(__file__).parents[1] / "docs" / "semantics.md").read_text()
    start = text.index('```json\n{"type": "urn:idempotency-mw:problem:idempotency_key_reused"')
    documented = orjson.loads(text[start + len("```json") : text.index("```", start + 3)])
    async with client_for(shop(MemoryStore(), False, Counter())) as client:
        headers = {"Idempotency-Key": f"documented-{uuid.uuid4()}"}
        first = {"amount": 500, "currency": "eur", "customer": {"email": "ada@example.com"}}
        await client.post("/v1/charges", json=first, headers=headers)
        other = {"amount": 501, "customer": {"email": "bob@example.com"}}
        answer = await client.post("/v1/charges?expand=customer", json=other, headers=headers)
    assert answer.json() == documented


async def test_a_tenant_the_app_tells_gets_the_answer_too() -> None:
    """With the tenant from the app's own authentication (TenantDependency), the claim waits for it, and the 422
    that follows says what changed all the same."""
    calls: list[str] = []
    app = build_with_auth(MemoryStore(), calls, explain_mismatch=True)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        headers = {"Idempotency-Key": f"told-{uuid.uuid4()}", "X-API-Key": "key_alice"}
        assert (await client.post("/orders", json={"amount": 5}, headers=headers)).status_code == 201
        assert changed(await client.post("/orders", json={"amount": 6}, headers=headers)) == nothing_but(
            body=True, fields=["/amount"]
        )
        unauthenticated = await client.post("/orders", json={"amount": 6}, headers={**headers, "X-API-Key": "x"})
        assert unauthenticated.status_code == 401  # the app's answer first, as ever
    assert calls == ["acct_alice"]
