"""sqlalchemy.py: transactional mode with SQLAlchemy (docs/guide.md), what only this flavour has. The handler writes
ORM objects through the AsyncSession the middleware lends, which works in a savepoint of the request's transaction;
the store checks the engine it is given, lends a session per request and gives its connection back clean; SQLModel
and the FastAPI dependency. The cases both flavours share (the effect and the record commit together or neither does)
run on a SQLAlchemyStore in test_transaction.py."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from sqlalchemy import event, exc, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.pool import QueuePool
from sqlmodel import select as sqlmodel_select
from sqlmodel.ext.asyncio.session import AsyncSession as SQLModelSession
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idempotency_mw import IdempotencyMiddleware, MemoryStore, PostgresStore, idempotency_context, idempotent
from idempotency_mw._events import Outcome
from idempotency_mw.fastapi import IdempotencyConnection, setup
from idempotency_mw.metrics import PrometheusMetrics
from idempotency_mw.postgres._sql import contract_statements
from idempotency_mw.sqlalchemy import IdempotencySession, SQLAlchemyConnector, SQLAlchemyStore, idempotency_session
from idempotency_mw.store import StoredResponse, TransactionalStore, TransactionEnded
from tests.conftest import client_for, tenant_of
from tests.orm import SCHEMA, Effect, Note, create_tables, sqlalchemy_url
from tests.sessions import SESSION_LEAKS, SESSION_STATE


@pytest.fixture
async def engine(idempotency_database_url: str, tables: None) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(sqlalchemy_url(idempotency_database_url), pool_size=5, max_overflow=0)
    yield engine
    await engine.dispose()


@pytest.fixture
async def tables(idempotency_database_url: str) -> None:
    """The test models' tables, in a schema of their own."""
    await create_tables(idempotency_database_url)


@pytest.fixture
async def store(idempotency_database_url: str, engine: AsyncEngine) -> AsyncIterator[SQLAlchemyStore]:
    store = SQLAlchemyStore(PostgresStore(idempotency_database_url), engine)
    await store.open()
    try:
        yield store
    finally:
        await store.close(grace=0)  # tests leave claims in progress on purpose


class Gate:
    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.go = asyncio.Event()
        self.go.set()


