"""Observe only (``observe=True``, ``_observing.py``): every request runs and is answered byte for byte as by the same
app without the middleware, while its event says what enforcing would have done; on every store and in both modes.
A store that fails and a body over the cap proceed and are reported, a duplicate is never blocked, the record stays
out of the handler's transaction, and a route flipped to enforcing replays what observing recorded."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import socket
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message

from idempotency_mw import Event, IdempotencyMiddleware, MemoryStore, Outcome, PostgresStore, idempotent
from idempotency_mw import idempotency_context as context_of
from idempotency_mw.fastapi import setup
from idempotency_mw.sqlalchemy import SQLAlchemyStore, idempotency_session
from idempotency_mw.store import Store
from tests.apps import Registry
from tests.conftest import client_for, opened, tenant_of
from tests.orm import SCHEMA, Effect, create_tables, sqlalchemy_url
from tests.test_cycles import app_on, call, left_to_the_collector, warmed_up
from tests.test_docs import recipe
from tests.test_fastapi import as_account, build_with_auth
from tests.test_telemetry import Traced

UUID_KEYS = "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
EFFECTS = "CREATE TABLE IF NOT EXISTS observe_effects (id bigserial PRIMARY KEY, key text, note text)"


class Shop:
    """The handlers of the apps under test, whose answers depend on the request alone: an app with the middleware and
    the same app without it answer byte for byte alike. Each run is noted (with the body it read whole), a run can be
    held on cue, and a transactional route writes its effect through the transaction it was lent."""

    def __init__(self) -> None:
        self.runs: list[tuple[str, int]] = []  # (path, bytes of the body the handler read)
        self.transactions: list[bool] = []  # whether a run had its transaction
        self.holding = False
        self.hold = asyncio.Event()
        self.held = asyncio.Event()

    def app(self, **middleware: Any) -> Starlette:
        """The app; with the middleware when ``middleware`` gives its settings."""

        async def charge(request: Request) -> Response:
            body = await request.body()
            self.runs.append((request.url.path, len(body)))
            context = context_of(request)
            self.transactions.append(context is not None and context.transaction is not None)
            if context is not None and context.connection is not None:
                await context.connection.execute(
                    "INSERT INTO observe_effects (key, note) VALUES ($1, $2)", context.key, body[:40].decode()
                )
            if self.holding:  # the first run from now on waits for the test
                self.holding = False
                self.held.set()
                await self.hold.wait()
            answer = {"size": len(body), "digest": hashlib.sha256(body).hexdigest()}
            response = JSONResponse(answer, status_code=int(request.query_params.get("status", "201")))
            response.raw_headers += [(b"set-cookie", b"a=1; Path=/"), (b"x-between", b"2"), (b"set-cookie", b"b=2")]
            return response

        @idempotent(required=True, key_format=UUID_KEYS)
        async def payout(request: Request) -> Response:
            return await charge(request)

        app = Starlette(
            routes=[Route("/v1/charges", charge, methods=["POST"]), Route("/v1/payouts", payout, methods=["POST"])]
        )
        if not middleware:
            return app
        app.add_middleware(IdempotencyMiddleware, **{"max_request_bytes": 1024, **middleware})
        return app


def answer(response: httpx.Response) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """All a client can see of a response: its status, its header list (order and repeats) and its body."""
    return response.status_code, list(response.headers.raw), response.content


async def chunks(size: int) -> AsyncIterator[bytes]:
    """A body sent without a Content-Length (chunked), ``size`` bytes in chunks of 100."""
    for start in range(0, size, 100):
        yield bytes([65 + start // 100 % 26]) * min(100, size - start)


async def effects(url: str, key: str) -> int:
    connection = await asyncpg.connect(url)
    try:
        return int(await connection.fetchval("SELECT count(*) FROM observe_effects WHERE key = $1", key))
    finally:
        await connection.close()


@pytest.fixture
async def effects_table(idempotency_database_url: str) -> str:
    connection = await asyncpg.connect(idempotency_database_url)
    try:
        await connection.execute(EFFECTS)
    finally:
        await connection.close()
    return idempotency_database_url


async def test_observing_answers_as_without_the_middleware_and_reports_what_enforcing_would_do(
    store_and_mode: tuple[Store, bool], effects_table: str
) -> None:
    store, transactional = store_and_mode
    shop, bare = Shop(), Shop()
    events: list[Event] = []
    app = shop.app(store=store, transactional=transactional, observe=True, on_event=events.append)
    key, other = str(uuid.uuid4()), str(uuid.uuid4())
    requests: list[tuple[str, dict[str, Any], Outcome | None]] = [
        ("/v1/charges", {"json": {"amount": 5}, "headers": {"Idempotency-Key": key}}, Outcome.EXECUTED),
        ("/v1/charges", {"json": {"amount": 5}, "headers": {"Idempotency-Key": key}}, Outcome.REPLAYED),
        ("/v1/charges", {"json": {"amount": 6}, "headers": {"Idempotency-Key": key}}, Outcome.KEY_REUSED),
        (
            "/v1/charges",
            {"json": {}, "headers": {"Idempotency-Key": other, "Authorization": ""}},
            Outcome.TENANT_UNKNOWN,
        ),
        ("/v1/charges", {"json": {}, "headers": {"Idempotency-Key": "bad key"}}, Outcome.KEY_INVALID),
        ("/v1/payouts", {"json": {"amount": 7}}, Outcome.KEY_MISSING),
        ("/v1/payouts", {"json": {"amount": 7}, "headers": {"Idempotency-Key": f"order-{key}"}}, Outcome.KEY_INVALID),
        ("/v1/charges", {"content": b"x" * 5000, "headers": {"Idempotency-Key": other}}, Outcome.REQUEST_TOO_LARGE),
        ("/v1/charges", {"content": chunks(5000), "headers": {"Idempotency-Key": other}}, Outcome.REQUEST_TOO_LARGE),
        ("/v1/charges?status=500", {"json": {}, "headers": {"Idempotency-Key": other}}, Outcome.RELEASED),
        ("/v1/charges?status=402", {"json": {}, "headers": {"Idempotency-Key": other}}, Outcome.EXECUTED),
        ("/v1/charges", {"json": {"amount": 8}}, None),  # no key, none required: no event, as when enforcing
    ]
    async with client_for(app) as observed, client_for(bare.app()) as without:
        first = answer(await without.post("/v1/charges", json={"amount": 5}))
        bare.runs.clear()
        for path, request, _ in requests:
            streamed = request.get("content")
            if streamed is not None and not isinstance(streamed, bytes):  # a stream is read once: one per app
                seen = await observed.post(path, **{**request, "content": chunks(5000)})
                unseen = await without.post(path, **{**request, "content": chunks(5000)})
            else:
                seen, unseen = await observed.post(path, **request), await without.post(path, **request)
            assert answer(seen) == answer(unseen), path
            assert "idempotent-replayed" not in seen.headers
    assert shop.runs == bare.runs  # every handler ran, with every byte of its body (5000 over a cap of 1024)
    assert ("/v1/charges", 5000) in shop.runs
    expected = [outcome for _, _, outcome in requests if outcome is not None]
    assert [event.outcome for event in events] == expected
    assert all(event.observed for event in events)
    assert [event.status for event in events] == [201] * 9 + [500, 402]  # the statuses that went out
    assert shop.transactions == [transactional] * len(requests)  # a transactional handler had its transaction
    if transactional:  # it committed its effect each time its answer was final (not with the 500)
        assert await effects(effects_table, key) == 3
        assert await effects(effects_table, other) == 3

    info = await store.inspect(tenant_of(), key)
    assert info is not None
    assert (info.state, info.attempts) == ("completed", 1)  # the would-422 counted, as enforcing counts it
    other_info = await store.inspect(tenant_of(), other)
    assert other_info is not None
    assert other_info.response is not None
    assert other_info.response.status == 402  # the 500 released the key; the 402 is final

    shop.runs.clear()
    enforcing = shop.app(store=store, transactional=transactional, observe=False)
    async with client_for(enforcing) as client:  # the route enforces: what observing recorded replays
        replay = await client.post("/v1/charges", json={"amount": 5}, headers={"Idempotency-Key": key})
        refused = await client.post("/v1/charges", json={"amount": 6}, headers={"Idempotency-Key": key})
    assert replay.headers["idempotent-replayed"] == "true"
    assert (replay.status_code, replay.content) == (first[0], first[2])
    assert refused.json()["code"] == "idempotency_key_reused"
    assert shop.runs == []


async def test_a_duplicate_while_the_original_runs_is_not_blocked(
    store_and_mode: tuple[Store, bool], effects_table: str
) -> None:
    """Enforcing would answer 409 (or, with ``on_conflict="wait"``, wait for the original): observing runs the
    duplicate at once, and says so."""
    store, transactional = store_and_mode
    shop, events = Shop(), list[Event]()
    app = shop.app(store=store, transactional=transactional, observe=True, on_event=events.append, on_conflict="wait")
    key = str(uuid.uuid4())
    headers = {"Idempotency-Key": key}
    async with client_for(app) as client:
        shop.holding = True
        original = asyncio.create_task(client.post("/v1/charges", json={"amount": 5}, headers=headers))
        await asyncio.wait_for(shop.held.wait(), 10)
        duplicate = await asyncio.wait_for(client.post("/v1/charges", json={"amount": 5}, headers=headers), 10)
        assert not original.done()  # the original still runs, and the duplicate has its answer
        shop.hold.set()
        first = await original
    assert (first.status_code, duplicate.status_code) == (201, 201)
    assert [(e.outcome, e.observed) for e in events] == [(Outcome.IN_PROGRESS, True), (Outcome.EXECUTED, True)]
    assert len(shop.runs) == 2
    if transactional:
        assert await effects(effects_table, key) == 2
    async with client_for(shop.app(store=store, transactional=transactional)) as client:
        replay = await client.post("/v1/charges", json={"amount": 5}, headers=headers)
    assert (replay.headers["idempotent-replayed"], replay.content) == ("true", first.content)


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


async def test_a_store_that_cannot_be_reached_is_reported_and_the_request_proceeds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dead = PostgresStore(f"postgresql://nobody@127.0.0.1:{closed_port()}/none", timeout=1)
    shop, bare, events = Shop(), Shop(), list[Event]()
    app = shop.app(store=dead, observe=True, on_event=events.append, routes={"/v1/charges": {"fail_open": True}})
    headers = {"Idempotency-Key": str(uuid.uuid4())}
    with caplog.at_level(logging.ERROR, logger="idempotency_mw"):
        async with client_for(app) as observed, client_for(bare.app()) as without:
            for path in ("/v1/payouts", "/v1/payouts", "/v1/charges"):
                seen = await observed.post(path, json={"amount": 5}, headers=headers)
                unseen = await without.post(path, json={"amount": 5}, headers=headers)
                assert answer(seen) == answer(unseen)
    assert [(e.outcome, e.observed, e.status) for e in events] == [
        (Outcome.STORE_ERROR, True, 201),
        (Outcome.STORE_ERROR, True, 201),
        (Outcome.UNPROTECTED, True, 201),  # a route that fails open would have run without a record
    ]
    assert len(shop.runs) == 3
    failures = [r for r in caplog.records if "store failed to claim a key" in r.getMessage()]
    assert len(failures) == 1  # once per outage, as when enforcing


async def test_a_claim_that_fails_leaves_a_transactional_handler_its_transaction(migrated_url: str) -> None:
    """The store's tables gone (the database up): the claim fails, is reported, and the handler still runs in its
    transaction, which commits."""
    connection = await asyncpg.connect(migrated_url)
    try:
        await connection.execute(EFFECTS)
        async with opened(PostgresStore(migrated_url)) as store:
            await connection.execute(
                "DROP TABLE idempotency_recovery_points, idempotency_responses, idempotency_records"
            )
            shop, events = Shop(), list[Event]()
            app = shop.app(store=store, transactional=True, observe=True, on_event=events.append)
            key = str(uuid.uuid4())
            async with client_for(app) as client:
                response = await client.post("/v1/charges", json={"amount": 5}, headers={"Idempotency-Key": key})
        written = await connection.fetchval("SELECT count(*) FROM observe_effects WHERE key = $1", key)
    finally:
        await connection.close()
    assert response.status_code == 201
    assert [(e.outcome, e.observed) for e in events] == [(Outcome.STORE_ERROR, True)]
    assert (shop.transactions, written) == ([True], 1)


async def test_the_record_is_not_written_in_the_handlers_transaction(
    pg_store: PostgresStore, effects_table: str
) -> None:
    """Enforcing, the completion commits with the handler's writes (one transaction: the same xmin); observing, it is
    written on the store's own connection after the handler's transaction committed (another one)."""
    shop = Shop()
    xmins = {}
    for observe in (False, True):
        key = str(uuid.uuid4())
        async with client_for(shop.app(store=pg_store, transactional=True, observe=observe)) as client:
            assert (await client.post("/v1/charges", json={}, headers={"Idempotency-Key": key})).status_code == 201
        connection = await asyncpg.connect(effects_table)
        try:
            effect = await connection.fetchval("SELECT xmin::text FROM observe_effects WHERE key = $1", key)
            record = await connection.fetchval(
                "SELECT xmin::text FROM idempotency_responses WHERE tenant = $1 AND key = $2", tenant_of(), key
            )
        finally:
            await connection.close()
        xmins[observe] = (effect, record)
    assert xmins[False][0] == xmins[False][1]
    assert xmins[True][0] != xmins[True][1]


@pytest.fixture
async def sqla_store(idempotency_database_url: str) -> AsyncIterator[SQLAlchemyStore]:
    await create_tables(idempotency_database_url)
    engine: AsyncEngine = create_async_engine(sqlalchemy_url(idempotency_database_url), pool_size=5, max_overflow=0)
    store = SQLAlchemyStore(PostgresStore(idempotency_database_url), engine)
    await store.open()
    try:
        yield store
    finally:
        await store.close(grace=0)
        await engine.dispose()


async def test_a_sqlalchemy_session_is_lent_while_observing(
    sqla_store: SQLAlchemyStore, idempotency_database_url: str
) -> None:
    async def write(request: Request) -> Response:
        session = idempotency_session(request)
        body = await request.body()
        session.add(Effect(key=request.headers["idempotency-key"], note=body.decode()))
        return JSONResponse({"written": body.decode()}, status_code=201)

    events: list[Event] = []
    app = Starlette(routes=[Route("/write", write, methods=["POST"])])
    app.add_middleware(
        IdempotencyMiddleware, store=sqla_store, transactional=True, observe=True, on_event=events.append
    )
    key = str(uuid.uuid4())
    async with client_for(app) as client:
        answers = [await client.post("/write", content=b"note", headers={"Idempotency-Key": key}) for _ in range(2)]
    assert [a.status_code for a in answers] == [201, 201]
    assert [e.outcome for e in events] == [Outcome.EXECUTED, Outcome.REPLAYED]
    connection = await asyncpg.connect(idempotency_database_url)
    try:
        assert await connection.fetchval(f"SELECT count(*) FROM {SCHEMA}.effects WHERE key = $1", key) == 2
    finally:
        await connection.close()
    enforcing = Starlette(routes=[Route("/write", write, methods=["POST"])])
    enforcing.add_middleware(IdempotencyMiddleware, store=sqla_store, transactional=True)
    async with client_for(enforcing) as client:
        replay = await client.post("/write", content=b"note", headers={"Idempotency-Key": key})
    assert (replay.headers["idempotent-replayed"], replay.content) == ("true", answers[0].content)


@pytest.mark.parametrize("kind", ["memory", "postgres"])
async def test_with_the_apps_own_authentication(kind: str, idempotency_database_url: str) -> None:
    """A tenant the app tells (``TenantDependency``): its 401 goes out first and is no event; after it, the claim is
    observed and the handler runs, a required key missing included (on PostgreSQL, a transactional route)."""
    async with contextlib.AsyncExitStack() as stack:
        store: Store = MemoryStore()
        if kind == "postgres":
            store = await stack.enter_async_context(opened(PostgresStore(idempotency_database_url)))
        await tenant_from_the_app(store)


async def tenant_from_the_app(store: Store) -> None:
    calls: list[str] = []
    events: list[Event] = []
    app = build_with_auth(store, calls, observe=True, on_event=events.append)
    assert (await as_account(app, "key_mallory").post("/orders", json={"amount": 1})).status_code == 401
    client = as_account(app, "key_alice")
    key = str(uuid.uuid4())
    orders = [await client.post("/orders", json={"amount": 5}, headers={"Idempotency-Key": key}) for _ in range(2)]
    refund = await client.post("/refunds", json={"amount": 7})
    assert [(o.status_code, o.json()["tenant"], "idempotent-replayed" in o.headers) for o in orders] == [
        (201, "acct_alice", False)
    ] * 2
    assert (refund.status_code, refund.json()) == (201, {"refunded": 7})
    assert calls == ["acct_alice", "acct_alice", "refund"]
    assert [(e.outcome, e.tenant) for e in events] == [
        (Outcome.EXECUTED, "acct_alice"),
        (Outcome.REPLAYED, "acct_alice"),
        (Outcome.KEY_MISSING, "acct_alice"),
    ]
    info = await store.inspect("acct_alice", key)
    assert info is not None
    assert info.state == "completed"


async def test_metrics_logs_and_spans_count_observed_requests_apart(caplog: pytest.LogCaptureFixture) -> None:
    """A dashboard of what the middleware did never counts a would-be replay as a replay."""
    registry, shop = Registry(), Shop()
    app = shop.app(store=MemoryStore(), observe=True, on_event=registry.metrics)
    key = {"Idempotency-Key": str(uuid.uuid4())}
    async with client_for(app) as client:
        for _ in range(2):
            await client.post("/v1/charges", json={}, headers=key)
    observed = {"method": "POST", "route": "/v1/charges"}
    assert registry.value("idempotency_observed_requests_total", {**observed, "outcome": "executed"}) == 1
    assert registry.value("idempotency_observed_requests_total", {**observed, "outcome": "replayed"}) == 1
    assert registry.value("idempotency_observed_requests_total", {**observed, "outcome": "key_reused"}) == 0
    assert registry.count("/v1/charges", "replayed") is None  # nothing of it in what the middleware did
    assert registry.value("idempotency_in_flight") == 0

    app = shop.app(store=MemoryStore(), observe=True)  # the default hook: log_event
    with caplog.at_level(logging.INFO, logger="idempotency_mw"):
        async with client_for(app) as client:
            for _ in range(2):
                await client.post("/v1/charges", json={}, headers=key)
    (line,) = [r for r in caplog.records if r.getMessage().startswith("idempotency observed")]
    assert line.levelno == logging.INFO  # the replay that did not happen; the first run's line is DEBUG
    assert "would be replayed POST /v1/charges" in line.getMessage()
    assert (vars(line)["idempotency_outcome"], vars(line)["idempotency_observed"]) == ("replayed", True)

    traced = Traced("starlette+asgi", MemoryStore(), observe=True)
    for _ in range(2):
        assert (await traced.client.post("/status/201", headers=key)).status_code == 201
    replayed = [dict(span.attributes or {}) for span in traced.server_spans()][-1]
    assert replayed["idempotency.outcome"] == "replayed"
    assert (replayed["idempotency.observed"], replayed["idempotency.replayed"]) == (True, False)


async def test_routes_enforce_one_by_one() -> None:
    """Observing app-wide, then enforcing where a route says so (by pattern, or next to its endpoint)."""
    store = MemoryStore()

    async def charge(request: Request) -> Response:
        return JSONResponse({"id": uuid.uuid4().hex}, status_code=201)

    @idempotent(observe=False)
    async def refund(request: Request) -> Response:
        return await charge(request)

    app = Starlette(
        routes=[
            Route("/v1/charges", charge, methods=["POST"]),
            Route("/v1/payouts", charge, methods=["POST"]),
            Route("/v1/refunds", refund, methods=["POST"]),
        ]
    )
    app.add_middleware(IdempotencyMiddleware, store=store, observe=True, routes={"/v1/payouts": {"observe": False}})
    replayed = {}
    async with client_for(app) as client:
        for path in ("/v1/charges", "/v1/payouts", "/v1/refunds"):
            headers = {"Idempotency-Key": str(uuid.uuid4())}
            first, again = [await client.post(path, headers=headers) for _ in range(2)]
            replayed[path] = again.content == first.content
    assert replayed == {"/v1/charges": False, "/v1/payouts": True, "/v1/refunds": True}


def test_observe_is_true_or_false() -> None:
    with pytest.raises(ValueError, match="observe must be True or False"):
        IdempotencyMiddleware(Starlette(), MemoryStore(), observe="yes")  # type: ignore[arg-type]


async def test_openapi_promises_nothing_of_an_observed_route() -> None:
    """An observed operation answers as without the middleware: its key is documented (and optional, even where it
    will be required), but neither the replay header nor the middleware's problems."""
    app = FastAPI()

    @app.post("/v1/charges", status_code=201)
    async def create_charge() -> dict[str, str]:
        return {"id": "ch_1"}

    @app.post("/v1/refunds", status_code=201)
    @idempotent(observe=False)
    async def create_refund() -> dict[str, str]:
        return {"id": "re_1"}

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), observe=True, required=True)
    setup(app)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        schema = (await client.get("/openapi.json")).json()
    charges, refunds = schema["paths"]["/v1/charges"]["post"], schema["paths"]["/v1/refunds"]["post"]
    (header,) = [p for p in charges["parameters"] if p["name"] == "Idempotency-Key"]
    assert (header["required"], header["schema"]) == (False, {"type": "string"})  # any key: none is refused
    assert "does not act on it yet" in header["description"]
    assert set(charges["responses"]) == {"201"}
    assert "headers" not in charges["responses"]["201"]
    assert {"400", "409", "413", "422", "503"} <= set(refunds["responses"])
    assert "Idempotent-Replayed" in refunds["responses"]["201"]["headers"]


