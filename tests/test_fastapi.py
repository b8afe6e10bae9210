"""idempotency_mw.fastapi: the transaction dependency, validation errors that free the key, and OpenAPI."""

from __future__ import annotations

import re
import uuid
from typing import Annotated, Any

import asyncpg
import httpx
import pytest
from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException
from hypothesis import example, given
from hypothesis import strategies as st
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.endpoints import HTTPEndpoint
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute
from starlette.types import Message
from starlette.websockets import WebSocket

from idempotency_mw import (
    Event,
    IdempotencyContext,
    IdempotencyMiddleware,
    MemoryStore,
    Outcome,
    PostgresStore,
    StoreUnavailable,
    header_tenant,
    idempotent,
)
from idempotency_mw._keys import InvalidKey, parse_key
from idempotency_mw._policy import RELEASED_STATUSES
from idempotency_mw._wire import ProblemCode
from idempotency_mw.fastapi import Idempotency, IdempotencyConnection, TenantDependency, setup
from tests.conftest import client_for

jsonschema_rs = pytest.importorskip("jsonschema_rs", reason="jsonschema_rs comes with schemathesis (the dev extra)")


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
    assert charge_key["schema"]["maxLength"] == 2 + 2 * 255  # a quoted 255-character key, every character escaped
    assert "pattern" in charge_key["schema"]  # what the parser accepts: tested below
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


def _replay_app(**policy: Any) -> FastAPI:
    """A payment that is declined (402, recorded) above 100, with answers documented in every class."""
    app = FastAPI()

    @app.post(
        "/v1/payments",
        status_code=201,
        responses={
            302: {"description": "Found"},
            307: {"description": "Temporary Redirect"},
            402: {"description": "Declined"},
            404: {"description": "Not Found"},
            429: {"description": "Too Many Requests"},
            500: {"description": "Server Error"},
            "4XX": {"description": "Other client errors"},
        },
    )
    @idempotent(**policy)
    async def pay(body: Charge) -> JSONResponse:
        if body.amount > 100:
            return JSONResponse({"declined": body.amount}, status_code=402)
        return JSONResponse({"paid": body.amount}, status_code=201)

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    setup(app)
    return app


def _replay_documented(app: FastAPI, header: str = "Idempotent-Replayed") -> set[str]:
    responses = app.openapi()["paths"]["/v1/payments"]["post"]["responses"]
    return {status for status, response in responses.items() if header in response.get("headers", {})}


@pytest.mark.parametrize("header", ["Idempotent-Replayed", "Idempotency-Expires"])
def test_the_replay_headers_are_documented_on_every_status_the_policy_records(header: str) -> None:
    # 302, 402 and 4XX are recorded, so a retry may get them replayed; 307, 404, 429 and 5xx are released, and the
    # middleware's own answers (400, 409, 413, 422, 503 here) are never recorded.
    assert _replay_documented(_replay_app(), header) == {"201", "302", "402", "4XX"}
    assert _replay_documented(_replay_app(released_statuses=RELEASED_STATUSES | {302, 402}), header) == {"201", "4XX"}


async def test_a_replayed_402_carries_the_replay_headers_it_is_documented_with() -> None:
    app = _replay_app()
    client = client_for(app)
    key = str(uuid.uuid4())
    first = await client.post("/v1/payments", json={"amount": 500}, headers={"Idempotency-Key": key})
    again = await client.post("/v1/payments", json={"amount": 500}, headers={"Idempotency-Key": key})
    assert (first.status_code, again.status_code) == (402, 402)
    assert "idempotent-replayed" not in first.headers
    assert again.headers["idempotent-replayed"] == "true"
    assert "402" in _replay_documented(app)
    documented = app.openapi()["paths"]["/v1/payments"]["post"]["responses"]["402"]["headers"]["Idempotency-Expires"]
    for answer in (first, again):  # the live answer and its replay, as the schema says
        assert re.fullmatch(documented["schema"]["pattern"], answer.headers["idempotency-expires"])


# -- the documented Idempotency-Key schema is the key the parser accepts -------------------------------------------


