"""The app of tests/scenarios/test_rolling_deploy.py, served both by the previous release's library and by this
one: only what both offer (the middleware, PostgresStore, the default tenant resolver), and where the library has
it, what the previous one must leave alone in the records (the request's parts, ``explain_mismatch``; the recovery
points of a handler in steps). Each run of the handler writes one row, outside the store, so a request that ran twice
shows as two."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import idempotency_mw
from idempotency_mw import IdempotencyContext, IdempotencyMiddleware, PostgresStore, idempotency_context

DSN = os.environ["ROLLING_DSN"]
store = PostgresStore(DSN)


async def charge(request: Request) -> Response:
    key = request.headers["idempotency-key"]
    await request.app.state.pool.execute("INSERT INTO rolling_effects (key) VALUES ($1)", key)
    await asyncio.sleep(0.05)  # long enough for a copy on the other instance to meet it running
    return JSONResponse({"id": f"ch_{uuid.uuid4().hex[:12]}", "key": key}, status_code=201)


async def pay(request: Request) -> Response:
    """A transactional route: a charge row, then the charge recorded. Where the library has steps, each is a local
    step with its recovery point (``X-Stop: create_charge`` answers 500 after the first, leaving the request there);
    the previous release, which has none, writes both in one transaction (``X-Fail`` answers 500 before either)."""
    context = idempotency_context(request)
    assert context is not None
    connection, key = context.connection, context.key
    assert connection is not None
    assert key is not None
    if request.headers.get("x-fail"):
        return JSONResponse({"error": "failed before any write"}, status_code=500)

    async def create_charge() -> str:
        await connection.execute("INSERT INTO rolling_effects (key) VALUES ($1)", key)
        return key

    async def record_charge() -> str:
        return "succeeded"

    if not STEPS:
        return JSONResponse({"charge": await create_charge(), "state": await record_charge()}, status_code=201)
    steps = context.steps
    charge = await steps.local("create_charge", create_charge)
    if request.headers.get("x-stop") == "create_charge":
        return JSONResponse({"error": "stopped after create_charge"}, status_code=500)
    return JSONResponse({"charge": charge, "state": await steps.local("record_charge", record_charge)}, status_code=201)


async def version(request: Request) -> Response:
    return JSONResponse({"version": idempotency_mw.__version__, "file": idempotency_mw.__file__})


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    await store.open()
    app.state.pool = await asyncpg.create_pool(DSN, min_size=1, max_size=5)
    try:
        yield
    finally:
        await app.state.pool.close()
        await store.close()


app = Starlette(
    routes=[
        Route("/charges", charge, methods=["POST"]),
        Route("/pay", pay, methods=["POST"]),
        Route("/version", version),
    ],
    lifespan=lifespan,
)
STEPS = hasattr(IdempotencyContext, "steps")  # this version, not the previous one
newer: dict[str, Any] = {}
if "explain_mismatch" in inspect.signature(IdempotencyMiddleware).parameters:  # this version, not the previous one
    newer["explain_mismatch"] = True
app.add_middleware(IdempotencyMiddleware, store=store, routes={"/pay": {"transactional": True}}, **newer)
