"""Configuration and per-route policy: checked at startup, honoured per route (decorator or path pattern).

routes.py: requests are labelled by the route template that takes them, the way the app's router matches them
(Mounts, FastAPI's included routers, a proxy's root_path), so that labels stay bounded; and a request no route takes
is left to the router, untouched (404, 405, a redirect to the path with or without its trailing slash).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from idempotency_mw import IdempotencyMiddleware, MemoryStore, Policy, PostgresStore, idempotent
from idempotency_mw._policy import RouteMatch, RouteTable
from idempotency_mw.metrics import UNMATCHED
from tests.apps import Probe, Registry, build_app
from tests.conftest import client_for


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ttl": 0}, "ttl must be a positive"),
        ({"lease": -1}, "lease must be a positive"),
        ({"lease": 100, "ttl": 50}, "shorter than ttl"),
        ({"max_request_bytes": -1}, "max_request_bytes"),
        ({"methods": ("P0ST",)}, "method names"),
        ({"methods": "POST"}, "not the string 'POST'"),
        ({"released_statuses": frozenset({999})}, "status codes"),
        ({"ttl": 3600, "retry_window": 7200}, "retry_window"),
        ({"fail_open": True, "transactional": True}, "fail_open cannot be combined with transactional"),
        ({"retry_after": -1}, "retry_after"),
        ({"routes": {"/x": {"tll": 5}}}, "unknown idempotency setting"),
        # Values that are numbers to Python but no length of time: in code, as in the environment, they are refused
        # (inf made every keyed request a 503, or a 500 once its handler had run; a nan lease never lapsed).
        ({"ttl": math.inf}, "ttl must be a positive number of seconds, got inf"),
        ({"ttl": math.nan}, "ttl must be a positive number of seconds, got nan"),
        ({"lease": math.nan}, "lease must be a positive number of seconds, got nan"),
        ({"ttl": True}, "ttl must be a positive number of seconds, got True"),
        ({"on_conflict": "wait", "wait": math.nan}, "wait must be a positive number of seconds, got nan"),
        ({"retry_window": math.nan}, "retry_window must be a positive number of seconds, got nan"),
        ({"retry_window": -1}, "retry_window must be a positive number of seconds, got -1"),
        ({"retry_window": "7d"}, "retry_window must be a positive number of seconds, got '7d'"),
        ({"released_statuses": {"429"}}, "status codes"),
        ({"max_response_bytes": True}, "max_response_bytes must be a whole number of bytes"),
        ({"methods": [1]}, "method names"),
    ],
)
def test_bad_configuration_fails_at_startup(options: dict[str, object], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=re.escape(message) if "got" in message else message):
        IdempotencyMiddleware(Starlette(), MemoryStore(), **options)  # type: ignore[arg-type]


async def test_a_declared_route_under_a_path_pattern_is_told_what_the_pattern_sets(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A route's declaration starts from the app's settings, not from a path pattern's: under
    ``routes={"/v1/*": {"required": True}}``, a route that declares only ``ttl`` does not require a key. The
    startup says so, naming the route, the pattern and what it does not get, once."""

    @idempotent(ttl=7 * 86400)
    async def refund(request: Request) -> Response:
        return JSONResponse({}, status_code=201)

    app = Starlette(routes=[Route("/v1/refunds", refund, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), routes={"/v1/*": {"required": True}})
    with caplog.at_level("WARNING", logger="idempotency_mw"):
        client = client_for(app)
        assert (await client.post("/v1/refunds")).status_code == 201  # keyless: not required on this route
        assert (await client.post("/v1/refunds")).status_code == 201
    told = [r.getMessage() for r in caplog.records if "declares its own settings" in r.getMessage()]
    assert told == [
        "idempotency: POST /v1/refunds declares its own settings (@idempotent), so the path pattern '/v1/*' of "
        "routes= does not apply to it: it does not get required=True. Repeat in its declaration what it needs"
    ]


def test_methods_may_be_any_iterable_of_names() -> None:
    """Read once: a generator of names covers what it names (it was checked, then found empty when frozen)."""
    middleware = IdempotencyMiddleware(Starlette(), MemoryStore(), methods=(name for name in ("post", "PATCH")))  # type: ignore[arg-type]
    assert middleware.routes.default.methods == {"POST", "PATCH"}


def test_waiting_on_a_store_that_cannot_watch_fails_at_startup() -> None:
    """A store of one's own written before ``Store.watch``: refused when built, rather than a 500 per duplicate
    (and a request left in flight) once one waits."""

    class Unwatching(MemoryStore):
        watch = None  # type: ignore[assignment]

    with pytest.raises(TypeError, match=r"needs a store that tells when a claim settles \(Store.watch\)"):
        IdempotencyMiddleware(Starlette(), Unwatching(), on_conflict="wait")  # type: ignore[arg-type]


def test_ttl_and_lease_come_from_the_environment_unless_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """A deploy tunes them without a release; an argument in code wins; a bad value stops the app at startup,
    naming the variable."""
    monkeypatch.setenv("IDEMPOTENCY_TTL", "7200")
    monkeypatch.setenv("IDEMPOTENCY_LEASE", "12.5")
    middleware = IdempotencyMiddleware(Starlette(), MemoryStore())
    assert (middleware.routes.default.ttl, middleware.routes.default.lease) == (7200, 12.5)
    given = IdempotencyMiddleware(Starlette(), MemoryStore(), ttl=600, lease=20)
    assert (given.routes.default.ttl, given.routes.default.lease) == (600, 20)
    monkeypatch.setenv("IDEMPOTENCY_TTL", "1d")
    with pytest.raises(ValueError, match=r"IDEMPOTENCY_TTL='1d': expected a positive number of seconds"):
        IdempotencyMiddleware(Starlette(), MemoryStore())
    monkeypatch.setenv("IDEMPOTENCY_TTL", "60")
    with pytest.raises(ValueError, match="shorter than ttl"):
        IdempotencyMiddleware(
            Starlette(), MemoryStore(), lease=90
        )  # a lease given in code, against the ttl of the environment
    monkeypatch.setenv("IDEMPOTENCY_LEASE", "-3")
    with pytest.raises(ValueError, match="IDEMPOTENCY_LEASE='-3'"):
        IdempotencyMiddleware(Starlette(), MemoryStore())


def test_decorator_validates_at_import() -> None:
    with pytest.raises(TypeError, match="unknown idempotency setting"):
        idempotent(requird=True)


async def test_a_route_policy_is_checked_against_the_apps_own_defaults() -> None:
    # ttl=30 is fine beside the app's lease of 10 s, though not beside the library's default lease of 60 s.
    @idempotent(ttl=30)
    async def short(request: Request) -> Response:
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/short", short, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), lease=10)
    assert (await lifespan_startup(app))["type"] == "lifespan.startup.complete"

    strict = Starlette(routes=[Route("/short", short, methods=["POST"])])
    strict.add_middleware(IdempotencyMiddleware, store=MemoryStore())  # lease 60 s: not shorter than ttl 30 s
    answer = await lifespan_startup(strict)
    assert answer["type"] == "lifespan.startup.failed"
    assert "shorter than ttl" in str(answer["message"])


def test_policy_records() -> None:
    policy = Policy()
    assert policy.records(201)
    assert policy.records(400)
    assert not policy.records(500)
    assert not policy.records(429)


async def _run(endpoint_hits: list[str], app: ASGIApp, path: str, key: str | None = None) -> int:
    headers = {"Idempotency-Key": key} if key else {}
    response = await client_for(app).post(path, content=b"x", headers=headers)
    return response.status_code


def _starlette_app(store: MemoryStore, hits: list[str]) -> Starlette:
    @idempotent(required=True)
    async def strict(request: Request) -> Response:
        hits.append("strict")
        return PlainTextResponse("ok", status_code=201)

    async def plain(request: Request) -> Response:
        hits.append("plain")
        return PlainTextResponse("ok", status_code=201)

    @idempotent(methods=frozenset({"PUT"}))
    async def put_only(request: Request) -> Response:
        hits.append("put")
        return PlainTextResponse("ok", status_code=201)

    app = Starlette(
        routes=[
            Route("/strict", strict, methods=["POST"]),
            Route("/plain", plain, methods=["POST"]),
            Route("/refunds/{id}", plain, methods=["POST"]),
            Route("/put", put_only, methods=["PUT", "POST"]),
            Mount("/v2", routes=[Route("/strict", strict, methods=["POST"])]),
        ]
    )
    app.add_middleware(IdempotencyMiddleware, store=store, routes={"/refunds/*": {"required": True}})
    return app


async def test_starlette_route_policies() -> None:
    hits: list[str] = []
    app = _starlette_app(MemoryStore(), hits)
    client = client_for(app)
    assert (await client.post("/strict", content=b"x")).status_code == 400  # decorated: required
    assert (await client.post("/v2/strict", content=b"x")).status_code == 400  # through a Mount
    assert (await client.post("/plain", content=b"x")).status_code == 201  # default: optional
    assert (await client.post("/refunds/re_1", content=b"x")).status_code == 400  # path pattern
    assert (await client.post("/refunds/re_1", content=b"x", headers={"Idempotency-Key": "k"})).status_code == 201
    # A route covering only PUT ignores the key on POST, and honours it on PUT.
    for _ in range(2):
        await client.post("/put", content=b"x", headers={"Idempotency-Key": "p"})
        await client.put("/put", content=b"x", headers={"Idempotency-Key": "q"})
    assert hits.count("put") == 3
    assert hits.count("strict") == 0


async def test_fastapi_router_prefixes_and_decorators() -> None:
    hits: list[str] = []
    router = APIRouter(prefix="/v1")

    @router.post("/charges", status_code=201)
    @idempotent(required=True, ttl=60, lease=5)
    async def charge() -> dict[str, str]:
        hits.append("charge")
        return {"ok": "yes"}

    @router.post("/notes", status_code=201)
    async def note() -> dict[str, str]:
        hits.append("note")
        return {"ok": "yes"}

    app = FastAPI()
    app.include_router(router)
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    client = client_for(app)
    assert (await client.post("/v1/charges")).status_code == 400
    assert (await client.post("/v1/notes")).status_code == 201
    for _ in range(3):
        assert (await client.post("/v1/charges", headers={"Idempotency-Key": "c"})).status_code == 201
    assert hits == ["note", "charge"]


async def test_transactional_route_on_a_memory_store_fails_every_request_without_a_lifespan() -> None:
    hits: list[str] = []

    @idempotent(transactional=True)
    async def endpoint(request: Request) -> Response:
        hits.append("ran")
        return PlainTextResponse("")

    app = Starlette(routes=[Route("/t", endpoint, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    client = client_for(app)
    for _ in range(2):  # the first failure is not forgotten: the route never runs unprotected
        with pytest.raises(TypeError, match="PostgresStore"):
            await client.post("/t", headers={"Idempotency-Key": "k"})
    assert hits == []


async def lifespan_startup(app: Starlette) -> Message:
    """Drive an ASGI lifespan up to startup, as a server does, and return the app's answer."""
    messages: list[Message] = [{"type": "lifespan.startup"}]
    answers: list[Message] = []

    async def receive() -> Message:
        if messages:
            return messages.pop()
        await asyncio.sleep(3600)  # a server would send lifespan.shutdown much later
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        answers.append(message)

    task = asyncio.ensure_future(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send))
    for _ in range(100):
        if answers or task.done():
            break
        await asyncio.sleep(0.01)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert answers, "the app answered nothing to lifespan.startup"
    return answers[0]


async def test_a_bad_route_policy_stops_the_server_at_startup() -> None:
    @idempotent(ttl=600)
    async def endpoint(request: Request) -> Response:
        return PlainTextResponse("")

    app = Starlette(routes=[Route("/short", endpoint, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), retry_window=3600)
    answer = await lifespan_startup(app)
    assert answer["type"] == "lifespan.startup.failed"
    assert "retry_window" in str(answer["message"])


async def test_good_route_policies_start_and_keep_the_apps_own_lifespan() -> None:
    started: list[str] = []

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        started.append("app")
        yield

    @idempotent(required=True)
    async def endpoint(request: Request) -> Response:
        return PlainTextResponse("")

    app = Starlette(routes=[Route("/ok", endpoint, methods=["POST"])], lifespan=lifespan)
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    answer = await lifespan_startup(app)
    assert answer["type"] == "lifespan.startup.complete"
    assert started == ["app"]
    assert (await client_for(app).post("/ok")).status_code == 400  # the scan at startup is the one in use


def build_with_webhooks(**options: object) -> tuple[Starlette, list[str]]:
    runs: list[str] = []

    async def webhook(request: Request) -> Response:
        runs.append("webhook")
        return PlainTextResponse("ok", status_code=201)

    @idempotent(methods=frozenset())
    async def callback(request: Request) -> Response:
        runs.append("callback")
        return PlainTextResponse("ok", status_code=201)

    async def charge(request: Request) -> Response:
        runs.append("charge")
        return PlainTextResponse("ok", status_code=201)

    app = Starlette(
        routes=[
            Route("/v1/webhooks/stripe", webhook, methods=["POST"]),
            Route("/v1/callbacks", callback, methods=["POST"]),
            Route("/v1/charges", charge, methods=["POST"]),
        ]
    )
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), **options)  # type: ignore[arg-type]
    return app, runs


async def test_a_path_can_be_left_uncovered() -> None:
    """The documented way (docs/configuration.md): ``methods=frozenset()`` by pattern or by declaration leaves a
    route alone, a key and an app-wide ``required=True`` notwithstanding."""
    app, runs = build_with_webhooks(required=True, routes={"/v1/webhooks/*": {"methods": frozenset()}})
    client = client_for(app)
    for path in ("/v1/webhooks/stripe", "/v1/callbacks"):
        for _ in range(2):
            response = await client.post(path, headers={"Idempotency-Key": "evt_1"})
            assert response.status_code == 201
            assert "idempotent-replayed" not in response.headers
        assert (await client.post(path)).status_code == 201  # no key, and not required here
    assert (await client.post("/v1/charges")).status_code == 400  # still required elsewhere
    assert runs == ["webhook"] * 3 + ["callback"] * 3


def key() -> dict[str, str]:
    return {"Idempotency-Key": str(uuid.uuid4())}


async def test_paths_no_route_takes_are_not_counted() -> None:
    """A scan of random paths gets the router's 404 untouched: no event, so no label per path."""
    m = Registry()
    client = client_for(build_app(MemoryStore(), Probe(), on_event=m.metrics))
    for i in range(20):
        assert (await client.post(f"/scan/{uuid.uuid4()}/{i}", headers=key())).status_code == 404
    routes = m.routes()
    assert routes == set()


async def test_mounts_and_method_specific_routes_get_their_full_template() -> None:
    async def create(request: Request) -> Response:
        return JSONResponse({"id": request.path_params["account"]}, status_code=201)

    async def update(request: Request) -> Response:
        return JSONResponse({"updated": True})

    accounts = [
        Route("/{account}/charges", create, methods=["POST"]),
        Route("/{account}/charges", update, methods=["PATCH"]),
    ]
    app = Starlette(routes=[Mount("/v1/accounts", routes=accounts)])
    m = Registry()
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), on_event=m.metrics)
    client = client_for(app)
    repeated = key()
    for _ in range(2):
        assert (await client.post("/v1/accounts/acct_1/charges", headers=repeated)).status_code == 201
    await client.patch("/v1/accounts/acct_2/charges", headers=key())
    assert m.count("/v1/accounts/{account}/charges", "executed") == 1
    assert m.count("/v1/accounts/{account}/charges", "replayed") == 1
    assert m.count("/v1/accounts/{account}/charges", "executed", method="PATCH") == 1