def _documented_key_schema() -> dict[str, Any]:
    schema = build(MemoryStore(), []).openapi()
    (parameter,) = [p for p in schema["paths"]["/v1/charges"]["post"]["parameters"] if p["name"] == "Idempotency-Key"]
    key_schema: dict[str, Any] = parameter["schema"]
    return key_schema


KEY_SCHEMA = _documented_key_schema()
KEY_VALIDATOR = jsonschema_rs.validator_for(KEY_SCHEMA)


def documented(value: str) -> bool:
    """Whether a header value is valid by the documented schema, read by a JSON Schema validator (ECMA 262 regex,
    as schemathesis and OpenAPI tools read it) and by Python's ``re``; the two must agree."""
    by_validator: bool = KEY_VALIDATOR.is_valid(value)
    pattern = KEY_SCHEMA.get("pattern")
    by_python = KEY_SCHEMA["minLength"] <= len(value) <= KEY_SCHEMA["maxLength"] and (
        pattern is None or re.fullmatch(pattern, value) is not None
    )
    assert by_validator == by_python, value
    return by_validator


def accepted(value: str) -> bool:
    try:
        parse_key(value.encode())
    except InvalidKey:
        return False
    return True


QUOTED_255 = '"' + "k" * 255 + '"'  # 257 characters as sent, a 255-character key
ESCAPED_255 = '"' + '\\"' * 255 + '"'  # 512 characters as sent, the longest value a key can take


@pytest.mark.parametrize(
    "value",
    [
        "a b",
        "a,b",
        '"abc',
        '""',
        QUOTED_255,
        ESCAPED_255,
        '"' + "k" * 256 + '"',
        "k" * 255,
        "k" * 256,
        '"a,b"',
        '"a b"',
        'a"b',
        '"a\\nb"',
        "a\tb",
        "8e03978e-40d5-43e8-bc93-6894a57f9324",
    ],
)
def test_documented_key_schema_matches_the_parser_on_known_cases(value: str) -> None:
    assert documented(value) == accepted(value)


# Every character class the parser tells apart: visible ASCII, the quote, the backslash, the comma, space and tab,
# control characters, DEL and beyond ASCII.
_CHARACTERS = st.one_of(
    st.characters(min_codepoint=0x21, max_codepoint=0x7E),
    st.sampled_from(['"', "\\", ",", " ", "\t", "\x00", "\x1f", "\x7f", "\xe9", "\u2028"]),
)
_BARE = st.text(_CHARACTERS, max_size=300)
# Quoted values with escapes, sized around the limit (255 characters once unquoted).
_QUOTED = st.lists(st.one_of(_CHARACTERS, st.sampled_from(['\\"', "\\\\", "\\n"])), min_size=0, max_size=260).map(
    lambda parts: '"' + "".join(parts) + '"'
)
_LONG = st.integers(min_value=250, max_value=260).map(lambda n: "k" * n) | st.integers(250, 260).map(
    lambda n: '"' + "k" * n + '"'
)
# A field value has no leading or trailing whitespace (RFC 9110 §5.5): HTTP strips it before anyone sees it.
_FIELD_VALUES = st.one_of(_BARE, _QUOTED, _LONG).map(lambda value: value.strip(" \t"))


@given(_FIELD_VALUES)
@example(QUOTED_255)
@example(ESCAPED_255)
def test_a_value_matches_the_documented_key_schema_iff_the_parser_accepts_it(value: str) -> None:
    assert documented(value) == accepted(value)


@given(_FIELD_VALUES, st.sampled_from(["", " ", "\t", " \t "]), st.sampled_from(["", " ", "\t"]))
def test_whitespace_around_the_value_changes_nothing(value: str, before: str, after: str) -> None:
    """The schema describes the field value; the whitespace HTTP allows around it is not part of it, and the parser
    ignores it as HTTP does."""
    padded = (before + value + after).encode()
    if accepted(value):
        assert parse_key(padded) == parse_key(value.encode())
    else:
        with pytest.raises(InvalidKey):
            parse_key(padded)


# -- the tenant from the app's own authentication dependency ---------------------------------------------------

ACCOUNTS = {"key_alice": "acct_alice", "key_bob": "acct_bob"}


