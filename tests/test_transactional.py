"""Transactional mode (docs/design.md §6): the effect and the record commit together, or neither does."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from idempotency_mw import IdempotencyMiddleware, MemoryStore, PostgresStore, idempotency_context
from idempotency_mw.events import Event, Outcome
from idempotency_mw.store import StoredResponse, StoreUnavailable, TransactionEnded
from tests.conftest import client_for, tenant_of


@pytest.fixture
async def db(idempotency_database_url: str) -> AsyncIterator[asyncpg.Connection]:
    connection = await asyncpg.connect(idempotency_database_url)
    await connection.execute("CREATE TABLE IF NOT EXISTS tx_effects (key text, note text)")
    yield connection
    await connection.close()


class Gate:
    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.go = asyncio.Event()
        self.go.set()


def build(store: PostgresStore, gate: Gate, **options: Any) -> Starlette:
    async def write(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        assert context.connection is not None
        assert context.connection.is_in_transaction()
        note = request.query_params.get("note") or (await request.body()).decode() or "ok"
        await context.connection.execute("INSERT INTO tx_effects VALUES ($1, $2)", context.key or "none", note)
        gate.entered.set()
        await gate.go.wait()
        if note == "raise":
            raise RuntimeError("handler failed after writing")
        if note == "500":
            return JSONResponse({"error": "late failure"}, status_code=500)
        if note == "big":
            return Response(b"y" * 5000)
        if note == "http400":
            raise HTTPException(400, "insufficient funds")
        if note == "declined":
            raise CardDeclined
        if note == "402":
            return JSONResponse({"error": "card declined"}, status_code=402)
        downstream = context.downstream_key("psp") if context.key else None
        return JSONResponse({"written": note, "downstream": downstream}, status_code=201)

    async def declined(request: Request, error: Exception) -> Response:
        return JSONResponse({"error": "card declined"}, status_code=402)

    app = Starlette(routes=[Route("/write", write, methods=["POST"])], exception_handlers={CardDeclined: declined})
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=True, **options)
    return app


class CardDeclined(Exception):
    """An app's own exception, which its exception handler turns into a 402."""


async def effects(db: asyncpg.Connection, key: str) -> int:
    return int(await db.fetchval("SELECT count(*) FROM tx_effects WHERE key = $1", key))


async def test_effect_and_record_commit_together(pg_store: PostgresStore, db: asyncpg.Connection) -> None:
    key = str(uuid.uuid4())
    client = client_for(build(pg_store, Gate()))
    first = await client.post("/write", headers={"Idempotency-Key": key})
    assert first.status_code == 201
    again = await client.post("/write", headers={"Idempotency-Key": key})
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert await effects(db, key) == 1
    info = await pg_store.inspect(tenant_of(), key)
    assert info is not None
    assert (info.state, info.lease_expires_at) == ("completed", None)  # inspect shows no lease on a completed record


async def test_response_is_sent_only_after_the_commit(pg_store: PostgresStore, db: asyncpg.Connection) -> None:
    """When the first byte reaches the client, the effect and the completed record are already visible."""
    key = str(uuid.uuid4())
    app = build(pg_store, Gate())
    seen: dict[str, Any] = {}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            seen["effects"] = await effects(db, key)
            seen["completed"] = await db.fetchval("SELECT count(*) FROM idempotency_responses WHERE key = $1", key)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/write",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"idempotency-key", key.encode()), (b"authorization", b"Bearer sk_test_alice")],
        "scheme": "http",
        "server": ("t", 80),
    }
    await app(scope, receive, send)
    assert seen == {"effects": 1, "completed": 1}


@pytest.mark.parametrize("note", ["raise", "500"])
async def test_handler_failure_rolls_back_effect_and_record(
    pg_store: PostgresStore, db: asyncpg.Connection, note: str
) -> None:
    key = str(uuid.uuid4())
    client = client_for(build(pg_store, Gate()))
    if note == "raise":
        with pytest.raises(RuntimeError):
            await client.post(f"/write?note={note}", headers={"Idempotency-Key": key})
    else:
        assert (await client.post(f"/write?note={note}", headers={"Idempotency-Key": key})).status_code == 500
    assert await effects(db, key) == 0
    assert await pg_store.inspect(tenant_of(), key) is None
    retry = await client.post("/write?note=ok", headers={"Idempotency-Key": key})
    assert retry.status_code == 201
    assert await effects(db, key) == 1