async def test_root_path_and_requests_refused_before_the_store() -> None:
    """Behind a proxy prefix (root_path), and for refusals that never reach the store: every request is labelled by
    its template, the first one included."""
    m = Registry()
    app = build_app(MemoryStore(), Probe(), on_event=m.metrics)
    transport = httpx.ASGITransport(app=app, root_path="/api")
    auth = {"Authorization": "Bearer sk_test_alice"}
    async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=auth) as client:
        invalid = {"Idempotency-Key": ""}
        assert (await client.post("/api/status/201", headers=invalid)).status_code == 400
        assert (await client.post("/api/status/201", headers=key())).status_code == 201
        assert (await client.post("/api/status/201", headers=invalid)).status_code == 400
    assert m.count("/status/{code}", "executed") == 1
    assert m.count("/status/{code}", "key_invalid") == 2
    assert m.value("idempotency_in_flight") == 0


@pytest.mark.parametrize("path", ["/apikeys", "/api/apikeys"])
async def test_a_path_that_only_begins_with_the_root_paths_letters_is_covered(path: str) -> None:
    """Under root_path ``/api``, ``/apikeys`` is the route ``/apikeys`` to Starlette, which strips the root path only
    as a whole segment: so does the middleware. (It took ``keys`` for the path, which no route takes, and let the
    request through unclaimed: the handler ran for every retry.)"""
    runs: list[str] = []

    async def create(request: Request) -> Response:
        runs.append(request.url.path)
        return JSONResponse({"run": len(runs)}, status_code=201)

    app = Starlette(routes=[Route("/apikeys", create, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    transport = httpx.ASGITransport(app=app, root_path="/api")
    auth = {"Authorization": "Bearer sk_test_alice"}
    async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=auth) as client:
        repeated = key()
        first = await client.post(path, headers=repeated)
        again = await client.post(path, headers=repeated)
    assert (first.status_code, again.status_code) == (201, 201)
    assert again.headers.get("idempotent-replayed") == "true"
    assert len(runs) == 1


@pytest.mark.parametrize("wrapped", ["add_middleware", "wraps the app"])
async def test_labels_stay_bounded_however_the_middleware_is_mounted(wrapped: str) -> None:
    """200 resource ids and 200 scanner paths are two labels, not 400, also when the middleware wraps the app
    directly (there is no ``scope["app"]`` above the app then), and an app without a route table is one label."""
    m = Registry()
    probe = Probe()
    if wrapped == "add_middleware":
        app: Any = build_app(MemoryStore(), probe, on_event=m.metrics)
    else:
        routes = build_app(MemoryStore(), probe).routes
        app = IdempotencyMiddleware(Starlette(routes=routes), store=MemoryStore(), on_event=m.metrics)
    client = client_for(app)
    for i in range(200):
        assert (await client.post(f"/status/{200 + i % 50}", headers=key())).status_code in range(200, 250)
        assert (await client.post(f"/wp-admin/{uuid.uuid4()}.php", headers=key())).status_code == 404
    routes_seen = m.routes()
    assert routes_seen == {"/status/{code}"}


async def test_an_app_without_a_route_table_is_one_label() -> None:
    async def bare(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    m = Registry()
    client = client_for(IdempotencyMiddleware(bare, store=MemoryStore(), on_event=m.metrics))
    for i in range(20):
        assert (await client.post(f"/things/{i}", headers=key())).status_code == 201
    assert m.count(UNMATCHED, "executed") == 20


async def test_fastapi_included_router_prefix() -> None:
    router = APIRouter(prefix="/v1")

    @router.post("/refunds/{refund_id}", status_code=201)
    async def refund(refund_id: str) -> dict[str, str]:
        return {"id": refund_id}

    app = FastAPI()
    app.include_router(router)
    m = Registry()
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), on_event=m.metrics)
    client = client_for(app)
    for refund_id in ("re_1", "re_2"):
        assert (await client.post(f"/v1/refunds/{refund_id}", headers=key())).status_code == 201
    assert m.count("/v1/refunds/{refund_id}", "executed") == 2


async def test_trailing_slash_redirect_does_not_burn_the_key(pg_store: PostgresStore) -> None:
    """Starlette's router answers ``POST /charges/`` with ``307 Temporary Redirect`` to ``/charges`` before any
    handler runs (``redirect_slashes``, on by default, FastAPI too), and clients that follow it re-send the request
    with the same Idempotency-Key. Nothing ran, as with 404 and 405: the redirect is left to the router, not
    recorded, so the followed request runs the handler instead of meeting a record of ``/charges/`` and its
    fingerprint (422 ``idempotency_key_reused`` for the whole ttl)."""
    runs: list[int] = []

    async def charge(request: Request) -> Response:
        runs.append(1)
        return JSONResponse({"charged": True}, status_code=201)

    app = Starlette(routes=[Route("/charges", charge, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=pg_store)
    key = str(uuid.uuid4())
    async with client_for(app) as client:
        followed = await client.post(
            "/charges/", json={"amount": 100}, headers={"Idempotency-Key": key}, follow_redirects=True
        )
    assert [r.status_code for r in followed.history] == [307]
    assert followed.status_code == 201, followed.text
    assert runs == [1]


def test_a_request_is_matched_to_its_template_and_whether_a_route_takes_it() -> None:
    """The router's own answer, read from its table: a route takes the request (True), none does and the router
    answers 404 or 405 by itself (False), or the request goes to a mounted app whose routes cannot be read (None)."""

    async def charge(request: Request) -> Response:
        return JSONResponse({}, status_code=201)

    async def legacy(scope: Scope, receive: Receive, send: Send) -> None:
        raise AssertionError("not called")

    app = Starlette(routes=[Route("/v1/charges/{id}", charge, methods=["POST"]), Mount("/legacy", app=legacy)])
    default = Policy()
    table = RouteTable(default, {})
    table.scan(app)
    assert table.lookup("POST", "/v1/charges/ch_1") == RouteMatch(default, "/v1/charges/{id}", True)
    assert table.lookup("PUT", "/v1/charges/ch_1") == RouteMatch(default, "/v1/charges/{id}", False)  # the 405
    assert table.lookup("POST", "/nowhere") == RouteMatch(default, UNMATCHED, False)  # the router's 404
    assert table.lookup("POST", "/legacy/anything") == RouteMatch(default, UNMATCHED, None)
    without = RouteTable(default, {})
    without.scan(legacy)
    assert without.lookup("POST", "/anything") == RouteMatch(default, UNMATCHED, None)  # no route table