async def current_account(x_api_key: Annotated[str | None, Header()] = None) -> str:
    """The app's authentication, as a dependency: an API key in X-API-Key, or 401."""
    account = ACCOUNTS.get(x_api_key or "")
    if account is None:
        raise HTTPException(401, "invalid API key")
    return account


def build_with_auth(store: Any, calls: list[str], **options: Any) -> FastAPI:
    tenant = TenantDependency(current_account)
    app = FastAPI(dependencies=[Depends(tenant)])

    @app.post("/orders", status_code=201)
    async def order(body: Charge, account: Annotated[str, Depends(current_account)], info: Idempotency) -> Any:
        calls.append(account)
        return {"account": account, "amount": body.amount, "tenant": info.tenant}

    if isinstance(store, PostgresStore):

        @app.post("/refunds", status_code=201)
        @idempotent(required=True, transactional=True)
        async def refund(body: Charge, db: IdempotencyConnection) -> dict[str, Any]:
            await db.execute("CREATE TABLE IF NOT EXISTS fastapi_auth_refunds (amount int)")
            await db.execute("INSERT INTO fastapi_auth_refunds VALUES ($1)", body.amount)
            calls.append("refund")
            return {"refunded": body.amount}

    else:

        @app.post("/refunds", status_code=201)
        @idempotent(required=True)
        async def refund_plainly(body: Charge) -> dict[str, Any]:
            calls.append("refund")
            return {"refunded": body.amount}

    app.add_middleware(IdempotencyMiddleware, store=store, tenant=tenant, **options)
    setup(app)
    return app


def as_account(app: FastAPI, api_key: str | None) -> httpx.AsyncClient:
    client = client_for(app)
    del client.headers["Authorization"]
    if api_key is not None:
        client.headers["X-API-Key"] = api_key
    return client


@pytest.mark.parametrize("idempotency_key", [str(uuid.uuid4()), "not a key", None], ids=["key", "not-a-key", "none"])
async def test_the_apps_own_authentication_answers_first(store: Any, idempotency_key: str | None) -> None:
    """A bad API key gets the app's 401, whatever its Idempotency-Key (none on a route that requires one, or a
    malformed one): the middleware answers only once the app's authentication has."""
    calls: list[str] = []
    client = as_account(build_with_auth(store, calls), "key_mallory")
    headers = {} if idempotency_key is None else {"Idempotency-Key": idempotency_key}
    for path in ("/orders", "/refunds"):
        answer = await client.post(path, json={"amount": 1}, headers=headers)
        assert (answer.status_code, answer.json()) == (401, {"detail": "invalid API key"})
    assert calls == []


async def test_keys_are_scoped_by_the_account_the_dependency_resolved(store: Any) -> None:
    calls: list[str] = []
    app = build_with_auth(store, calls)
    key = str(uuid.uuid4())
    alice, bob = as_account(app, "key_alice"), as_account(app, "key_bob")
    first = await alice.post("/orders", json={"amount": 5}, headers={"Idempotency-Key": key})
    again = await alice.post("/orders", json={"amount": 5}, headers={"Idempotency-Key": key})
    other = await bob.post("/orders", json={"amount": 5}, headers={"Idempotency-Key": key})
    assert (first.status_code, first.json()["tenant"]) == (201, "acct_alice")
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert (other.status_code, other.json()["tenant"], "idempotent-replayed" in other.headers) == (
        201,
        "acct_bob",
        False,
    )
    assert calls == ["acct_alice", "acct_bob"]
    assert (await alice.post("/orders", json={"amount": 6}, headers={"Idempotency-Key": key})).status_code == 422


async def test_after_authentication_the_middleware_refuses_as_usual(store: Any) -> None:
    calls: list[str] = []
    client = as_account(build_with_auth(store, calls), "key_alice")
    invalid = await client.post("/orders", json={"amount": 1}, headers={"Idempotency-Key": "not a key"})
    assert (invalid.status_code, invalid.json()["code"]) == (400, "idempotency_key_invalid")
    missing = await client.post("/refunds", json={"amount": 1})
    assert (missing.status_code, missing.json()["code"]) == (400, "idempotency_key_missing")
    assert calls == []


