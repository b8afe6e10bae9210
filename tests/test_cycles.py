"""A request leaves no reference cycle behind.

Objects in a cycle are freed only by the cycle collector, not when the request ends: a cycle that holds a request
keeps its scope, body, response copy and tasks alive until then, and makes the collector run (and walk the whole
heap, in its oldest generation) several times as often as the app alone would. Under load that cost more than
the middleware's own work (benchmarks/README.md). Each flow below runs with the collector saving what it finds,
and none of the library's objects may be among it.
"""

from __future__ import annotations

import gc
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message

from idempotency_mw import IdempotencyMiddleware, MemoryStore, PostgresStore, Store, idempotency_context
from tests.conftest import http_scope

TENANT = "tenant-cycles"
BODY = b'{"amount": 1250}'


def app_on(store: Store, **options: Any) -> Starlette:
    async def charge(request: Request) -> Response:
        await request.body()
        return JSONResponse({"ok": True}, status_code=201)

    async def status(request: Request) -> Response:
        await request.body()
        return Response("status", status_code=int(request.path_params["code"]))

    async def boom(request: Request) -> Response:
        raise RuntimeError("the handler failed")

    async def in_steps(request: Request) -> Response:
        """A local step, an outside one, another local one (transactional routes); ``/steps/stop`` fails after them."""
        context = idempotency_context(request)
        assert context is not None
        steps = context.steps

        async def local() -> dict[str, int]:
            return {"n": 1}

        async def outside(downstream_key: str) -> str:
            return downstream_key[:8]

        answer = [await steps.local("a", local), await steps.outside("b", outside), await steps.local("c", local)]
        if request.url.path.endswith("/stop"):
            raise RuntimeError("the handler failed after its steps")
        return JSONResponse(answer, status_code=201)

    app = Starlette(
        routes=[
            Route("/charge", charge, methods=["POST"]),
            Route("/status/{code:int}", status, methods=["POST"]),
            Route("/boom", boom, methods=["POST"]),
            Route("/steps", in_steps, methods=["POST"]),
            Route("/steps/stop", in_steps, methods=["POST"]),
        ]
    )
    app.add_middleware(IdempotencyMiddleware, store=store, tenant=lambda scope: TENANT, **options)
    return app


async def call(app: Starlette, path: str, key: str | None, body: bytes = BODY) -> int:
    """One raw ASGI request (no test client, whose own objects could hold ours); its status, 500 if it raised."""
    statuses: list[int] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    try:
        await app(http_scope(path, key), receive, send)
    except RuntimeError:
        return 500
    return statuses[0]


async def warmed_up(app: Starlette) -> None:
    """One request first: the middleware reads the app's routes once, replacing what it built before (once per
    app, not per request)."""
    assert await call(app, "/charge", None) == 201


async def left_to_the_collector(flow: Callable[[], Awaitable[None]]) -> Counter[str]:
    """The library's objects that only the cycle collector could free after ``flow``."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        await flow()
        gc.collect()
        return Counter(
            f"{type(thing).__module__}.{type(thing).__qualname__}"
            for thing in gc.garbage
            if type(thing).__module__.startswith("idempotency_mw")
        )
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def flows(app: Starlette) -> dict[str, Callable[[], Awaitable[None]]]:
    async def fresh_then_replay() -> None:
        key = str(uuid.uuid4())
        assert await call(app, "/charge", key) == 201
        assert await call(app, "/charge", key) == 201  # the replay

    async def reused_with_another_body() -> None:
        key = str(uuid.uuid4())
        assert await call(app, "/charge", key) == 201
        assert await call(app, "/charge", key, body=b'{"amount": 1}') == 422

    async def released() -> None:
        assert await call(app, "/status/503", str(uuid.uuid4())) == 503

    async def handler_failed() -> None:
        assert await call(app, "/boom", str(uuid.uuid4())) == 500

    async def without_a_key() -> None:
        assert await call(app, "/charge", None) == 201

    return {
        "fresh then replay": fresh_then_replay,
        "reused with another body": reused_with_another_body,
        "released": released,
        "handler failed": handler_failed,
        "without a key": without_a_key,
    }


FLOWS = ["fresh then replay", "reused with another body", "released", "handler failed", "without a key"]


@pytest.mark.parametrize("flow", FLOWS)
async def test_no_cycles_on_memory_store(flow: str) -> None:
    app = app_on(MemoryStore())
    await warmed_up(app)
    assert await left_to_the_collector(flows(app)[flow]) == Counter()


@pytest.mark.parametrize("transactional", [False, True], ids=["plain", "transactional"])
@pytest.mark.parametrize("flow", FLOWS)
async def test_no_cycles_on_postgres(opened_store: PostgresStore, flow: str, transactional: bool) -> None:
    app = app_on(opened_store, transactional=transactional)
    await warmed_up(app)
    assert await left_to_the_collector(flows(app)[flow]) == Counter()


@pytest.mark.parametrize("switch", [{}, {"enabled": False}, {"observe": True}], ids=["enforcing", "off", "observing"])
async def test_no_cycles_of_a_request_in_steps(opened_store: PostgresStore, switch: dict[str, bool]) -> None:
    """A handler in steps: run through, stopped after its steps and resumed, replayed; the run its context refers to,
    and the steps that refer back to their run, go as the request ends."""
    app = app_on(opened_store, transactional=True, **switch)
    await warmed_up(app)

    async def in_steps() -> None:
        key = str(uuid.uuid4())
        assert await call(app, "/steps", key) == 201
        assert await call(app, "/steps", key) == 201  # a replay (enforcing), every step again (not enforcing)
        stopped = str(uuid.uuid4())
        assert await call(app, "/steps/stop", stopped) == 500
        assert await call(app, "/steps/stop", stopped) == 500  # resumed after its last step, and stopped again

    assert await left_to_the_collector(in_steps) == Counter()
