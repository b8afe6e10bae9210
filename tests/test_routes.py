"""routes.py: requests are labelled by the route template that takes them, the way the app's router matches them
(Mounts, FastAPI's included routers, a proxy's root_path), so that labels stay bounded; and a request no route takes
is left to the router, untouched (404, 405, a redirect to the path with or without its trailing slash)."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.types import Receive, Scope, Send

from idempotency_mw import IdempotencyMiddleware, MemoryStore, PostgresStore
from idempotency_mw.metrics import UNMATCHED
from idempotency_mw.routes import RouteMatch, RouteTemplates
from tests.apps import Probe, Registry, build_app
from tests.conftest import client_for


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
    templates = RouteTemplates(app)
    assert templates.match("POST", "/v1/charges/ch_1") == RouteMatch("/v1/charges/{id}", True)
    assert templates.match("PUT", "/v1/charges/ch_1") == RouteMatch("/v1/charges/{id}", False)  # the router's 405
    assert templates.match("POST", "/nowhere") == RouteMatch(UNMATCHED, False)  # the router's 404
    assert templates.match("POST", "/legacy/anything") == RouteMatch(UNMATCHED, None)
    assert RouteTemplates(legacy).match("POST", "/anything") == RouteMatch(UNMATCHED, None)  # no route table