async def test_a_transactional_route_claims_after_authentication(pg_store: PostgresStore) -> None:
    calls: list[str] = []
    client = as_account(build_with_auth(pg_store, calls), "key_alice")
    key = str(uuid.uuid4())
    for _ in range(2):
        answer = await client.post("/refunds", json={"amount": 7}, headers={"Idempotency-Key": key})
        assert answer.status_code == 201
    assert calls == ["refund"]
    info = await pg_store.inspect("acct_alice", key)
    assert info is not None
    assert info.state == "completed"


@pytest.mark.parametrize("mode", [{}, {"observe": True}, {"enabled": False}], ids=["enforcing", "observing", "off"])
@pytest.mark.parametrize("tenant_from_app", [False, True], ids=["resolver", "tenant dependency"])
async def test_a_keyless_request_gets_a_context_without_a_key_in_every_mode(
    mode: dict[str, Any], tenant_from_app: bool
) -> None:
    """On a route where keys are optional, a request without one runs with a context whose key is None, as when
    observing or switched off: the handler that reads it works in every mode. (Enforcing, it got none: the
    ``Idempotency`` dependency answered 500.)"""
    calls: list[str | None] = []
    tenant = TenantDependency(current_account)
    app = FastAPI(dependencies=[Depends(tenant)] if tenant_from_app else [])

    @app.post("/orders", status_code=201)
    async def order(body: Charge, info: Idempotency) -> Any:
        calls.append(info.key)
        with pytest.raises(LookupError):
            info.downstream_key("psp-charge")
        return {"key": info.key}

    options: dict[str, Any] = {"tenant": tenant} if tenant_from_app else {"tenant": header_tenant("X-API-Key")}
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), **options, **mode)
    setup(app)
    answer = await as_account(app, "key_alice").post("/orders", json={"amount": 5})
    assert (answer.status_code, answer.json()) == (201, {"key": None})
    assert calls == [None]