def build(store: SQLAlchemyStore, gate: Gate | None = None, **options: Any) -> Starlette:
    async def write(request: Request) -> Response:
        session = idempotency_session(request)
        context = idempotency_context(request)
        assert context is not None
        note = request.query_params.get("note") or (await request.body()).decode() or "ok"
        session.add(Effect(key=context.key or "none", note=note))  # not flushed: the middleware flushes it
        if request.query_params.get("flush"):
            await session.flush()
        if gate is not None:
            gate.entered.set()
            await gate.go.wait()
        if note == "raise":
            raise RuntimeError("handler failed after writing")
        if note == "500":
            return JSONResponse({"error": "late failure"}, status_code=500)
        if note == "committed-then-500":
            await session.commit()  # releases the session's savepoint: the request's transaction goes on
            return JSONResponse({"error": "late failure"}, status_code=500)
        if note == "big":
            return Response(b"y" * 5000)
        if note == "closed":
            await session.close()
        if note == "reset":
            await session.reset()  # SQLAlchemy 2.0.22's close that keeps the session usable
        if note == "left":
            async with session:  # closes the session on the way out
                session.add(Effect(key=context.key or "none", note="left"))
        if note == "http400":
            raise HTTPException(400, "insufficient funds")
        return JSONResponse({"written": note}, status_code=201)

    app = Starlette(routes=[Route("/write", write, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=True, **options)
    return app


async def effects(db: asyncpg.Connection, key: str) -> int:
    return int(await db.fetchval(f"SELECT count(*) FROM {SCHEMA}.effects WHERE key = $1", key))


def test_the_middleware_takes_it_as_a_transactional_store(store: SQLAlchemyStore) -> None:
    assert isinstance(store, TransactionalStore)
    IdempotencyMiddleware(Starlette(), store, transactional=True)


async def test_a_store_bound_to_the_apps_pool_keeps_its_transactions_on_the_engine(
    idempotency_database_url: str, engine: AsyncEngine, db: asyncpg.Connection, key: str
) -> None:
    """``SQLAlchemyStore(PostgresStore(), engine).bind(pool)`` in a lifespan: the store's statements on the app's
    asyncpg pool, the handlers' transactions on the engine."""
    store = SQLAlchemyStore(PostgresStore(), engine)
    async with asyncpg.create_pool(idempotency_database_url, min_size=1, max_size=4) as pool:
        await store.bind(pool).open()
        try:
            client = client_for(build(store))
            first = await client.post("/write", headers={"Idempotency-Key": key})
            again = await client.post("/write", headers={"Idempotency-Key": key})
        finally:
            await store.close(grace=0)
    assert first.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert await effects(db, key) == 1


async def test_a_session_commit_before_a_failure_is_rolled_back_with_it(
    store: SQLAlchemyStore, db: asyncpg.Connection
) -> None:
    """The handler calls session.commit() and then fails (500): that commit ended the session's savepoint, not the
    request's transaction, so the write and the record roll back together and the retry runs afresh. (Failures
    without a session commit: test_transaction.py, on both flavours.)"""
    key = str(uuid.uuid4())
    client = client_for(build(store))
    response = await client.post("/write?note=committed-then-500&flush=1", headers={"Idempotency-Key": key})
    assert response.status_code == 500
    assert await effects(db, key) == 0
    assert await store.inspect(tenant_of(), key) is None
    retry = await client.post("/write?note=ok", headers={"Idempotency-Key": key})
    assert retry.status_code == 201
    assert await effects(db, key) == 1


async def test_the_sessions_own_commit_and_rollback_do_not_end_the_transaction(
    store: SQLAlchemyStore, db: asyncpg.Connection, key: str
) -> None:
    """The session works in a savepoint: rollback() undoes what it wrote since, commit() releases it; the request's
    transaction goes on, and commits the rest with the record."""

    async def write(request: Request) -> Response:
        session = idempotency_session(request)
        session.add(Effect(key=key, note="undone"))
        await session.rollback()
        session.add(Effect(key=key, note="kept"))
        await session.commit()
        session.add(Effect(key=key, note="after its commit"))
        return JSONResponse({"ok": True}, status_code=201)

    app = Starlette(routes=[Route("/write", write, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=True)
    assert (await client_for(app).post("/write", headers={"Idempotency-Key": key})).status_code == 201
    notes = await db.fetchval(f"SELECT array_agg(note ORDER BY id) FROM {SCHEMA}.effects WHERE key = $1", key)
    assert notes == ["kept", "after its commit"]


def build_refusing(store: SQLAlchemyStore) -> Starlette:
    """Handlers whose transaction the database refuses after a flush the handler caught (the session then needs a
    rollback), and one that recovers properly, in a savepoint. (A deferred constraint, a caught database error:
    test_transaction.py, on both flavours.)"""

    async def write(request: Request) -> Response:
        session = idempotency_session(request)
        context = idempotency_context(request)
        assert context is not None
        assert context.key is not None
        how = request.query_params["how"]
        session.add(Effect(key=context.key, note=how))
        if how in ("failed_flush", "failed_flush_in_savepoint"):
            if how == "failed_flush_in_savepoint":
                await session.begin_nested()  # never ended: the failed flush rolls it back, "first" with it
            first = Effect(key=context.key, note="first")
            session.add(first)
            await session.flush()
            session.expunge(first)
            session.add(Effect(id=first.id, key=context.key, note="same id"))
            with contextlib.suppress(exc.IntegrityError):
                await session.flush()  # caught, but the session now refuses to go on without a rollback
        elif how == "savepoint":
            with contextlib.suppress(exc.DBAPIError):
                async with session.begin_nested():
                    await session.execute(text("SELECT 1 / 0"))  # undone to the savepoint; the rest goes on
        return JSONResponse({"written": how}, status_code=201)

    app = Starlette(routes=[Route("/write", write, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=True)
    return app


@pytest.mark.parametrize(
    ("how", "error"),
    [("failed_flush", exc.PendingRollbackError), ("failed_flush_in_savepoint", exc.PendingRollbackError)],
)
async def test_a_transaction_the_database_refuses_is_a_handler_failure(
    store: SQLAlchemyStore, db: asyncpg.Connection, how: str, error: type[Exception], caplog: pytest.LogCaptureFixture
) -> None:
    """Not a 503 (the database is fine, and a retry would fail the same way): the request fails like a handler
    error, nothing is committed, and the key is free for a corrected retry."""
    key = str(uuid.uuid4())
    client = client_for(build_refusing(store))
    with pytest.raises(error):
        await client.post(f"/write?how={how}", headers={"Idempotency-Key": key})
    assert await effects(db, key) == 0
    assert await store.inspect(tenant_of(), key) is None
    assert "could not commit" in caplog.text
    retry = await client.post("/write?how=fixed", headers={"Idempotency-Key": key})
    assert retry.status_code == 201
    assert await effects(db, key) == 1


async def test_an_error_caught_in_a_savepoint_leaves_the_transaction_usable(
    store: SQLAlchemyStore, db: asyncpg.Connection
) -> None:
    key = str(uuid.uuid4())
    response = await client_for(build_refusing(store)).post("/write?how=savepoint", headers={"Idempotency-Key": key})
    assert response.status_code == 201
    assert await effects(db, key) == 1


async def test_an_engine_that_cannot_reach_the_database_is_503(idempotency_database_url: str, key: str) -> None:
    """The claim succeeded (the store is fine), but no transaction could begin on the engine: 503, key free."""
    dead = create_async_engine("postgresql+asyncpg://nobody@127.0.0.1:1/none")
    try:
        async with PostgresStore(idempotency_database_url) as records:
            store = SQLAlchemyStore(records, dead)
            response = await client_for(build(store)).post("/write", headers={"Idempotency-Key": key})
            assert response.status_code == 503
            assert await store.inspect(tenant_of(), key) is None
    finally:
        await dead.dispose()


@pytest.mark.parametrize("pool_timeout", [30.0, 0.2], ids=["store-timeout-first", "pool-timeout-first"])
async def test_an_exhausted_engine_pool_is_503_within_the_store_timeout(
    idempotency_database_url: str, tables: None, caplog: pytest.LogCaptureFixture, pool_timeout: float
) -> None:
    """Every connection of the engine's pool is busy: 503 within the store's timeout (or the pool's own, if
    shorter), reported as pool_exhausted with the engine's settings to raise, not as a database that is down."""
    engine = create_async_engine(
        sqlalchemy_url(idempotency_database_url), pool_size=1, max_overflow=0, pool_timeout=pool_timeout
    )
    gate = Gate()
    gate.go.clear()
    outcomes: list[Outcome] = []
    try:
        async with SQLAlchemyStore(PostgresStore(idempotency_database_url, timeout=0.5), engine) as store:
            client = client_for(build(store, gate, on_event=lambda event: outcomes.append(event.outcome)))
            holder = asyncio.create_task(client.post("/write", headers={"Idempotency-Key": str(uuid.uuid4())}))
            await asyncio.wait_for(gate.entered.wait(), 5)
            key = str(uuid.uuid4())
            waiting = await asyncio.wait_for(client.post("/write", headers={"Idempotency-Key": key}), 10)
            assert waiting.status_code == 503
            assert outcomes == [Outcome.POOL_EXHAUSTED]
            assert "the SQLAlchemy engine's pool is exhausted" in caplog.text
            assert "(max_size=1)" in caplog.text
            assert "raise pool_size or max_overflow" in caplog.text
            assert await store.inspect(tenant_of(), key) is None
            gate.go.set()
            assert (await holder).status_code == 201
    finally:
        await engine.dispose()


async def test_the_session_used_after_the_commit_is_rolled_back_and_said_so(
    store: SQLAlchemyStore, db: asyncpg.Connection, key: str
) -> None:
    """A background task runs after the commit: writing through the request's session there would not be part of
    the request's transaction. It is rolled back, and the app hears it; the committed answer stands."""

    async def late_write(session: AsyncSession, key: str) -> None:
        session.add(Effect(key=key, note="background"))
        await session.flush()

    async def write(request: Request) -> Response:
        session = idempotency_session(request)
        session.add(Effect(key=key, note="handler"))
        return JSONResponse({"ok": True}, status_code=201, background=BackgroundTask(late_write, session, key))

    app = Starlette(routes=[Route("/write", write, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=True)
    with pytest.raises(RuntimeError, match="used after its transaction had ended"):
        await client_for(app).post("/write", headers={"Idempotency-Key": key})
    assert await db.fetchval(f"SELECT array_agg(note) FROM {SCHEMA}.effects WHERE key = $1", key) == ["handler"]
    info = await store.inspect(tenant_of(), key)
    assert info is not None
    assert info.state == "completed"


# -- the connection goes back to the engine's pool with a clean session ---------------------------------------


def build_leaky(store: SQLAlchemyStore, seen: list[dict[str, Any]]) -> Starlette:
    async def leak(request: Request) -> Response:
        session = idempotency_session(request)
        await session.execute(text(SESSION_LEAKS[request.path_params["what"]]))
        return JSONResponse({"left": request.path_params["what"]}, status_code=201)

    async def look(request: Request) -> Response:
        session = idempotency_session(request)
        seen.append(dict((await session.execute(text(SESSION_STATE))).mappings().one()))
        return JSONResponse({"looked": True}, status_code=201)

    app = Starlette(routes=[Route("/leak/{what}", leak, methods=["POST"]), Route("/look", look, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=True, tenant=lambda scope: "t-sqla-leak")
    return app


@pytest.mark.parametrize("what", sorted(SESSION_LEAKS))
async def test_the_connection_goes_back_to_the_pool_with_a_clean_session(
    idempotency_database_url: str, leak_role: str, db: asyncpg.Connection, what: str
) -> None:
    """Whatever a handler did to its session (a role for row-level security, a schema, a temp table, a prepared
    statement, a lock, a LISTEN), the next user of that pooled connection, a handler or the app itself, starts as
    the engine's login role with a clean session. SQLAlchemy's pool alone would only roll back."""
    login = await db.fetchval("SELECT current_user")
    engine = create_async_engine(sqlalchemy_url(idempotency_database_url), pool_size=1, max_overflow=0)
    connects: list[int] = []
    event.listen(engine.sync_engine, "connect", lambda *args: connects.append(1))
    try:
        async with SQLAlchemyStore(PostgresStore(idempotency_database_url), engine) as store:
            seen: list[dict[str, Any]] = []
            client = client_for(build_leaky(store, seen))
            assert (await client.post("/look", headers={"Idempotency-Key": str(uuid.uuid4())})).status_code == 201
            assert (
                await client.post(f"/leak/{what}", headers={"Idempotency-Key": str(uuid.uuid4())})
            ).status_code == 201
            assert (await client.post("/look", headers={"Idempotency-Key": str(uuid.uuid4())})).status_code == 201
            assert seen[1] == seen[0]
            assert seen[1]["current_user"] == seen[1]["session_user"] == login
            async with engine.connect() as connection:  # the app's own use of its engine
                assert dict((await connection.execute(text(SESSION_STATE))).mappings().one()) == seen[0]
        assert isinstance(engine.pool, QueuePool)
        assert engine.pool.checkedout() == 0
        assert len(connects) == 1  # one pooled connection served every request: it was reset, not replaced
    finally:
        await engine.dispose()


# -- FastAPI ------------------------------------------------------------------------------------------------


def build_fastapi(store: SQLAlchemyStore | PostgresStore, *, enabled: bool = True) -> FastAPI:
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=store, enabled=enabled)
    setup(app)

    @app.post("/v1/effects", status_code=201)
    @idempotent(transactional=True, required=True)
    async def create(body: dict[str, str], session: IdempotencySession) -> dict[str, Any]:
        effect = Effect(key=body["key"], note=body["note"])
        session.add(effect)
        await session.flush()  # for the id
        count = (await session.execute(select(Effect).where(Effect.key == body["key"]))).scalars().all()
        return {"id": effect.id, "seen": len(count)}

    @app.post("/v1/plain")
    async def plain(session: IdempotencySession) -> dict[str, Any]:
        return {}

    return app


async def test_fastapi_handlers_get_the_session_as_a_dependency(store: SQLAlchemyStore, db: asyncpg.Connection) -> None:
    key = str(uuid.uuid4())
    client = client_for(build_fastapi(store))
    body = {"key": key, "note": "fastapi"}
    first = await client.post("/v1/effects", json=body, headers={"Idempotency-Key": key})
    assert first.status_code == 201
    assert first.json()["seen"] == 1
    again = await client.post("/v1/effects", json=body, headers={"Idempotency-Key": key})
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json()
    assert await effects(db, key) == 1


async def test_switched_off_a_handler_still_gets_its_session(store: SQLAlchemyStore, db: asyncpg.Connection) -> None:
    """``enabled=False``: nothing is claimed or replayed, and the route that requires a key runs without one, with
    its session, whose writes commit with the final answer."""
    key = str(uuid.uuid4())
    client = client_for(build_fastapi(store, enabled=False))
    body = {"key": key, "note": "switched off"}
    answers = [await client.post("/v1/effects", json=body, headers={"Idempotency-Key": key}) for _ in range(2)]
    answers.append(await client.post("/v1/effects", json=body))
    assert [(answer.status_code, answer.json()["seen"]) for answer in answers] == [(201, 1), (201, 2), (201, 3)]
    assert await effects(db, key) == 3
    assert await store.inspect(tenant_of(), key) is None


async def test_the_session_dependency_says_why_there_is_none(store: SQLAlchemyStore, pg_store: PostgresStore) -> None:
    with pytest.raises(RuntimeError, match="not transactional"):
        await client_for(build_fastapi(store)).post("/v1/plain", headers={"Idempotency-Key": str(uuid.uuid4())})
    with pytest.raises(RuntimeError, match="not a SQLAlchemy session"):
        await client_for(build_fastapi(pg_store)).post(
            "/v1/effects", json={"key": "k", "note": "n"}, headers={"Idempotency-Key": str(uuid.uuid4())}
        )


async def test_sqlmodel_sessions_work_the_same(idempotency_database_url: str, engine: AsyncEngine) -> None:
    """SQLModel's AsyncSession is an AsyncSession: pass it as session_class, and use its exec()."""

    async def write(request: Request) -> Response:
        session = idempotency_session(request)
        assert isinstance(session, SQLModelSession)
        context = idempotency_context(request)
        assert context is not None
        assert context.key is not None
        session.add(Note(key=context.key))
        await session.flush()
        found = (await session.exec(sqlmodel_select(Note).where(Note.key == context.key))).all()
        return JSONResponse({"notes": len(found)}, status_code=201 if request.query_params.get("ok") else 500)

    key = str(uuid.uuid4())
    async with SQLAlchemyStore(PostgresStore(idempotency_database_url), engine, session_class=SQLModelSession) as store:
        app = Starlette(routes=[Route("/write", write, methods=["POST"])])
        app.add_middleware(IdempotencyMiddleware, store=store, transactional=True)
        client = client_for(app)
        failed = await client.post("/write", headers={"Idempotency-Key": key})
        assert (failed.status_code, failed.json()) == (500, {"notes": 1})
        done = await client.post("/write?ok=1", headers={"Idempotency-Key": key})
        assert (done.status_code, done.json()) == (201, {"notes": 1})  # the failed attempt's note was rolled back
    async with SQLModelSession(engine) as session:
        assert len((await session.exec(sqlmodel_select(Note).where(Note.key == key))).all()) == 1


# -- the store ------------------------------------------------------------------------------------------------


async def test_open_refuses_an_engine_on_another_database(
    idempotency_database_url: str, db: asyncpg.Connection
) -> None:
    if not await db.fetchval("SELECT 1 FROM pg_database WHERE datname = 'imw_sqla_other'"):
        with contextlib.suppress(asyncpg.DuplicateDatabaseError):
            await db.execute("CREATE DATABASE imw_sqla_other")
    other = create_async_engine(
        make_url(sqlalchemy_url(idempotency_database_url)).set(database="imw_sqla_other").render_as_string(False)
    )
    store = SQLAlchemyStore(PostgresStore(idempotency_database_url), other)
    try:
        with pytest.raises(ValueError, match="imw_sqla_other"):
            await store.open()
    finally:
        await store.close()
        await other.dispose()


async def test_an_engine_in_autocommit_is_refused(
    idempotency_database_url: str, tables: None, db: asyncpg.Connection, key: str
) -> None:
    """AUTOCOMMIT would commit each ORM write on its own, whatever became of the request: refused at open(), and
    by every request of a store that was not opened, with nothing written and the key free."""
    autocommit = create_async_engine(sqlalchemy_url(idempotency_database_url), isolation_level="AUTOCOMMIT")
    try:
        async with PostgresStore(idempotency_database_url) as records:
            store = SQLAlchemyStore(records, autocommit)
            with pytest.raises(ValueError, match="AUTOCOMMIT"):
                await store.open()
            with pytest.raises(ValueError, match="AUTOCOMMIT"):
                await client_for(build(store)).post("/write?flush=1", headers={"Idempotency-Key": key})
            assert await effects(db, key) == 0
            assert await store.inspect(tenant_of(), key) is None
        assert autocommit.pool.checkedout() == 0  # type: ignore[attr-defined]
    finally:
        await autocommit.dispose()


async def test_close_leaves_the_engine_to_the_app(idempotency_database_url: str, engine: AsyncEngine) -> None:
    async with SQLAlchemyStore(PostgresStore(idempotency_database_url), engine):
        pass
    async with engine.connect() as connection:
        assert (await connection.execute(text("SELECT 1"))).scalar_one() == 1


async def test_a_closed_store_opens_again(
    idempotency_database_url: str, engine: AsyncEngine, db: asyncpg.Connection
) -> None:
    """The guide's lifespan (open the store; close it and dispose of the engine) run once per test on a module-level
    store: the second open() found the PostgresStore's pool closed."""
    store = SQLAlchemyStore(PostgresStore(idempotency_database_url, max_size=2), engine)
    for _ in range(2):
        await store.open()
        key = str(uuid.uuid4())
        response = await client_for(build(store)).post("/write", headers={"Idempotency-Key": key})
        assert response.status_code == 201
        assert await effects(db, key) == 1
        await store.close()
        await engine.dispose()


async def test_what_the_docs_call_on_a_store_works_on_a_sqlalchemy_store(
    idempotency_database_url: str, engine: AsyncEngine, db: asyncpg.Connection
) -> None:
    """The guide's ``await store.migrate()``, the metrics' ``update_from_store(store)`` (``stats()``) and the
    operator calls raised AttributeError on a SQLAlchemyStore."""
    schema = f"imw_sqla_ops_{uuid.uuid4().hex[:8]}"
    store = SQLAlchemyStore(PostgresStore(idempotency_database_url, max_size=2, schema=schema), engine)
    try:
        assert await store.migrate() != []  # needs no open() first, as with a PostgresStore
        assert await store.migrate() == []
        await store.open()
        claim = await store.claim("t-ops", "kept", b"f" * 32, lease=30, ttl=60)
        assert await store.complete("t-ops", "kept", claim.fence, StoredResponse(201, [], b"{}", 2))
        await store.claim("t-ops", "gone", b"f" * 32, lease=0.01, ttl=0.01)
        await asyncio.sleep(0.05)
        assert (await store.stats())["completed"] == 1
        assert await store.count_expired() == 1
        metrics = PrometheusMetrics(CollectorRegistry())
        await metrics.update_from_store(store)
        assert metrics.records.labels("completed")._value.get() == 1
        assert await store.purge_expired(batch_size=10) == 1
        info = await store.inspect("t-ops", "kept")
        assert info is not None
        assert info.state == "completed"
        assert await store.forget("t-ops", "kept")
        assert await store.inspect("t-ops", "kept") is None
    finally:
        await store.close(grace=0)
        await db.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def test_a_sqlalchemy_store_is_a_postgres_store_that_lends_the_engines_connections(
    store: SQLAlchemyStore, pg_store: PostgresStore
) -> None:
    """Every operation of a PostgresStore is a SQLAlchemyStore's own: it is one, on the records and connections of
    the store it was given, with the engine's connections lent to handlers (``SQLAlchemyConnector``)."""
    assert isinstance(store, PostgresStore)
    assert isinstance(store.connector, SQLAlchemyConnector)
    assert store.store is not store


def test_bad_arguments_are_refused_with_what_is_needed(idempotency_database_url: str) -> None:
    async_engine = create_async_engine(sqlalchemy_url(idempotency_database_url))
    with pytest.raises(TypeError, match="PostgresStore"):
        SQLAlchemyStore(MemoryStore(), async_engine)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="AsyncEngine"):
        SQLAlchemyStore(PostgresStore(idempotency_database_url), async_engine.sync_engine)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="session_class"):
        SQLAlchemyStore(PostgresStore(idempotency_database_url), async_engine, session_class=dict)  # type: ignore[arg-type]


async def test_asking_for_the_asyncpg_connection_under_sqlalchemy_names_the_session(store: SQLAlchemyStore) -> None:
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=True)

    @app.post("/v1/raw")
    async def raw(db: IdempotencyConnection) -> dict[str, Any]:
        return {}

    with pytest.raises(RuntimeError, match="take IdempotencySession"):
        await client_for(app).post("/v1/raw", headers={"Idempotency-Key": str(uuid.uuid4())})


# -- what apps do with their session ---------------------------------------------------------------------------


@pytest.mark.parametrize(("note", "written"), [("closed", 1), ("reset", 1), ("left", 2)])
async def test_closing_the_session_keeps_its_writes(
    store: SQLAlchemyStore, db: asyncpg.Connection, note: str, written: int
) -> None:
    """A handler that closes its session (``await session.close()``, or leaving ``async with session:``) must not
    leave a record of an answer whose writes the close threw away: the close keeps them, and they commit with it."""
    key = str(uuid.uuid4())
    client = client_for(build(store))
    assert (await client.post(f"/write?note={note}", headers={"Idempotency-Key": key})).status_code == 201
    assert await effects(db, key) == written
    retry = await client.post(f"/write?note={note}", headers={"Idempotency-Key": key})
    assert retry.headers["idempotent-replayed"] == "true"
    assert await effects(db, key) == written


def build_untouched(store: SQLAlchemyStore) -> Starlette:
    async def refuse(request: Request) -> Response:
        idempotency_session(request)  # taken, never used
        raise HTTPException(422, "amount must be positive")

    async def answer(request: Request) -> Response:
        idempotency_session(request)
        return JSONResponse({"nothing": "written"}, status_code=201)

    app = Starlette(routes=[Route("/refuse", refuse, methods=["POST"]), Route("/answer", answer, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=True)
    return app


@pytest.mark.parametrize(("path", "status"), [("/refuse", 422), ("/answer", 201)])
async def test_a_handler_that_never_touches_its_session_is_recorded(
    store: SQLAlchemyStore, path: str, status: int
) -> None:
    """No statement ran on the session, so no transaction began on the server: that is not a handler that ended
    the transaction itself, and the answer is recorded and replayed like any other."""
    key = str(uuid.uuid4())
    client = client_for(build_untouched(store))
    first = await client.post(path, headers={"Idempotency-Key": key})
    assert first.status_code == status
    retry = await client.post(path, headers={"Idempotency-Key": key})
    assert retry.headers["idempotent-replayed"] == "true"
    assert (retry.status_code, retry.content) == (status, first.content)


# -- a handler that ends the request's transaction -------------------------------------------------------------

ENDINGS = {
    "ROLLBACK; BEGIN": ("ROLLBACK", "BEGIN"),
    "COMMIT; BEGIN": ("COMMIT", "BEGIN"),
    "COMMIT AND CHAIN": ("COMMIT AND CHAIN",),
    "RESET ALL": ("RESET ALL",),
}


async def run_raw(session: AsyncSession, through: str, statements: tuple[str, ...]) -> None:
    """Run ``statements`` as a handler can: through the session (``text()``), through its connection
    (``exec_driver_sql``), through the asyncpg connection under it (in one simple query), or as that
    connection's own methods (``await connection.rollback()``, then ``begin()``)."""
    if through == "session":
        for statement in statements:
            await session.execute(text(statement))
        return
    connection = await session.connection()
    if through == "connection":
        for statement in statements:
            await connection.exec_driver_sql(statement)
    elif through == "methods":
        for statement in statements:
            await getattr(connection, statement.lower())()
    else:
        raw = await connection.get_raw_connection()
        driver: Any = raw.driver_connection  # asyncpg's Connection
        await driver.execute("; ".join(statements))


def build_ending(store: SQLAlchemyStore, through: str, ending: str) -> Starlette:
    """A charge that writes, runs ``ending`` through ``through`` (unless ``?fixed=1``), writes again and answers
    201."""

    async def charge(request: Request) -> Response:
        session = idempotency_session(request)
        context = idempotency_context(request)
        assert context is not None
        assert context.key is not None
        session.add(Effect(key=context.key, note="before"))
        await session.flush()
        if not request.query_params.get("fixed"):
            await run_raw(session, through, ENDINGS[ending])
        session.add(Effect(key=context.key, note="after"))
        await session.flush()
        return JSONResponse({"charged": True}, status_code=201)

    app = Starlette(routes=[Route("/charge", charge, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=True)
    return app


@pytest.mark.parametrize(
    ("ending", "through"),
    [(ending, through) for ending in ENDINGS for through in ("session", "connection", "driver")]
    + [("ROLLBACK; BEGIN", "methods"), ("COMMIT; BEGIN", "methods")],
)
async def test_a_handler_that_ends_its_transaction_and_begins_another_gets_no_record(
    store: SQLAlchemyStore, db: asyncpg.Connection, key: str, through: str, ending: str
) -> None:
    """SQLAlchemy passes a raw ROLLBACK, COMMIT or BEGIN on without reading it, and the connection is in a
    transaction again as the handler returns, but not in the one the store began: recorded in it, a retry would
    replay a 201 for a charge rolled back, or the record would commit apart from the half the handler committed. A
    RESET ALL clears the store's mark of its transaction, and is taken for its end (guide.md). Refused as on asyncpg
    (``TransactionEnded``): no record, the key free, and the retry runs."""
    client = client_for(build_ending(store, through, ending))
    with pytest.raises(TransactionEnded):
        await client.post("/charge", headers={"Idempotency-Key": key})
    assert await store.inspect(tenant_of(), key) is None
    kept = 1 if ending.startswith("COMMIT") else 0  # the handler's own COMMIT stays
    assert await effects(db, key) == kept
    retry = await client.post("/charge?fixed=1", headers={"Idempotency-Key": key})
    assert retry.status_code == 201
    assert await effects(db, key) == kept + 2


async def test_a_step_that_ends_its_transaction_and_begins_another_leaves_no_recovery_point(
    store: SQLAlchemyStore, db: asyncpg.Connection, key: str
) -> None:
    """A step's recovery point written in the handler's own transaction after its ROLLBACK would commit without the
    step's writes: the retry would resume after a step whose effect never landed. (The step commits its session
    first, so no savepoint of the session's is left to fail on the way.)"""

    async def charge(request: Request) -> Response:
        session = idempotency_session(request)
        context = idempotency_context(request)
        assert context is not None

        async def create() -> dict[str, Any]:
            connection = await session.connection()
            session.add(Effect(key=key, note="created"))
            await session.commit()  # the session's savepoint released: the write is in the request's transaction
            for statement in ENDINGS["ROLLBACK; BEGIN"]:
                await connection.exec_driver_sql(statement)
            return {"charge": "c-1"}

        await context.steps.local("create_charge", create)
        return JSONResponse({"charged": True}, status_code=201)

    app = Starlette(routes=[Route("/charge", charge, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=True)
    with pytest.raises(TransactionEnded):
        await client_for(app).post("/charge", headers={"Idempotency-Key": key})
    points = "SELECT count(*) FROM idempotency_recovery_points WHERE key = $1"
    assert await db.fetchval(points, key) == 0
    assert await store.inspect(tenant_of(), key) is None
    assert await effects(db, key) == 0


@pytest.mark.parametrize("statement", ["ROLLBACK", "COMMIT"])
@pytest.mark.parametrize("where", ["answer", "step"])
async def test_what_the_session_holds_after_its_transaction_ended_is_not_flushed_on_its_own(
    store: SQLAlchemyStore, db: asyncpg.Connection, key: str, statement: str, where: str
) -> None:
    """After a raw ROLLBACK or COMMIT the connection is in no transaction, while SQLAlchemy still counts one open: a
    flush there would run statement by statement, each committing on its own, and a retry would write it again. The
    store refuses before it flushes what the session still holds, as the handler answers or as its step ends."""

    async def charge(request: Request) -> Response:
        session = idempotency_session(request)
        context = idempotency_context(request)
        assert context is not None

        async def create() -> dict[str, Any]:
            session.add(Effect(key=key, note="before"))
            await session.flush()
            if not request.query_params.get("fixed"):
                await session.execute(text(statement))
            session.add(Effect(key=key, note="pending"))  # not flushed: the middleware flushes it
            return {"charge": "c-1"}

        if where == "step":
            await context.steps.local("create_charge", create)
        else:
            await create()
        return JSONResponse({"charged": True}, status_code=201)

    app = Starlette(routes=[Route("/charge", charge, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=True)
    client = client_for(app)
    with pytest.raises(TransactionEnded):
        await client.post("/charge", headers={"Idempotency-Key": key})
    assert await store.inspect(tenant_of(), key) is None
    kept = 1 if statement == "COMMIT" else 0  # the handler's own COMMIT stays
    assert await effects(db, key) == kept
    retry = await client.post("/charge?fixed=1", headers={"Idempotency-Key": key})
    assert retry.status_code == 201
    assert await effects(db, key) == kept + 2


async def test_the_engines_connect_time_session_comes_back_after_a_request(
    idempotency_database_url: str, leak_role: str, db: asyncpg.Connection
) -> None:
    """An engine whose ``connect`` event sets a role and a search_path (what apps do for row-level security or a
    schema per service): after a handler changed both, the next user of that connection finds the engine's."""
    if not await db.fetchval("SELECT 1 FROM pg_roles WHERE rolname = 'imw_app_role'"):
        with contextlib.suppress(asyncpg.DuplicateObjectError):
            await db.execute("CREATE ROLE imw_app_role SUPERUSER")
    engine = create_async_engine(sqlalchemy_url(idempotency_database_url), pool_size=1, max_overflow=0)

    @event.listens_for(engine.sync_engine, "connect", insert=True)
    def connect(dbapi_connection: Any, record: Any) -> None:  # SQLAlchemy's recipe for session settings
        autocommit = dbapi_connection.autocommit
        dbapi_connection.autocommit = True
        cursor = dbapi_connection.cursor()
        cursor.execute(f"SET search_path = {SCHEMA}, public")
        cursor.execute("SET ROLE imw_app_role")
        cursor.close()
        dbapi_connection.autocommit = autocommit

    try:
        async with SQLAlchemyStore(PostgresStore(idempotency_database_url), engine) as store:
            seen: list[dict[str, Any]] = []
            client = client_for(build_leaky(store, seen))
            for path in ("/look", "/leak/role", "/leak/search_path", "/look"):
                assert (await client.post(path, headers={"Idempotency-Key": str(uuid.uuid4())})).status_code == 201
            assert (seen[0]["current_user"], seen[0]["search_path"]) == ("imw_app_role", f"{SCHEMA}, public")
            assert seen[1] == seen[0]
            async with engine.connect() as connection:  # the app's own use of its engine
                assert dict((await connection.execute(text(SESSION_STATE))).mappings().one()) == seen[0]
    finally:
        await engine.dispose()


async def test_a_kept_session_refuses_use_after_its_request(store: SQLAlchemyStore, db: asyncpg.Connection) -> None:
    """A task that kept the request's session must not reach the next request's transaction on that connection."""
    kept: list[AsyncSession] = []

    async def keep(request: Request) -> Response:
        kept.append(idempotency_session(request))
        return JSONResponse({"kept": True}, status_code=201)

    app = Starlette(routes=[Route("/keep", keep, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=True)
    assert (await client_for(app).post("/keep", headers={"Idempotency-Key": str(uuid.uuid4())})).status_code == 201
    gate = Gate()
    gate.go.clear()
    key = str(uuid.uuid4())
    other = asyncio.create_task(client_for(build(store, gate)).post("/write?flush=1", headers={"Idempotency-Key": key}))
    await asyncio.wait_for(gate.entered.wait(), 5)
    try:
        with pytest.raises(exc.ResourceClosedError):
            await kept[0].execute(select(Effect).where(Effect.key == key))
    finally:
        gate.go.set()
        await other


@pytest.mark.parametrize("contracted", [False, True], ids=["expanded", "contracted"])
async def test_the_purge_and_a_release_meet_a_completion_in_the_engines_transaction(
    idempotency_database_url: str, engine: AsyncEngine, db: asyncpg.Connection, contracted: bool
) -> None:
    """The completion in a handler's transaction on the engine locks its record as the store's own does (the same
    statement, migrations/0006): the purge passes the record over, a release waits for the transaction and keeps the
    completion it committed; then the purge takes the record with its response."""
    schema = f"imw_sqla_purge_{uuid.uuid4().hex[:8]}"
    store = SQLAlchemyStore(PostgresStore(idempotency_database_url, max_size=3, schema=schema), engine)
    try:
        await store.migrate()
        for statement in contract_statements(schema) if contracted else []:  # the next release's shape
            await db.execute(statement)
        await store.open()
        response = StoredResponse(201, [], b"{}", 2)
        async with store.transaction() as transaction:
            claim = await transaction.claim("t", "k", b"f" * 32, lease=30, ttl=60)
            await db.execute(
                f"UPDATE {schema}.idempotency_records SET expires_at = now() - interval '1 s', "
                "lease_expires_at = now() - interval '1 s'"
            )
            await transaction.begin()
            assert await transaction.complete("t", "k", claim.fence, response)
            assert await asyncio.wait_for(store.purge_expired(), 10) == 0
            releasing = asyncio.create_task(store.release("t", "k", claim.fence))
            for _ in range(100):  # until the release waits for the transaction's lock
                await asyncio.sleep(0.02)
                if await db.fetchval("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'transactionid'"):
                    break
            await transaction.commit()
        assert not await releasing
        assert (await store.inspect("t", "k")) is not None
        assert await store.purge_expired() == 1
        assert await db.fetchval(f"SELECT count(*) FROM {schema}.idempotency_responses") == 0
    finally:
        await store.close(grace=0)
        await db.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
