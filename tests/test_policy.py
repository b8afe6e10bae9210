"""Configuration and per-route policy: checked at startup, honoured per route (decorator or path pattern)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from fastapi import APIRouter, FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Message

from idempotency_mw import IdempotencyMiddleware, MemoryStore, Policy, idempotent
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
    ],
)
def test_bad_configuration_fails_at_startup(options: dict[str, object], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        IdempotencyMiddleware(Starlette(), MemoryStore(), **options)  # type: ignore[arg-type]


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