class SetUpWrong(MemoryStore):
    """A store that says it is set up wrong at every claim (SQLAlchemyStore on an engine in AUTOCOMMIT)."""

    async def claim(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("the engine is in AUTOCOMMIT")


async def test_a_store_set_up_wrong_reaches_the_apps_own_error_handler() -> None:
    """With the tenant told by the app, the store's error is raised inside the app, whose handler for it answers:
    that answer goes out, and the request is reported once. (Reported, the request counted as answered, and the
    middleware dropped the app's answer: the client got nothing.)"""
    events: list[Event] = []
    tenant = TenantDependency(current_account)
    app = FastAPI(dependencies=[Depends(tenant)])

    @app.exception_handler(ValueError)
    async def value_error(request: Any, error: ValueError) -> JSONResponse:
        return JSONResponse({"error": str(error)}, status_code=400)

    @app.post("/orders", status_code=201)
    async def order() -> dict[str, str]:
        return {}

    app.add_middleware(IdempotencyMiddleware, store=SetUpWrong(), tenant=tenant, on_event=events.append)
    answer = await as_account(app, "key_alice").post("/orders", headers={"Idempotency-Key": str(uuid.uuid4())})
    assert (answer.status_code, answer.json()) == (400, {"error": "the engine is in AUTOCOMMIT"})
    assert [event.outcome for event in events] == [Outcome.STORE_ERROR]


class DownStore(MemoryStore):
    """A store that cannot be reached: every claim fails as PostgresStore's does when its server is gone."""

    async def claim(self, *args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailable("connection refused")


@pytest.mark.parametrize("tenant_from_app", [False, True], ids=["resolver", "tenant dependency"])
async def test_failing_open_runs_the_handler_once_with_its_context(tenant_from_app: bool) -> None:
    """``fail_open`` with the store down: the handler runs, once, and its context is there, with the tenant and key
    it would have had, so that ``downstream_key`` still gives the provider its usual key. (Before: the context was
    missing, and a route that reads it failed with 500; with the tenant told by the app, the middleware ran the app
    again from inside its own dependency.)"""
    calls: list[str] = []
    events: list[Event] = []
    tenant = TenantDependency(current_account)
    app = FastAPI(dependencies=[Depends(tenant)] if tenant_from_app else [])

    @app.post("/orders", status_code=201)
    async def order(body: Charge, info: Idempotency) -> Any:
        calls.append(info.tenant)
        return {"tenant": info.tenant, "key": info.key, "psp": info.downstream_key("psp-charge")}

    options: dict[str, Any] = {"tenant": tenant} if tenant_from_app else {"tenant": header_tenant("X-API-Key")}
    app.add_middleware(IdempotencyMiddleware, store=DownStore(), fail_open=True, on_event=events.append, **options)
    setup(app)
    key = str(uuid.uuid4())
    answer = await as_account(app, "key_alice").post("/orders", json={"amount": 5}, headers={"Idempotency-Key": key})
    told = "acct_alice" if tenant_from_app else "key_alice"
    assert answer.status_code == 201
    usual = IdempotencyContext(told, key).downstream_key("psp-charge")  # what the handler gets, the store up
    assert answer.json() == {"tenant": told, "key": key, "psp": usual}
    assert "idempotent-replayed" not in answer.headers
    assert calls == [told]
    assert [(event.outcome, event.status, event.tenant) for event in events] == [(Outcome.UNPROTECTED, 201, told)]


async def test_switched_off_the_tenant_dependency_and_the_transaction_still_work(store: Any) -> None:
    """``enabled=False``: the app's authentication still answers first (401), and after it every route runs as
    without the middleware: a keyed order runs each time it is sent, a route that requires a key runs without one,
    a transactional route gets its connection, and the handler's context has the tenant the app told."""
    calls: list[str] = []
    app = build_with_auth(store, calls, enabled=False)
    assert (await as_account(app, "key_mallory").post("/orders", json={"amount": 1})).status_code == 401
    client = as_account(app, "key_alice")
    key = str(uuid.uuid4())
    for _ in range(2):
        order = await client.post("/orders", json={"amount": 5}, headers={"Idempotency-Key": key})
        assert (order.status_code, order.json()["tenant"], "idempotent-replayed" in order.headers) == (
            201,
            "acct_alice",
            False,
        )
    refund = await client.post("/refunds", json={"amount": 7})
    assert (refund.status_code, refund.json()) == (201, {"refunded": 7})
    assert calls == ["acct_alice", "acct_alice", "refund"]
    assert await store.inspect("acct_alice", key) is None


async def test_a_covered_route_without_the_tenant_dependency_stops_the_startup(store: Any) -> None:
    tenant = TenantDependency(current_account)
    app = FastAPI()

    @app.post("/orders")
    async def order() -> dict[str, str]:
        return {}

    @app.get("/orders")
    async def orders() -> list[str]:
        return []

    app.add_middleware(IdempotencyMiddleware, store=store, tenant=tenant)
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "lifespan.startup"}

    async def send(message: Message) -> None:
        sent.append(message)

    await app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)
    (failed,) = sent
    assert failed["type"] == "lifespan.startup.failed"
    assert re.search(r"do not depend on.*: POST /orders\. Add Depends\(tenant\)", failed["message"])


async def startup_failure(app: Any) -> str | None:
    """The message of the app's lifespan.startup.failed, or None when it started."""
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "lifespan.startup"} if not sent else {"type": "lifespan.shutdown"}

    async def send(message: Message) -> None:
        sent.append(message)

    await app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)
    return sent[0].get("message") if sent[0]["type"] == "lifespan.startup.failed" else None