async def test_a_client_that_leaves_mid_body_gets_no_event(store_and_mode: tuple[Store, bool]) -> None:
    """As when enforcing: nothing to fingerprint, nothing to report; the handler is told of the hang-up as without
    the middleware."""
    store, transactional = store_and_mode
    events: list[Event] = []
    seen: list[list[dict[str, Any]]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        messages = [await receive(), await receive()]
        seen.append(messages)
        await send({"type": "http.response.start", "status": 400, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    wrapped = IdempotencyMiddleware(app, store, observe=True, transactional=transactional, on_event=events.append)
    incoming: list[Message] = [{"type": "http.request", "body": b"{", "more_body": True}, {"type": "http.disconnect"}]
    sent: list[Message] = []

    async def receive() -> Message:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}  # as servers do, once it is gone

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {
        "type": "http", "method": "POST", "path": "/v1/charges", "root_path": "", "query_string": b"",
        "headers": [(b"idempotency-key", b"k-left"), (b"authorization", b"Bearer sk_test_alice")],
    }  # fmt: skip
    await wrapped(scope, receive, send)
    assert seen == [[{"type": "http.request", "body": b"{", "more_body": True}, {"type": "http.disconnect"}]]
    assert [m.get("status") for m in sent if m["type"] == "http.response.start"] == [400]
    assert events == []


async def test_an_observed_request_leaves_no_cycle(store_and_mode: tuple[Store, bool]) -> None:
    """As every request (tests/test_cycles.py): freed as it ends, not by the cycle collector."""
    store, transactional = store_and_mode
    app = app_on(store, transactional=transactional, observe=True)
    await warmed_up(app)

    async def observed() -> None:
        key = str(uuid.uuid4())
        assert [await call(app, "/charge", key) for _ in range(2)] == [201, 201]  # executed, would replay
        assert await call(app, "/charge", key, body=b'{"amount": 1}') == 201  # would 422
        assert await call(app, "/status/503", str(uuid.uuid4())) == 503  # released
        assert await call(app, "/boom", str(uuid.uuid4())) == 500  # the handler failed
        assert await call(app, "/charge", None) == 201  # no key

    assert await left_to_the_collector(observed) == Counter()


async def test_a_tenant_resolver_that_raises_fails_no_observed_request(caplog: pytest.LogCaptureFixture) -> None:
    """Enforcing, the resolver's error would fail the request; observing, the request runs, and the operator hears
    of it once."""

    def resolver(scope: Any) -> str:
        raise LookupError("the accounts service is down")

    shop, events = Shop(), list[Event]()
    app = shop.app(store=MemoryStore(), tenant=resolver, observe=True, on_event=events.append)
    with caplog.at_level(logging.WARNING, logger="idempotency_mw"):
        async with client_for(app) as client:
            answers = [await client.post("/v1/charges", headers={"Idempotency-Key": str(uuid.uuid4())}) for _ in "ab"]
    assert [a.status_code for a in answers] == [201, 201]
    assert [(e.outcome, e.observed) for e in events] == [(Outcome.TENANT_UNKNOWN, True)] * 2
    (notice,) = [r for r in caplog.records if "raised on a request of a route that observes" in r.getMessage()]
    assert notice.exc_info is not None


async def test_the_rollout_page_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, idempotency_database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """docs/rollout.md: one route observing, one enforcing with optional keys, one enforcing with keys required."""
    with recipe("rollout", tmp_path, monkeypatch, DATABASE_URL=idempotency_database_url) as rollout:
        try:
            with caplog.at_level(logging.INFO, logger="idempotency_mw"):
                async with client_for(rollout.app, token=f"sk_test_rollout_{uuid.uuid4().hex}") as client:
                    replayed = {}
                    for path in ("/v1/charges", "/v1/refunds", "/v1/payouts"):
                        keyed = {"Idempotency-Key": str(uuid.uuid4())}
                        first, again = [await client.post(path, json={"n": 1}, headers=keyed) for _ in range(2)]
                        replayed[path] = again.headers.get("idempotent-replayed")
                        assert (first.status_code, again.content) == (201, first.content)
                    keyless = {path: (await client.post(path, json={})).status_code for path in replayed}
        finally:
            await rollout.store.close()
    assert replayed == {"/v1/charges": None, "/v1/refunds": "true", "/v1/payouts": "true"}
    assert keyless == {"/v1/charges": 201, "/v1/refunds": 201, "/v1/payouts": 400}
    observed = [r.getMessage().split(" POST ")[0] for r in caplog.records if "observed" in r.getMessage()]
    assert observed == [
        "idempotency observed, not enforced: would be replayed",
        "idempotency observed, not enforced: would be key_missing",
    ]


@pytest.mark.parametrize("tenant_from_the_app", [False, True], ids=["resolver", "TenantDependency"])
async def test_a_transaction_that_cannot_begin_is_answered_as_when_switched_off(tenant_from_the_app: bool) -> None:
    """The database down: the claim fails (reported), and the handler's transaction cannot begin, so the request gets
    the 503 it gets with the middleware switched off: the handler cannot run without its transaction."""
    dead = PostgresStore(f"postgresql://nobody@127.0.0.1:{closed_port()}/none", timeout=1)
    events: list[Event] = []
    answers = []
    for options in ({"enabled": False}, {"observe": True, "on_event": events.append}):
        if tenant_from_the_app:
            calls: list[str] = []
            client = as_account(build_with_auth(dead, calls, **options), "key_alice")
            path = "/refunds"
        else:
            client = client_for(Shop().app(store=dead, transactional=True, **options))
            path = "/v1/charges"
        async with client:
            answers.append(await client.post(path, json={"amount": 5}, headers={"Idempotency-Key": str(uuid.uuid4())}))
    switched_off, observed = answers
    assert observed.status_code == 503
    assert answer(observed) == answer(switched_off)
    assert [(e.outcome, e.observed, e.status) for e in events] == [(Outcome.STORE_ERROR, True, 503)]


async def test_a_webhook_route_observes_its_events() -> None:
    """A key from the body and a tenant of the route's own (``key_from``, ``tenant``): the same observing, a body over
    the cap included (its key cannot be read; the handler gets it whole)."""
    store, events = MemoryStore(), list[Event]()
    received: list[int] = []

    async def webhook(request: Request) -> Response:
        received.append(len(await request.body()))
        return JSONResponse({"received": True})

    routes = {"/hooks": {"key_from": lambda event: event.get("id"), "tenant": lambda scope: "provider"}}
    apps = []
    for observe in (True, False):
        app = Starlette(routes=[Route("/hooks", webhook, methods=["POST"])])
        app.add_middleware(
            IdempotencyMiddleware, store=store, routes=routes, observe=observe, on_event=events.append,
            max_request_bytes=1024,
        )  # fmt: skip
        apps.append(app)
    event = {"id": f"evt_{uuid.uuid4().hex}", "type": "charge.succeeded"}
    async with client_for(apps[0]) as observing, client_for(apps[1]) as enforcing:
        delivered = [await observing.post("/hooks", json=event) for _ in range(2)]
        large = await observing.post("/hooks", json={**event, "padding": "x" * 2000})
        again = await enforcing.post("/hooks", json=event)
    assert [d.status_code for d in [*delivered, large]] == [200, 200, 200]
    assert received[2] == int(large.request.headers["content-length"]) > 1024  # every byte of the body over the cap
    assert [(e.outcome, e.observed, e.tenant) for e in events] == [
        (Outcome.EXECUTED, True, "provider"),
        (Outcome.REPLAYED, True, "provider"),
        (Outcome.REQUEST_TOO_LARGE, True, ""),
        (Outcome.REPLAYED, False, "provider"),
    ]
    assert (again.headers["idempotent-replayed"], again.content, len(received)) == ("true", delivered[0].content, 3)