async def test_fenced_out_completion_rolls_back_the_handlers_writes(
    pg_store: PostgresStore, db: asyncpg.Connection
) -> None:
    """A zombie worker (its lease was taken over mid-handler) can neither commit its effect nor its record."""
    key = str(uuid.uuid4())
    gate = Gate()
    gate.go.clear()
    client = client_for(build(pg_store, gate))
    zombie = asyncio.create_task(client.post("/write", headers={"Idempotency-Key": key}))
    await asyncio.wait_for(gate.entered.wait(), 5)
    # Another worker takes the key over: the lease lapsed (a long pause, say) and a retry claimed it.
    await db.execute(
        "UPDATE idempotency_records SET lease_expires_at = now() - interval '1 second' WHERE key = $1", key
    )
    record = await db.fetchrow("SELECT tenant, fingerprint FROM idempotency_records WHERE key = $1", key)
    takeover = await pg_store.claim(record["tenant"], key, bytes(record["fingerprint"]), lease=60, ttl=600)
    assert takeover.outcome.value == "owned"
    gate.go.set()
    response = await zombie
    assert response.status_code == 409
    assert response.json()["code"] == "idempotency_request_in_progress"
    assert await effects(db, key) == 0
    info = await pg_store.inspect(record["tenant"], key)
    assert info is not None
    assert info.state == "in_progress"
    assert info.fence == takeover.fence


async def test_client_gone_after_commit_keeps_the_record(pg_store: PostgresStore, db: asyncpg.Connection) -> None:
    """The response was lost after the commit: the retry is answered by the replay, never by a second effect."""
    key = str(uuid.uuid4())
    app = build(pg_store, Gate())

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        raise OSError("client disconnected")

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/write",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"idempotency-key", key.encode()), (b"authorization", b"Bearer sk_test_alice")],
        "scheme": "http",
        "server": ("t", 80),
    }
    with pytest.raises(OSError, match="client disconnected"):
        await app(scope, receive, send)
    retry = await client_for(app).post("/write", headers={"Idempotency-Key": key})
    assert retry.headers["idempotent-replayed"] == "true"
    assert await effects(db, key) == 1


async def test_keyless_request_on_a_transactional_route_gets_a_transaction(
    pg_store: PostgresStore, db: asyncpg.Connection
) -> None:
    client = client_for(build(pg_store, Gate()))
    assert (await client.post("/write?note=keyless")).status_code == 201
    assert await db.fetchval("SELECT count(*) FROM tx_effects WHERE note = 'keyless'") >= 1
    before = await db.fetchval("SELECT count(*) FROM tx_effects WHERE note = '500'")
    assert (await client.post("/write?note=500")).status_code == 500
    assert await db.fetchval("SELECT count(*) FROM tx_effects WHERE note = '500'") == before


async def test_keyless_request_on_a_transactional_route_keeps_its_body(
    pg_store: PostgresStore, db: asyncpg.Connection
) -> None:
    note = f"body-{uuid.uuid4()}"
    assert (await client_for(build(pg_store, Gate())).post("/write", content=note.encode())).status_code == 201
    assert await db.fetchval("SELECT count(*) FROM tx_effects WHERE note = $1", note) == 1


async def test_response_over_the_cap_commits_before_streaming(pg_store: PostgresStore, db: asyncpg.Connection) -> None:
    key = str(uuid.uuid4())
    client = client_for(build(pg_store, Gate(), max_response_bytes=1000))
    live = await client.post("/write?note=big", headers={"Idempotency-Key": key})
    assert live.content == b"y" * 5000
    retry = await client.post("/write?note=big", headers={"Idempotency-Key": key})
    assert retry.status_code == 409
    assert retry.json()["code"] == "idempotency_response_not_replayable"
    assert await effects(db, key) == 1


async def test_database_down_is_503(key: str) -> None:
    store = PostgresStore("postgresql://nobody@127.0.0.1:1/none", timeout=0.5)
    response = await client_for(build(store, Gate())).post("/write", headers={"Idempotency-Key": key})
    assert response.status_code == 503


async def test_downstream_key_is_stable_per_tenant_key_and_label(pg_store: PostgresStore) -> None:
    key = str(uuid.uuid4())
    app = build(pg_store, Gate())
    a = await client_for(app, token="a").post("/write", headers={"Idempotency-Key": key})
    b = await client_for(app, token="b").post("/write", headers={"Idempotency-Key": key})
    a_again = await client_for(app, token="a").post("/write", headers={"Idempotency-Key": key})
    assert a.json()["downstream"] == a_again.json()["downstream"]
    assert a.json()["downstream"] != b.json()["downstream"]
    assert len(a.json()["downstream"]) == 64


def test_transactional_mode_needs_a_database_store() -> None:
    with pytest.raises(TypeError, match="PostgresStore"):
        IdempotencyMiddleware(Starlette(), MemoryStore(), transactional=True)


async def test_forget_in_the_deleting_transaction(pg_store: PostgresStore, db: asyncpg.Connection) -> None:
    """The resource-deleted race: deleting a resource and its creation record together means a late retry of
    the creation runs again (creating anew) instead of replaying a response naming a resource that is gone."""
    key = str(uuid.uuid4())
    client = client_for(build(pg_store, Gate()))
    assert (await client.post("/write", headers={"Idempotency-Key": key})).status_code == 201
    tenant = tenant_of()
    async with pg_store.connection() as connection, connection.transaction():
        await connection.execute("DELETE FROM tx_effects WHERE key = $1", key)
        assert await pg_store.forget(tenant, key, connection=connection)
    assert await pg_store.inspect(tenant, key) is None
    again = await client.post("/write", headers={"Idempotency-Key": key})
    assert "idempotent-replayed" not in again.headers
    assert await effects(db, key) == 1


