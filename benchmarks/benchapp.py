"""The one app every benchmark serves: the same Starlette endpoints, bare or behind one idempotency middleware.

Variants (``BENCH_VARIANT`` for uvicorn's ``benchapp:create_app --factory``):

- ``bare``: no middleware.
- ``handwritten``: no middleware; ``/orders`` does the store's claim and complete inline, as an expert would
  without a library (``handwritten.py``).
- ``ours``: ``IdempotencyMiddleware`` with ``PostgresStore`` (defaults: the store opens its own connections,
  2..20, without a reset on release, so a fresh request is 2 round trips).
- ``ours-memory``: ``IdempotencyMiddleware`` with ``MemoryStore``.
- ``fastidempotent``: fastidempotent's middleware with its ``PostgresBackend`` (SQLAlchemy + asyncpg, pool 10 + 10
  overflow, so at most 20 connections like ours).
- ``fastapi-idempotency``: fastapi-idempotency's middleware with its ``TortoiseStore`` (asyncpg pool 1..20), with
  ``wait_seconds=0`` so an in-flight duplicate gets its 409 at once instead of polling the database every 50 ms.

The peers are imported only for their own variant, so the module also loads where they are not installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from pgserver import Database
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import idempotency_mw

VARIANTS = ("bare", "handwritten", "ours", "ours-memory", "fastidempotent", "fastapi-idempotency")
PEERS = ("fastidempotent", "fastapi-idempotency")
MiB = 1024 * 1024
# The secret of our default tenant resolver (AuthorizationTenant) in every benchmark, so bulk-loaded records and
# served requests agree on the load generator's tenant. A fixed value: nothing here is secret.
TENANT_SECRET = "benchmark-tenant-secret-0123456789abcdef"
LIBRARY = os.path.dirname(os.path.abspath(idempotency_mw.__file__))  # which copy of the library this process runs

Hook = Callable[[], Awaitable[Any]]
Endpoint = Callable[[Request], Awaitable[Response]]
Wrap = Callable[[Endpoint], Endpoint]


def routes(gate: asyncio.Event | None = None, wrap: Wrap | None = None) -> list[Route]:
    """``/orders``: a small JSON write (201); ``/slow``: held until ``gate`` is set; ``/big``: a large response.
    ``wrap`` replaces the ``/orders`` endpoint by what it returns for it (the hand-written variant)."""
    counter = itertools.count(1)

    async def orders(request: Request) -> Response:
        order = await request.json()
        return JSONResponse({"id": next(counter), "status": "accepted", **order}, status_code=201)

    async def slow(request: Request) -> Response:
        await request.body()
        if gate is not None:
            await gate.wait()
        return JSONResponse({"id": next(counter)}, status_code=201)

    async def big(request: Request) -> Response:
        await request.body()
        size = int(request.query_params.get("size", MiB))
        return Response(b"x" * size, media_type="application/octet-stream")  # a fresh buffer per request

    return [
        Route("/orders", wrap(orders) if wrap else orders, methods=["POST"]),
        Route("/slow", slow, methods=["POST"]),
        Route("/big", big, methods=["POST"]),
    ]


def build(variant: str, db: Database | None, gate: asyncio.Event | None = None) -> tuple[Starlette, Hook, Hook]:
    """The app plus its startup and shutdown coroutines (called by the lifespan, or by an in-process driver)."""
    middleware: list[Middleware] = []
    startup: Hook = _nothing
    shutdown: Hook = _nothing
    wrap: Wrap | None = None
    if variant == "handwritten":
        from handwritten import Connections, idempotent

        assert db is not None
        connections = Connections(db.url)
        startup, shutdown = connections.open, connections.close

        def inline(endpoint: Endpoint) -> Endpoint:
            return idempotent(endpoint, connections)

        wrap = inline

    elif variant == "ours":
        from idempotency_mw import AuthorizationTenant, IdempotencyMiddleware, PostgresStore

        assert db is not None
        store = PostgresStore(db.url)
        middleware.append(Middleware(IdempotencyMiddleware, store=store, tenant=AuthorizationTenant(TENANT_SECRET)))
        startup, shutdown = store.open, store.close
    elif variant == "ours-memory":
        from idempotency_mw import AuthorizationTenant, IdempotencyMiddleware, MemoryStore

        tenant = AuthorizationTenant(TENANT_SECRET)
        middleware.append(Middleware(IdempotencyMiddleware, store=MemoryStore(), tenant=tenant))
    elif variant == "fastidempotent":
        from fastidempotent import IdempotencyMiddleware as FastIdempotent
        from fastidempotent.backends.postgres import PostgresBackend

        assert db is not None
        backend = PostgresBackend(url=db.sqlalchemy_url(), pool_size=10)
        middleware.append(Middleware(FastIdempotent, backend=backend, methods=["POST", "PATCH"]))
        startup, shutdown = backend.init, backend.close
    elif variant == "fastapi-idempotency":
        from fastapi_idempotency import IdempotencyMiddleware as FastAPIIdempotency
        from fastapi_idempotency.stores.tortoise import TortoiseStore
        from tortoise import Tortoise

        assert db is not None
        config = {
            "connections": {
                "default": {
                    "engine": "tortoise.backends.asyncpg",
                    "credentials": {**db.tortoise_credentials(), "minsize": 1, "maxsize": 20},
                }
            },
            "apps": {"models": {"models": ["fastapi_idempotency.stores.tortoise"], "default_connection": "default"}},
        }

        async def tortoise_up() -> None:
            # Tortoise 1.x keeps its state in a context; without the global fallback the request tasks (not the
            # lifespan task that ran init) find no connection.
            await Tortoise.init(config=config, _enable_global_fallback=True)
            await Tortoise.generate_schemas(safe=True)

        middleware.append(Middleware(FastAPIIdempotency, store=TortoiseStore(), wait_seconds=0))
        startup, shutdown = tortoise_up, Tortoise.close_connections
    elif variant != "bare":
        raise ValueError(f"unknown variant {variant!r}; one of {', '.join(VARIANTS)}")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await startup()
        try:
            yield
        finally:
            await shutdown()

    return Starlette(routes=routes(gate, wrap), middleware=middleware, lifespan=lifespan), startup, shutdown


async def _nothing() -> None:
    return None


def create_app() -> Any:
    """uvicorn factory: ``BENCH_VARIANT`` picks the variant, ``BENCH_DSN`` the database."""
    dsn = os.environ.get("BENCH_DSN")
    db = Database(dsn, embedded=False, settings={}) if dsn else None
    app, _, _ = build(os.environ["BENCH_VARIANT"], db)
    return CollectorStats(app)


class Collector:
    """The time the cycle collector ran, and its runs by generation, while installed (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self._started = 0.0

    def __enter__(self) -> Collector:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started
            self.collections[info["generation"]] += 1


class CollectorStats:
    """Every variant's server keeps its :class:`Collector` installed for its whole life and answers ``GET /_gc``
    with it, so the harness can report the collector's share of the app's CPU per request; ``GET /_library`` says
    which copy of ``idempotency_mw`` it runs, so a harness that runs a git revision beside the working tree can
    check it measured the one it meant to."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.collector = Collector().__enter__()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope["path"] if scope["type"] == "http" else None
        if path == "/_gc":
            answer: dict[str, Any] = {"seconds": self.collector.seconds, "collections": self.collector.collections}
        elif path == "/_library":
            answer = {"path": LIBRARY}
        else:
            await self.app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(answer).encode()})