@pytest.mark.parametrize("where", ["add_route", "mounted app", "mounted FastAPI app"])
async def test_a_covered_route_that_cannot_depend_on_the_tenant_stops_the_startup(where: str) -> None:
    """A route that is not a path operation of the app (``app.add_route``, a mounted app's routes) has no dependencies
    of the app's: its keyed requests would never be claimed, every retry running the handler again with no event.
    (The check saw only the app's own path operations.) Declared with the tenant dependency, a mounted FastAPI app's
    routes start."""
    tenant = TenantDependency(current_account)
    app = FastAPI(dependencies=[Depends(tenant)])

    @app.post("/v1/charges")
    async def charge() -> dict[str, str]:
        return {}

    async def legacy(request: Any) -> JSONResponse:
        return JSONResponse({}, status_code=201)

    if where == "add_route":
        app.add_route("/v1/legacy-charges", legacy, methods=["POST"])
        named = "POST /v1/legacy-charges"
    elif where == "mounted app":
        app.mount("/v0", Starlette(routes=[Route("/charges", legacy, methods=["POST"])]))
        named = "POST /v0/charges"
    else:
        inner = FastAPI()

        @inner.post("/refunds")
        async def refund() -> dict[str, str]:
            return {}

        app.mount("/v2", inner)
        named = "POST /v2/refunds"
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), tenant=tenant)
    message = await startup_failure(app)
    assert message is not None
    assert re.search(rf"do not depend on.*: {re.escape(named)}\. Add Depends\(tenant\)", message)
    if where == "mounted FastAPI app":  # told the tenant, the mounted app's route starts
        told = FastAPI(dependencies=[Depends(tenant)])
        told.post("/refunds")(refund)
        app = FastAPI(dependencies=[Depends(tenant)])
        app.mount("/v2", told)
        app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), tenant=tenant)
        assert await startup_failure(app) is None


async def test_a_keyed_request_a_mounted_app_answers_unclaimed_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A plain ASGI app mounted under an app that tells its tenant has no route table to check at startup (a
    ``StaticFiles`` mount is the usual one, and must not stop the app): a keyed request it answers with a final
    status ran unclaimed, and the operator hears it, once."""
    tenant = TenantDependency(current_account)
    app = FastAPI(dependencies=[Depends(tenant)])
    app.mount("/raw", JSONResponse({"charged": True}, status_code=201))
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), tenant=tenant)
    client = as_account(app, "key_alice")
    with caplog.at_level("WARNING", logger="idempotency_mw"):
        for _ in range(2):
            answer = await client.post("/raw/charges", headers={"Idempotency-Key": str(uuid.uuid4())})
            assert answer.status_code == 201
    told = [r.getMessage() for r in caplog.records if "never told its tenant" in r.getMessage()]
    assert len(told) == 1
    assert told[0].startswith("idempotency: a keyed request to POST /raw/")


class Health(HTTPEndpoint):
    async def get(self, request: Any) -> JSONResponse:
        return JSONResponse({"ok": True})


async def live(websocket: WebSocket) -> None:
    await websocket.accept()
    await websocket.close()


@pytest.mark.parametrize("where", ["websocket", "mounted websocket", "GET-only endpoint class"])
async def test_routes_the_middleware_never_covers_pass_the_tenant_check(where: str) -> None:
    """A websocket route (the middleware lets every websocket through) and a class endpoint that answers GET alone
    take no keyed request to claim: the app starts. (The check counted them as covered, any method, and refused.)"""
    tenant = TenantDependency(current_account)
    app = FastAPI(dependencies=[Depends(tenant)])
    if where == "websocket":
        app.router.routes.append(WebSocketRoute("/ws", live))
    elif where == "mounted websocket":
        app.mount("/live", Starlette(routes=[WebSocketRoute("/feed", live)]))
    else:
        app.mount("/admin", Starlette(routes=[Route("/health", Health)]))
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), tenant=tenant)
    assert await startup_failure(app) is None


@pytest.mark.parametrize(
    ("resolver", "detail"),
    [
        (header_tenant("X-Account"), "exactly one X-Account header"),
        (lambda scope: None, "the credentials this API expects"),
    ],
)
async def test_an_unknown_tenant_is_explained_in_the_words_of_the_resolver_configured(
    caplog: pytest.LogCaptureFixture, resolver: Any, detail: str
) -> None:
    app = FastAPI()

    @app.post("/orders")
    async def order() -> dict[str, str]:
        return {}

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), tenant=resolver)
    with caplog.at_level("WARNING", logger="idempotency_mw"):
        answer = await client_for(app).post("/orders", headers={"Idempotency-Key": "k"})
    assert answer.status_code == 400
    assert answer.json()["detail"].endswith(f"Send it with {detail}.")
    (logged,) = [record.getMessage() for record in caplog.records]
    assert repr(resolver) in logged
    assert "Authorization" not in logged
