"""The ledger app (:mod:`faults.ledger_app`) with SQLAlchemy handlers: each POST writes its ``faults_effects`` row
as an ORM object through the request's ``AsyncSession`` (``idempotency_mw.sqlalchemy``), on the app's own engine.

Transactional mode only (that is what the SQLAlchemy flavour is for): the row commits with the idempotency record
or not at all. Like the asyncpg ledger, every handler first checks, through its session, that the middleware's claim
on its key is committed, writing ``faults_violations`` if not, then notes its entry in ``faults_entries`` (through a
pool of its own, committed at once). ``POST /effects?delay=S`` works S seconds after the write.

Served with ``ServerProcess("faults.ledger_sqlalchemy:create_app", factory=True, env=...)``; settings from the
environment: ``FAULTS_DSN``, ``FAULTS_LEASE`` (seconds) and ``FAULTS_STORE_TIMEOUT`` (seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

import asyncpg
from sqlalchemy import BigInteger, Identity, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from faults.ledger_app import RECORD_STATE, apply_schema, harness_tenant
from idempotency_mw import IdempotencyMiddleware, PostgresStore, idempotency_context
from idempotency_mw.sqlalchemy import SQLAlchemyStore, idempotency_session


class Base(DeclarativeBase):
    pass


class Effect(Base):
    """A row of ``faults_effects`` (the table :func:`faults.ledger_app.apply_schema` creates)."""

    __tablename__ = "faults_effects"

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=True), primary_key=True)
    tenant: Mapped[str]
    key: Mapped[str | None]
    pid: Mapped[int]
    note: Mapped[str | None]


def create_app() -> Starlette:
    dsn = os.environ["FAULTS_DSN"]
    lease = float(os.environ.get("FAULTS_LEASE", "2"))
    store_timeout = float(os.environ.get("FAULTS_STORE_TIMEOUT", "5"))
    # The handlers' connections come from the engine (one each, for the whole request); the PostgresStore only
    # claims, renews and releases, so it needs few.
    engine = create_async_engine(
        make_url(dsn).set(drivername="postgresql+asyncpg"), pool_size=20, max_overflow=0, pool_timeout=store_timeout
    )
    store = SQLAlchemyStore(PostgresStore(dsn, timeout=store_timeout, max_size=10), engine)
    pid = os.getpid()
    pools: dict[str, asyncpg.Pool] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await store.store.migrate()
        pools["app"] = await asyncpg.create_pool(
            dsn, min_size=1, max_size=8, timeout=store_timeout, command_timeout=store_timeout
        )
        async with pools["app"].acquire() as connection:
            await apply_schema(connection)
        await store.open()
        try:
            yield
        finally:
            await store.close()
            await engine.dispose()
            await pools["app"].close()

    async def effects(request: Request) -> Response:
        body = await request.body()
        context = idempotency_context(request)
        assert context is not None
        session = idempotency_session(request)
        if context.key is not None:
            state = await session.scalar(
                text(RECORD_STATE.replace("$1", ":tenant").replace("$2", ":key")),
                {"tenant": context.tenant, "key": context.key},
            )
            if state != "in_progress":
                await pools["app"].execute(
                    "INSERT INTO faults_violations (key, pid, what) VALUES ($1, $2, $3)",
                    context.key,
                    pid,
                    f"handler ran while the record was {state!r}",
                )
        await pools["app"].execute("INSERT INTO faults_entries (key, pid) VALUES ($1, $2)", context.key, pid)
        effect = Effect(tenant=context.tenant, key=context.key, pid=pid, note=body[:200].decode("utf-8", "replace"))
        session.add(effect)
        await session.flush()  # the row is written (uncommitted) before the handler works on: a kill lands after it
        delay = float(request.query_params.get("delay", "0"))
        if delay > 0:
            await asyncio.sleep(delay)
        return JSONResponse({"effect": effect.id, "pid": pid, "key": context.key}, status_code=201)

    async def health(request: Request) -> Response:
        return JSONResponse({"pid": pid, "transactional": True, "sqlalchemy": True})

    app = Starlette(
        routes=[Route("/effects", effects, methods=["POST"]), Route("/health", health, methods=["GET"])],
        lifespan=lifespan,
    )
    app.add_middleware(
        IdempotencyMiddleware,
        store=store,
        tenant=harness_tenant,
        transactional=True,
        lease=lease,
        on_conflict=os.environ.get("FAULTS_ON_CONFLICT", "").strip() or "reject",
        on_event=None,
    )
    return app
