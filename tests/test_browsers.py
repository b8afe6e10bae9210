"""Browsers (docs/guide.md, "Browsers"): keys scoped by a session cookie, what a keyed request without the cookie
gets (it passes through untouched), and the documented CORS set-up, run as written."""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idempotency_mw import CookieTenant, IdempotencyMiddleware, idempotent
from idempotency_mw.store import Store
from idempotency_mw.testing import run_lifespan
from tests.test_docs import recipe


def shop(store: Store, transactional: bool, runs: Counter[str], **resolver: str) -> Starlette:
    async def order(request: Request) -> Response:
        runs[request.headers["idempotency-key"]] += 1
        return JSONResponse({"id": f"or_{uuid.uuid4().hex[:8]}"}, status_code=201)

    @idempotent(required=True)
    async def payment(request: Request) -> Response:
        runs["payment"] += 1
        return JSONResponse({"id": "pay_1"}, status_code=201)

    app = Starlette(routes=[Route("/orders", order, methods=["POST"]), Route("/payments", payment, methods=["POST"])])
    tenant = CookieTenant("session", **resolver)
    app.add_middleware(IdempotencyMiddleware, store=store, tenant=tenant, transactional=transactional)
    return app


def browser(app: Starlette, session: str | None) -> httpx.AsyncClient:
    cookies = {"session": session} if session is not None else None
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", cookies=cookies)


async def test_a_session_scopes_its_keys_and_a_visitor_passes_through(store_and_mode: tuple[Store, bool]) -> None:
    store, transactional = store_and_mode
    runs: Counter[str] = Counter()
    app = shop(store, transactional, runs)
    key = str(uuid.uuid4())
    async with browser(app, "s1-" + key) as alice, browser(app, "s2-" + key) as bob, browser(app, None) as visitor:
        first = await alice.post("/orders", headers={"Idempotency-Key": key})
        again = await alice.post("/orders", headers={"Idempotency-Key": key})
        assert (again.content, again.headers["idempotent-replayed"]) == (first.content, "true")
        other = await bob.post("/orders", headers={"Idempotency-Key": key})  # another session: its own record
        assert "idempotent-replayed" not in other.headers
        visitor_key = str(uuid.uuid4())
        for _ in range(2):  # no session: untouched, as without a key (no record, no replay, no 400)
            answer = await visitor.post("/orders", headers={"Idempotency-Key": visitor_key})
            assert answer.status_code == 201
            assert "idempotent-replayed" not in answer.headers
        refused = await visitor.post("/payments", headers={"Idempotency-Key": visitor_key})
        assert (refused.status_code, refused.json()["code"]) == (400, "idempotency_tenant_unknown")
        assert (
            refused.json()["detail"].endswith("send the session cookie.")
            or "session cookie" in refused.json()["detail"]
        )
    assert runs[key] == 2  # once per session
    assert runs[visitor_key] == 2  # each visit ran
    assert runs["payment"] == 0
    tenant = CookieTenant("session")({"type": "http", "headers": [(b"cookie", f"session=s1-{key}".encode())]})
    assert tenant is not None
    assert key not in tenant  # the session id is not in the table, its HMAC is
    assert await store.inspect(tenant, key) is not None


async def test_visitors_share_a_namespace_only_when_asked(store_and_mode: tuple[Store, bool]) -> None:
    store, transactional = store_and_mode
    runs: Counter[str] = Counter()
    app = shop(store, transactional, runs, anonymous=f"visitors-{uuid.uuid4().hex}")
    key = str(uuid.uuid4())
    async with browser(app, None) as one, browser(app, None) as two:
        await one.post("/orders", headers={"Idempotency-Key": key})
        replayed = await two.post("/orders", headers={"Idempotency-Key": key})
    assert replayed.headers["idempotent-replayed"] == "true"
    assert runs[key] == 1


@pytest.mark.parametrize(
    "headers",
    [
        [b"session=s-tossed; session=s-own"],  # a cookie tossed from a sibling domain, sent first
        [b"session=s-own", b"session=s-other"],  # two Cookie fields
        [b'session="s-own"'],  # quoted
        [b'session="s\\054own"'],  # an escape inside quotes, as http.cookies reads it
    ],
    ids=["repeated", "second-field", "quoted", "escaped"],
)
def test_the_session_is_the_one_the_app_reads(headers: list[bytes]) -> None:
    """The tenant is the session the app acts for, read as Starlette reads ``request.cookies`` (the last pair of the
    name, unquoted). It took the first pair: with a tossed cookie ahead of the victim's, the victim's request was
    recorded under the attacker's session, which then got its answer replayed."""
    scope = {"type": "http", "headers": [(b"cookie", value) for value in headers]}
    session = Request(scope).cookies["session"]
    assert session in ("s-own", "s-other", "s,own")
    alone = {"type": "http", "headers": [(b"cookie", f"session={session}".encode())]}
    assert CookieTenant("session")(scope) == CookieTenant("session")(alone)


def test_a_cookie_name_is_checked() -> None:
    with pytest.raises(ValueError, match="needs a cookie name"):
        CookieTenant("bad name")


async def test_the_documented_cors_setup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, idempotency_database_url: str
) -> None:
    """The preflight allows the key (and never reaches the middleware); a page can read the replay marker and the
    key's expiry."""
    with recipe("browsers", tmp_path, monkeypatch, DATABASE_URL=idempotency_database_url) as module:
        origin = {"Origin": "https://shop.example"}
        transport = httpx.ASGITransport(app=module.app)
        async with (
            run_lifespan(module.app),
            httpx.AsyncClient(transport=transport, base_url="http://test", cookies={"session": "s-cors"}) as client,
        ):
            await module.store.open()
            preflight = await client.options(
                "/orders",
                headers={
                    **origin,
                    "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "idempotency-key",
                },
            )
            key = {"Idempotency-Key": str(uuid.uuid4()), **origin}
            first = await client.post("/orders", headers=key)
            again = await client.post("/orders", headers=key)
            await module.store.close()
    assert preflight.status_code == 200
    assert "idempotency-key" in preflight.headers["access-control-allow-headers"].lower()
    assert first.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    exposed = again.headers["access-control-expose-headers"].lower()
    assert "idempotent-replayed" in exposed
    assert "retry-after" in exposed
    assert "idempotency-expires" in exposed
    assert first.headers["idempotency-expires"] == again.headers["idempotency-expires"]
    assert again.headers["access-control-allow-origin"] == "https://shop.example"