def build_refusing(store: PostgresStore) -> Starlette:
    """A handler whose transaction the database refuses: at COMMIT (a deferred unique constraint), or earlier (an
    error the handler catches, which still aborts the transaction)."""

    async def write(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        assert context.connection is not None
        connection = context.connection
        how = request.query_params["how"]
        await connection.execute("INSERT INTO tx_effects VALUES ($1, $2)", context.key, how)
        if how == "deferred":
            await connection.execute("INSERT INTO tx_deferred VALUES (1), (1)")  # refused only at COMMIT
        elif how == "swallowed":
            with contextlib.suppress(asyncpg.DivisionByZeroError):
                await connection.execute("SELECT 1 / 0")  # caught, but the transaction is now aborted
        return JSONResponse({"written": how}, status_code=201)

    app = Starlette(routes=[Route("/write", write, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=True)
    return app


@pytest.mark.parametrize("how", ["deferred", "swallowed"])
async def test_a_transaction_the_database_refuses_is_a_handler_failure(
    pg_store: PostgresStore, db: asyncpg.Connection, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Not a 503 "store unavailable" (the store is fine, and a retry would fail the same way): the request fails
    like a handler error, nothing is committed, and the key is free for a corrected retry."""
    await db.execute(
        "CREATE TABLE IF NOT EXISTS tx_deferred (id int, CONSTRAINT tx_deferred_once UNIQUE (id) "
        "DEFERRABLE INITIALLY DEFERRED)"
    )
    key = str(uuid.uuid4())
    client = client_for(build_refusing(pg_store))
    with pytest.raises(asyncpg.PostgresError):
        await client.post(f"/write?how={how}", headers={"Idempotency-Key": key})
    assert await effects(db, key) == 0
    assert await pg_store.inspect(tenant_of(), key) is None
    assert "savepoint" in caplog.text
    retry = await client.post("/write?how=fixed", headers={"Idempotency-Key": key})
    assert retry.status_code == 201
    assert await effects(db, key) == 1


@pytest.mark.parametrize("statement", ["ROLLBACK", "COMMIT"])
async def test_a_handler_that_ends_its_transaction_gets_no_record(
    pg_store: PostgresStore, db: asyncpg.Connection, statement: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The handler runs COMMIT or ROLLBACK on the connection it was lent. The completion then ran on its own and
    recorded a 201: after a ROLLBACK, every retry was told of an effect that never happened. Now the record is
    refused, the request fails like a handler error, the log says why and what to use instead, the key is free."""

    async def write(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        assert context.connection is not None
        await context.connection.execute("INSERT INTO tx_effects VALUES ($1, $2)", context.key, statement)
        await context.connection.execute(statement)
        return JSONResponse({"ok": True}, status_code=201)

    app = Starlette(routes=[Route("/write", write, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=pg_store, transactional=True)
    key = str(uuid.uuid4())
    with pytest.raises(TransactionEnded):
        await client_for(app).post("/write", headers={"Idempotency-Key": key})
    assert await pg_store.inspect(tenant_of(), key) is None
    assert await effects(db, key) == (1 if statement == "COMMIT" else 0)
    assert "savepoint" in caplog.text


def build_session_setter(store: PostgresStore) -> Starlette:
    """A transactional handler that changes its session: a row-level-security tenant, set without LOCAL."""

    async def write(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        assert context.connection is not None
        await context.connection.execute("SET app.tenant = 'alice'")
        return JSONResponse({"ok": True}, status_code=201)

    app = Starlette(routes=[Route("/write", write, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=True)
    return app


async def test_a_lent_connection_goes_back_to_the_pool_reset(idempotency_database_url: str, key: str) -> None:
    """The store's own statements go back without a reset round trip; a connection lent to a handler is reset, so
    a session setting of the handler does not follow the connection to whoever uses it next."""
    async with PostgresStore(idempotency_database_url, min_size=1, max_size=1) as store:  # one connection for all
        client = client_for(build_session_setter(store))
        assert (await client.post("/write", headers={"Idempotency-Key": key})).status_code == 201
        again = await client.post("/write", headers={"Idempotency-Key": key})
        assert again.headers["idempotent-replayed"] == "true"
        async with store.connection() as connection:
            assert not await connection.fetchval("SELECT current_setting('app.tenant', true)")


async def test_a_lent_connection_of_the_apps_own_pool_is_reset_by_that_pool(
    idempotency_database_url: str, key: str
) -> None:
    """A pool the app passes in keeps asyncpg's reset on release; the store does not run a second one."""
    pool = await asyncpg.create_pool(idempotency_database_url, min_size=1, max_size=1)
    try:
        app = build_session_setter(PostgresStore(pool))
        assert (await client_for(app).post("/write", headers={"Idempotency-Key": key})).status_code == 201
        async with pool.acquire() as connection:
            assert not await connection.fetchval("SELECT current_setting('app.tenant', true)")
    finally:
        await pool.close()


async def test_a_connection_lost_before_begin_is_store_unavailable(pg_store: PostgresStore) -> None:
    async with pg_store.transaction() as transaction:
        transaction.connection.terminate()
        with pytest.raises(StoreUnavailable):
            await transaction.begin()
        assert transaction.lost


async def test_a_handler_failing_after_an_over_cap_commit_keeps_its_record(
    pg_store: PostgresStore, db: asyncpg.Connection
) -> None:
    """Past the cap the transaction commits so the response can stream; a later failure cannot undo that. The
    event says what happened (executed, not released) and the retry gets 409 instead of a second effect."""
    key = str(uuid.uuid4())
    events: list[Event] = []

    async def write(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        assert context.connection is not None
        await context.connection.execute("INSERT INTO tx_effects VALUES ($1, 'stream')", context.key)

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(3):
                yield b"z" * 800
            raise RuntimeError("failed mid-stream")

        return StreamingResponse(chunks())

    app = Starlette(routes=[Route("/write", write, methods=["POST"])])
    app.add_middleware(
        IdempotencyMiddleware, store=pg_store, transactional=True, max_response_bytes=1000, on_event=events.append
    )
    client = client_for(app)
    with pytest.raises(RuntimeError, match="mid-stream"):
        await client.post("/write", headers={"Idempotency-Key": key})
    assert [event.outcome for event in events] == [Outcome.EXECUTED]
    retry = await client.post("/write", headers={"Idempotency-Key": key})
    assert retry.status_code == 409
    assert retry.json()["code"] == "idempotency_response_not_replayable"
    assert await effects(db, key) == 1


async def test_a_transaction_lost_before_its_rollback_is_503_and_frees_the_key(
    pg_store: PostgresStore, key: str, idempotency_database_url: str
) -> None:
    """The handler answers 500 (so its transaction rolls back), but the connection died under it meanwhile: that is
    the store being unreachable (503, retry later), not a handler error or a refused commit."""

    async def write(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        assert context.connection is not None
        pid = context.connection.get_server_pid()
        killer = await asyncpg.connect(idempotency_database_url)
        try:
            await killer.execute("SELECT pg_terminate_backend($1)", pid)
        finally:
            await killer.close()
        for _ in range(100):
            if context.connection.is_closed():
                break
            await asyncio.sleep(0.01)
        return JSONResponse({"error": "upstream failed"}, status_code=500)

    app = Starlette(routes=[Route("/write", write, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=pg_store, transactional=True)
    response = await client_for(app).post("/write", headers={"Idempotency-Key": key})
    assert response.status_code == 503
    assert response.json()["code"] == "idempotency_store_unavailable"
    assert await pg_store.inspect(tenant_of(), key) is None  # released: the retry runs afresh


# -- a lent connection comes back with a clean session ------------------------------------------------------

# What a handler may leave behind on its connection, each surviving the transaction's COMMIT.
SESSION_LEAKS = {
    "role": "SET ROLE imw_leak_role",
    "session_authorization": "SET SESSION AUTHORIZATION imw_leak_role",
    "search_path": "SET search_path = public, pg_catalog",
    "setting": "SET statement_timeout = 12345",
    "temp_table": "CREATE TEMP TABLE imw_leak_temp (x int)",
    "prepared_statement": "PREPARE imw_leak_statement AS SELECT 1",
    "advisory_lock": "SELECT pg_advisory_lock(424242)",
    "listen": "LISTEN imw_leak_channel",
}

SESSION_STATE = """
SELECT current_user::text AS current_user,
       session_user::text AS session_user,
       current_setting('search_path') AS search_path,
       current_setting('statement_timeout') AS statement_timeout,
       (SELECT count(*) FROM pg_class WHERE relnamespace = pg_my_temp_schema()) AS temp_tables,
       (SELECT count(*) FROM pg_prepared_statements WHERE from_sql) AS prepared_statements,
       (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()) AS advisory_locks,
       (SELECT count(*) FROM pg_listening_channels()) AS listening
"""


def build_leaky(store: PostgresStore, seen: list[dict[str, Any]]) -> Starlette:
    async def leak(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        assert context.connection is not None
        await context.connection.execute(SESSION_LEAKS[request.path_params["what"]])
        return JSONResponse({"left": request.path_params["what"]}, status_code=201)

    async def look(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        assert context.connection is not None
        seen.append(dict(await context.connection.fetchrow(SESSION_STATE)))
        return JSONResponse({"looked": True}, status_code=201)

    app = Starlette(routes=[Route("/leak/{what}", leak, methods=["POST"]), Route("/look", look, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=True, tenant=lambda scope: "t-leak")
    return app


@pytest.fixture
async def leak_role(db: asyncpg.Connection) -> str:
    exists = await db.fetchval("SELECT 1 FROM pg_roles WHERE rolname = 'imw_leak_role'")
    if not exists:
        with contextlib.suppress(asyncpg.DuplicateObjectError):  # another test process made it meanwhile
            await db.execute("CREATE ROLE imw_leak_role SUPERUSER")
    return "imw_leak_role"


@pytest.mark.parametrize("pool", ["own", "app"])
@pytest.mark.parametrize("what", sorted(SESSION_LEAKS))
async def test_a_lent_connection_comes_back_with_a_clean_session(
    idempotency_database_url: str, leak_role: str, db: asyncpg.Connection, pool: str, what: str
) -> None:
    """Whatever a handler did to its session (a role for row-level security, a schema, a temp table, a prepared
    statement, a lock, a LISTEN), the next handler on that connection starts as the store's login role with a
    clean session: otherwise one tenant's role would reach the next tenant's request."""
    login = await db.fetchval("SELECT current_user")
    app_pool = await asyncpg.create_pool(idempotency_database_url, min_size=1, max_size=1) if pool == "app" else None
    store = PostgresStore(app_pool) if app_pool is not None else PostgresStore(idempotency_database_url, max_size=2)
    try:
        seen: list[dict[str, Any]] = []
        client = client_for(build_leaky(store, seen))
        before = await client.post("/look", headers={"Idempotency-Key": str(uuid.uuid4())})
        assert before.status_code == 201
        left = await client.post(f"/leak/{what}", headers={"Idempotency-Key": str(uuid.uuid4())})
        assert left.status_code == 201
        after = await client.post("/look", headers={"Idempotency-Key": str(uuid.uuid4())})
        assert after.status_code == 201
        assert seen[1] == seen[0]
        assert seen[1]["current_user"] == seen[1]["session_user"] == login
    finally:
        await store.close()
        if app_pool is not None:
            await app_pool.close()


async def test_a_handler_that_changes_search_path_still_completes(
    pg_store: PostgresStore, db: asyncpg.Connection
) -> None:
    """Schema-per-tenant apps set the search_path on the connection they are lent; the record's completion, on the
    same connection, names its table in full and does not care."""
    await db.execute("CREATE SCHEMA IF NOT EXISTS imw_tenant_schema")
    key = str(uuid.uuid4())

    async def write(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        assert context.connection is not None
        await context.connection.execute("SET search_path = imw_tenant_schema")
        await context.connection.execute("INSERT INTO public.tx_effects VALUES ($1, 'schema')", context.key)
        return JSONResponse({"ok": True}, status_code=201)

    app = Starlette(routes=[Route("/write", write, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=pg_store, transactional=True)
    client = client_for(app)
    assert (await client.post("/write", headers={"Idempotency-Key": key})).status_code == 201
    again = await client.post("/write", headers={"Idempotency-Key": key})
    assert again.headers["idempotent-replayed"] == "true"
    assert await effects(db, key) == 1


async def test_a_backend_terminated_while_the_handler_runs_is_503_and_frees_the_key(
    pg_store: PostgresStore, idempotency_database_url: str, key: str
) -> None:
    """The handler's own statement dies with its connection (an operator's pg_terminate_backend, a failover): the
    store is what failed, so the answer is 503 with the key released, not a 500."""
    runs: list[int] = []

    async def write(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        assert context.connection is not None
        runs.append(1)
        if len(runs) == 1:
            pid = context.connection.get_server_pid()
            killer = await asyncpg.connect(idempotency_database_url)
            try:
                await killer.execute("SELECT pg_terminate_backend($1)", pid)
            finally:
                await killer.close()
        await context.connection.execute("SELECT pg_sleep(0.05)")
        return JSONResponse({"ok": True}, status_code=201)

    app = Starlette(routes=[Route("/write", write, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=pg_store, transactional=True)
    client = client_for(app)
    response = await client.post("/write", headers={"Idempotency-Key": key})
    assert response.status_code == 503
    assert response.json()["code"] == "idempotency_store_unavailable"
    assert await pg_store.inspect(tenant_of(), key) is None
    retry = await client.post("/write", headers={"Idempotency-Key": key})
    assert retry.status_code == 201
    assert runs == [1, 1]


async def test_a_handler_that_never_finishes_its_response_frees_the_key_once(
    pg_store: PostgresStore, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The transaction rolls back and the key is released as the rollback settles; answering the error that follows
    must not release it a second time (a round trip for nothing)."""
    releases: list[str] = []
    release = pg_store.release

    async def counted(tenant: str, key: str, fence: int) -> None:
        releases.append(key)
        await release(tenant, key, fence)

    monkeypatch.setattr(pg_store, "release", counted)

    async def start_only(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 201, "headers": []})

    app = IdempotencyMiddleware(start_only, store=pg_store, transactional=True)
    with pytest.raises(RuntimeError, match="without finishing its response"):
        await client_for(app).post("/write", headers={"Idempotency-Key": key})
    assert releases == [key]
    assert await pg_store.inspect(tenant_of(), key) is None


# -- the database's default isolation level ---------------------------------------------------------------------


@pytest.fixture
async def isolated_store(isolated_url: str) -> AsyncIterator[PostgresStore]:
    """A store on a database whose default isolation level is each of PostgreSQL's three in turn."""
    connection = await asyncpg.connect(isolated_url)
    try:
        await connection.execute("CREATE TABLE IF NOT EXISTS tx_effects (key text, note text)")
    finally:
        await connection.close()
    async with contextlib.AsyncExitStack() as stack:
        store = PostgresStore(isolated_url)
        await store.open()
        stack.push_async_callback(store.close, grace=0)
        yield store


async def isolated_effects(store: PostgresStore, key: str) -> int:
    async with store.connection() as connection:
        return int(await connection.fetchval("SELECT count(*) FROM tx_effects WHERE key = $1", key))


async def test_the_handlers_transaction_keeps_the_databases_isolation_level(
    isolated_store: PostgresStore, isolated_url: str
) -> None:
    async def level(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        assert context.connection is not None
        return JSONResponse({"level": await context.connection.fetchval("SHOW transaction_isolation")})

    app = Starlette(routes=[Route("/level", level, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=isolated_store, transactional=True)
    async with asyncpg.create_pool(isolated_url, min_size=1, max_size=1) as pool:
        expected = await pool.fetchval("SHOW default_transaction_isolation")
    answer = await client_for(app).post("/level", headers={"Idempotency-Key": str(uuid.uuid4())})
    assert answer.json() == {"level": expected}


async def test_a_duplicate_refused_while_the_original_runs_does_not_fail_it(isolated_store: PostgresStore) -> None:
    """The duplicate's claim counts its attempt on the record; under REPEATABLE READ or SERIALIZABLE that must not
    make the original's completion a serialization failure (500, nothing committed)."""
    key = str(uuid.uuid4())
    gate = Gate()
    gate.go.clear()
    client = client_for(build(isolated_store, gate))
    original = asyncio.create_task(client.post("/write", headers={"Idempotency-Key": key}))
    await asyncio.wait_for(gate.entered.wait(), 5)
    for _ in range(3):
        duplicate = await client.post("/write", headers={"Idempotency-Key": key})
        assert duplicate.status_code == 409
    gate.go.set()
    assert (await original).status_code == 201
    assert await isolated_effects(isolated_store, key) == 1
    retry = await client.post("/write", headers={"Idempotency-Key": key})
    assert retry.headers["idempotent-replayed"] == "true"


async def test_a_handler_that_outlives_lease_renewals_completes(isolated_store: PostgresStore) -> None:
    """Renewals write the record while the handler runs; under REPEATABLE READ that must not keep a handler that
    runs longer than a third of its lease from ever completing."""
    key = str(uuid.uuid4())
    gate = Gate()
    gate.go.clear()
    client = client_for(build(isolated_store, gate, lease=0.3))
    original = asyncio.create_task(client.post("/write", headers={"Idempotency-Key": key}))
    await asyncio.wait_for(gate.entered.wait(), 5)
    await asyncio.sleep(0.5)  # a renewal every 0.1 s
    gate.go.set()
    assert (await original).status_code == 201
    assert await isolated_effects(isolated_store, key) == 1


async def test_a_zombie_whose_snapshot_predates_a_takeover_is_fenced_out(isolated_store: PostgresStore) -> None:
    """Under REPEATABLE READ or SERIALIZABLE the zombie's snapshot still shows its own claim after a takeover; the
    newer claim's response, stored first, is what stops its completion: its writes roll back, it answers 409, and
    the key stays with the newer claim."""
    key = str(uuid.uuid4())
    gate = Gate()
    gate.go.clear()
    client = client_for(build(isolated_store, gate))
    zombie = asyncio.create_task(client.post("/write", headers={"Idempotency-Key": key}))
    await asyncio.wait_for(gate.entered.wait(), 5)  # its first write took its snapshot
    async with isolated_store.connection() as connection:
        await connection.execute(
            "UPDATE idempotency_records SET lease_expires_at = now() - interval '1 second' WHERE key = $1", key
        )
        record = await connection.fetchrow("SELECT tenant, fingerprint FROM idempotency_records WHERE key = $1", key)
    takeover = await isolated_store.claim(record["tenant"], key, bytes(record["fingerprint"]), lease=60, ttl=600)
    assert takeover.outcome.value == "owned"
    newer = StoredResponse(201, [(b"content-type", b"application/json")], b'{"newer":true}', 14)
    assert await isolated_store.complete(record["tenant"], key, takeover.fence, newer)
    gate.go.set()
    response = await zombie
    assert response.status_code == 409
    assert response.json()["code"] == "idempotency_request_in_progress"
    assert await isolated_effects(isolated_store, key) == 0
    replay = await client.post("/write", headers={"Idempotency-Key": key})
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.content == b'{"newer":true}'


async def test_a_serialization_failure_at_the_completion_releases_the_key(isolation_urls: dict[str, str]) -> None:
    """Under SERIALIZABLE, two handlers that each read what the other writes (write skew) cannot both commit, and
    PostgreSQL may refuse the second at any statement: the completion's insert included. That is the handler's
    transaction failing, not a newer claim of its key: the key is released (not held for its lease behind 409s),
    and the retry runs afresh."""
    url = isolation_urls["serializable"]
    setup = await asyncpg.connect(url)
    await setup.execute("CREATE TABLE IF NOT EXISTS skew (key text)")
    both_read = asyncio.Barrier(2)
    first_committed = asyncio.Event()
    seen: set[str | None] = set()

    async def skewed(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        assert context.connection is not None
        await context.connection.fetchval("SELECT count(*) FROM skew")
        retry = context.key in seen
        seen.add(context.key)
        if not retry:
            await both_read.wait()
        await context.connection.execute("INSERT INTO skew VALUES ($1)", context.key)
        if "second" in request.query_params and not retry:
            await first_committed.wait()  # its completion runs after the first transaction committed
        return JSONResponse({"done": True}, status_code=201)

    app = Starlette(routes=[Route("/skew", skewed, methods=["POST"])])
    try:
        async with PostgresStore(url) as store:
            app.add_middleware(IdempotencyMiddleware, store=store, transactional=True)
            client = client_for(app)
            first_key, second_key = str(uuid.uuid4()), str(uuid.uuid4())
            first = asyncio.create_task(client.post("/skew", headers={"Idempotency-Key": first_key}))
            second = asyncio.create_task(client.post("/skew?second=1", headers={"Idempotency-Key": second_key}))
            assert (await first).status_code == 201
            first_committed.set()
            try:
                failed = await second
            except asyncpg.SerializationError:
                pass  # raised out of the app: its server answers 500
            else:
                assert failed.status_code == 500, failed.text
            assert await store.inspect(tenant_of(), second_key) is None  # released at once, not left to its lease
            retry = await client.post("/skew?second=1", headers={"Idempotency-Key": second_key})
            assert retry.status_code == 201
        assert await setup.fetchval("SELECT count(*) FROM skew WHERE key = $1", second_key) == 1
    finally:
        await setup.execute("DROP TABLE skew")
        await setup.close()


@pytest.fixture
async def app_role(db: asyncpg.Connection) -> str:
    """A role an app's pool switches to as it connects (SET ROLE in asyncpg's ``init``), like a least-privilege role
    for the app; a superuser here, so that the store's statements run under it as well."""
    if not await db.fetchval("SELECT 1 FROM pg_roles WHERE rolname = 'imw_app_role'"):
        with contextlib.suppress(asyncpg.DuplicateObjectError):  # another test made it meanwhile
            await db.execute("CREATE ROLE imw_app_role SUPERUSER")
    return "imw_app_role"


@pytest.mark.parametrize("what", ["role", "session_authorization", "search_path"])
async def test_a_lent_connection_comes_back_as_the_apps_pool_made_it(
    idempotency_database_url: str, leak_role: str, app_role: str, what: str
) -> None:
    """The reset of a lent connection restores what the app's pool set when it connected (its ``init`` ran SET
    ROLE), not the login role: the app's next query on that connection runs with the rights it chose."""

    async def init(connection: asyncpg.Connection) -> None:
        await connection.execute(f"SET ROLE {app_role}")

    app_pool = await asyncpg.create_pool(idempotency_database_url, min_size=1, max_size=1, init=init)
    try:
        seen: list[dict[str, Any]] = []
        client = client_for(build_leaky(PostgresStore(app_pool), seen))
        for path in ("/look", f"/leak/{what}", "/look"):
            assert (await client.post(path, headers={"Idempotency-Key": str(uuid.uuid4())})).status_code == 201
        assert seen[0]["current_user"] == app_role
        assert seen[1] == seen[0]
        async with app_pool.acquire() as connection:  # the app's own use of its pool
            assert await connection.fetchval("SELECT current_user") == app_role
    finally:
        await app_pool.close()


async def test_a_lent_connection_refuses_use_after_its_request(pg_store: PostgresStore) -> None:
    """A task that kept the request's connection (fire and forget) must not reach the next request's transaction
    on that connection: like asyncpg's own pool after a release, every call is refused."""
    kept: list[Any] = []

    async def keep(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        assert context.connection is not None
        kept.extend([context.connection, context.connection.fetchval])
        return JSONResponse({"kept": True}, status_code=201)

    app = Starlette(routes=[Route("/keep", keep, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=pg_store, transactional=True)
    response = await client_for(app).post("/keep", headers={"Idempotency-Key": str(uuid.uuid4())})
    assert response.status_code == 201
    connection, fetchval = kept
    with pytest.raises(asyncpg.InterfaceError, match="request that has ended"):
        await connection.fetchval("SELECT 1")
    with pytest.raises(asyncpg.InterfaceError, match="request that has ended"):
        await fetchval("SELECT 1")
    with pytest.raises(asyncpg.InterfaceError, match="request that has ended"):
        connection.is_in_transaction()


@pytest.mark.parametrize(("note", "status"), [("http400", 400), ("declined", 402)])
async def test_an_exception_turned_into_a_response_rolls_back_and_is_recorded(
    pg_store: PostgresStore, db: asyncpg.Connection, note: str, status: int
) -> None:
    """A handler that writes, then raises an exception the app answers (HTTPException, or one with an exception
    handler): its writes roll back as a raised exception does anywhere else, while the answer is final and recorded,
    so the retry gets the same answer and nothing ran twice."""
    key = str(uuid.uuid4())
    client = client_for(build(pg_store, Gate()))
    first = await client.post(f"/write?note={note}", headers={"Idempotency-Key": key})
    assert first.status_code == status
    assert await effects(db, key) == 0
    retry = await client.post(f"/write?note={note}", headers={"Idempotency-Key": key})
    assert retry.headers["idempotent-replayed"] == "true"
    assert (retry.status_code, retry.content) == (status, first.content)
    assert await effects(db, key) == 0


async def test_a_returned_4xx_commits_the_handlers_writes(pg_store: PostgresStore, db: asyncpg.Connection) -> None:
    """A 4xx the handler returns is its answer, written with its effect (a declined card that records the attempt)."""
    key = str(uuid.uuid4())
    client = client_for(build(pg_store, Gate()))
    assert (await client.post("/write?note=402", headers={"Idempotency-Key": key})).status_code == 402
    assert await effects(db, key) == 1
    retry = await client.post("/write?note=402", headers={"Idempotency-Key": key})
    assert retry.headers["idempotent-replayed"] == "true"
    assert await effects(db, key) == 1


# -- one durable commit per request -----------------------------------------------------------------------------

# The flushes sessions wait for at their commits: those of the WAL writer, autovacuum and the checkpointer (an
# asynchronous commit's flush among them, done in the background) keep no request waiting.
WAL_FSYNCS = "SELECT sum(fsyncs)::bigint FROM pg_stat_io WHERE object = 'wal' AND backend_type = 'client backend'"


async def test_a_fresh_transactional_request_waits_for_one_wal_flush(migrated_url: str) -> None:
    """The claim commits at once, for duplicates to see, but does not wait for its WAL flush: the handler's COMMIT
    flushes it, WAL being flushed in order, so the claim is durable whenever the effect is. 2 flushes per request
    before; 1 now (counted by PostgreSQL, its statistics flushed as the store's connections close)."""
    requests = 40
    admin = await asyncpg.connect(migrated_url)
    try:
        await admin.execute("CREATE TABLE IF NOT EXISTS tx_effects (key text, note text)")
        store = PostgresStore(migrated_url, min_size=1, max_size=2)
        client = client_for(build(store, Gate()))
        await client.post("/write", headers={"Idempotency-Key": str(uuid.uuid4())})  # statements prepared
        before = await admin.fetchval(WAL_FSYNCS)
        for _ in range(requests):
            assert (await client.post("/write", headers={"Idempotency-Key": str(uuid.uuid4())})).status_code == 201
        await store.close()
        await admin.execute("SELECT pg_stat_force_next_flush()")
        await asyncio.sleep(0.1)
        flushes = await admin.fetchval(WAL_FSYNCS) - before
    finally:
        await admin.close()
    assert flushes < requests * 1.3, f"{flushes / requests:.2f} WAL flushes per fresh transactional request"


async def test_a_plain_claim_still_waits_for_its_flush(migrated_url: str) -> None:
    """Plain mode's effect is outside the database: a claim lost in a crash could let the retry run it again, so its
    claim and its completion each wait for their flush, as before."""
    requests = 40
    admin = await asyncpg.connect(migrated_url)
    try:
        store = PostgresStore(migrated_url, min_size=1, max_size=2)
        app = Starlette(routes=[Route("/plain", lambda request: JSONResponse({}, status_code=201), methods=["POST"])])
        app.add_middleware(IdempotencyMiddleware, store=store)
        client = client_for(app)
        await client.post("/plain", headers={"Idempotency-Key": str(uuid.uuid4())})  # statements prepared
        before = await admin.fetchval(WAL_FSYNCS)
        for _ in range(requests):
            assert (await client.post("/plain", headers={"Idempotency-Key": str(uuid.uuid4())})).status_code == 201
        await store.close()
        await admin.execute("SELECT pg_stat_force_next_flush()")
        await asyncio.sleep(0.1)
        flushes = await admin.fetchval(WAL_FSYNCS) - before
    finally:
        await admin.close()
    assert flushes >= requests * 1.9, f"{flushes / requests:.2f} WAL flushes per fresh plain request"
