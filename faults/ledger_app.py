"""The smallest app whose effects can be counted: each POST writes one row to ``faults_effects``.

Fault scenarios need handlers they can catch mid-flight (``?delay=`` seconds after the write, before the answer),
in either mode of the middleware, and a ledger that tells afterwards how many times each key took effect:

- transactional (``FAULTS_TRANSACTIONAL=1``, the default): the row is written through the request's transaction,
  so it commits with the idempotency record or not at all;
- plain (``FAULTS_TRANSACTIONAL=0``): the row is written at once through the app's own pool, and the record is
  completed after the handler returns: the seen-set window of docs/design.md §6.

Every handler first checks, through the request's connection, that the middleware's claim on its key is committed
(a handler that finds none writes ``faults_violations``), then notes its entry in ``faults_entries`` (its own pool,
committed at once, so a test sees handlers that are mid-flight): a test that freezes or kills a handler once its
entry shows never lands between the two and has it check after the retry settled. ``POST /big?size=N&pace=S``
streams N bytes (S seconds between 64 KiB chunks).

Served in a child process with ``ServerProcess("faults.ledger_app:create_app", factory=True, env=...)``; the
settings come from the environment: ``FAULTS_DSN``, ``FAULTS_TRANSACTIONAL``, ``FAULTS_LEASE`` (seconds),
``FAULTS_STORE_TIMEOUT`` (seconds), ``FAULTS_MAX_RESPONSE_BYTES``, ``FAULTS_MAX_REQUEST_BYTES``, ``FAULTS_ON_CONFLICT``
and ``FAULTS_WAIT`` (seconds); ``FAULTS_APP_POOL=N`` puts the store on an asyncpg pool of the app's, of N connections,
made in the lifespan (``PostgresStore().bind(pool)``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from idempotency_mw import IdempotencyMiddleware, PostgresStore, idempotency_context

SCHEMA = """
CREATE TABLE IF NOT EXISTS faults_effects (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant text NOT NULL, key text, pid integer NOT NULL, note text, created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS faults_effects_key ON faults_effects (key);
CREATE TABLE IF NOT EXISTS faults_entries (key text, pid integer NOT NULL, at timestamptz NOT NULL DEFAULT now());
CREATE INDEX IF NOT EXISTS faults_entries_key ON faults_entries (key);
CREATE TABLE IF NOT EXISTS faults_violations (key text, pid integer NOT NULL, what text NOT NULL);
"""
SCHEMA_LOCK = 0x1DE4_F001
# The state of a record as the middleware sees it: completed once its response exists (idempotency_responses).
RECORD_STATE = """
SELECT CASE WHEN EXISTS (SELECT FROM idempotency_responses AS s WHERE s.tenant = r.tenant AND s.key = r.key)
            THEN 'completed' ELSE 'in_progress' END
FROM idempotency_records AS r WHERE r.tenant = $1 AND r.key = $2
"""
CHUNK = 64 * 1024


async def apply_schema(connection: Any) -> None:
    async with connection.transaction():
        await connection.execute("SELECT pg_advisory_xact_lock($1)", SCHEMA_LOCK)
        await connection.execute(SCHEMA)


def harness_tenant(scope: Any) -> str:
    """The ledger's one client is the fault harness, which sends no credentials: all its keys are one tenant's."""
    return "faults"


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value is None else value.strip().lower() in ("1", "true", "yes")


def create_app(
    dsn: str | None = None,
    *,
    transactional: bool | None = None,
    lease: float | None = None,
    store_timeout: float | None = None,
    max_response_bytes: int | None = None,
    max_request_bytes: int | None = None,
    store: PostgresStore | None = None,
) -> Starlette:
    """The app on ``dsn`` (default ``$FAULTS_DSN``); every argument left out is read from the environment."""
    dsn = dsn or os.environ["FAULTS_DSN"]
    transactional = _env_flag("FAULTS_TRANSACTIONAL", True) if transactional is None else transactional
    lease = float(os.environ.get("FAULTS_LEASE", "2")) if lease is None else lease
    store_timeout = float(os.environ.get("FAULTS_STORE_TIMEOUT", "5")) if store_timeout is None else store_timeout
    if max_response_bytes is None:
        max_response_bytes = int(os.environ.get("FAULTS_MAX_RESPONSE_BYTES", str(8 * 1024 * 1024)))
    if max_request_bytes is None:
        max_request_bytes = int(os.environ.get("FAULTS_MAX_REQUEST_BYTES", str(1024 * 1024)))
    app_pool = int(os.environ.get("FAULTS_APP_POOL", "0"))  # the store on a pool of the app's, of this size
    store = store or (PostgresStore(timeout=store_timeout) if app_pool else PostgresStore(dsn, timeout=store_timeout))
    pid = os.getpid()
    pools: dict[str, asyncpg.Pool] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if app_pool:
            pools["store"] = await asyncpg.create_pool(dsn, min_size=1, max_size=app_pool)
            store.bind(pools["store"])
        await store.migrate()
        # The app's own pool (entries, plain-mode effects): never the store's, so a handler holding a transaction
        # can always get a second connection.
        pools["app"] = await asyncpg.create_pool(
            dsn, min_size=1, max_size=8, timeout=store_timeout, command_timeout=store_timeout
        )
        async with pools["app"].acquire() as connection:
            await apply_schema(connection)
        try:
            yield
        finally:
            await pools["app"].close()
            await store.close()
            if app_pool:
                await pools["store"].close()

    async def enter(request: Request) -> tuple[str, str | None]:
        context = idempotency_context(request)
        tenant = context.tenant if context else ""
        key = context.key if context else None
        if key is not None and context is not None:
            connection: Any = context.connection or pools["app"]
            state = await connection.fetchval(RECORD_STATE, tenant, key)
            if state != "in_progress":
                await pools["app"].execute(
                    "INSERT INTO faults_violations (key, pid, what) VALUES ($1, $2, $3)",
                    key,
                    pid,
                    f"handler ran while the record was {state!r}",
                )
        await pools["app"].execute("INSERT INTO faults_entries (key, pid) VALUES ($1, $2)", key, pid)
        return tenant, key

    async def write_effect(request: Request, tenant: str, key: str | None, note: str) -> int:
        context = idempotency_context(request)
        connection: Any = context.connection if context and context.connection else pools["app"]
        effect: int = await connection.fetchval(
            "INSERT INTO faults_effects (tenant, key, pid, note) VALUES ($1, $2, $3, $4) RETURNING id",
            tenant,
            key,
            pid,
            note,
        )
        return effect

    async def effects(request: Request) -> Response:
        body = await request.body()
        tenant, key = await enter(request)
        effect = await write_effect(request, tenant, key, body[:200].decode("utf-8", "replace"))
        delay = float(request.query_params.get("delay", "0"))
        if delay > 0:
            await asyncio.sleep(delay)
        return JSONResponse({"effect": effect, "pid": pid, "key": key}, status_code=201)

    async def big(request: Request) -> Response:
        await request.body()
        tenant, key = await enter(request)
        size = int(request.query_params["size"])
        pace = float(request.query_params.get("pace", "0"))  # seconds between chunks: a slow download
        effect = await write_effect(request, tenant, key, f"big {size}")

        async def chunks() -> AsyncIterator[bytes]:
            sent = 0
            while sent < size:
                part = min(CHUNK, size - sent)
                yield b"x" * part
                sent += part
                if pace > 0:
                    await asyncio.sleep(pace)

        return StreamingResponse(chunks(), media_type="application/octet-stream", headers={"x-effect": str(effect)})

    async def health(request: Request) -> Response:
        return JSONResponse({"pid": pid, "transactional": transactional})

    app = Starlette(
        routes=[
            Route("/effects", effects, methods=["POST"]),
            Route("/big", big, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.add_middleware(
        IdempotencyMiddleware,
        store=store,
        tenant=harness_tenant,
        transactional=transactional,
        lease=lease,
        max_response_bytes=max_response_bytes,
        max_request_bytes=max_request_bytes,
        on_conflict=os.environ.get("FAULTS_ON_CONFLICT", "").strip() or "reject",
        wait=float(os.environ.get("FAULTS_WAIT", "5")),
        on_event=None,
    )
    return app
