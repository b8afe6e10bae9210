"""A lent connection after its loan, and what the driver keeps: what the code a connection was lent to does after its
COMMIT (a background task), what it takes from the connection and keeps (a prepared statement), what it sets on
the driver's side (a query logger, a type codec), and what the app's pool set when it connected (a session
authorization) must neither reach the next request on that connection nor be lost for it."""

from __future__ import annotations

import asyncio
import io
import json
import uuid
from typing import Any

import asyncpg
import httpx
import pytest
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idempotency_mw import IdempotencyMiddleware, PostgresStore, idempotency_context
from tests.conftest import client_for

STATE = """
SELECT current_user::text AS current_user,
       session_user::text AS session_user,
       nullif(current_setting('app.tenant', true), '') AS app_tenant,
       (SELECT count(*) FROM pg_class WHERE relnamespace = pg_my_temp_schema()) AS temp_tables,
       (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()) AS advisory_locks
"""


def lent(request: Request) -> Any:
    context = idempotency_context(request)
    assert context is not None
    assert context.connection is not None
    return context.connection


async def store_on(pool: str, url: str, **options: Any) -> tuple[PostgresStore, asyncpg.Pool | None]:
    """The store's own pool with one connection to lend, or an app's asyncpg pool of one connection."""
    if pool == "app":
        app_pool = await asyncpg.create_pool(url, min_size=1, max_size=1, **options)
        return PostgresStore(app_pool), app_pool
    return PostgresStore(url, min_size=1, max_size=2), None


async def closed(store: PostgresStore, app_pool: asyncpg.Pool | None) -> None:
    await store.close()
    if app_pool is not None:
        await app_pool.close()


async def around(store: PostgresStore, pay: Any, tenant: str) -> tuple[list[dict[str, Any]], list[str]]:
    """A request that reads its session, then ``pay`` (whose background task uses the lent connection after the
    COMMIT), then the first again, each on one lent connection with a key of its own: the two sessions read, and
    the three keys."""
    seen: list[dict[str, Any]] = []

    async def look(request: Request) -> Response:
        seen.append(dict(await lent(request).fetchrow(STATE)))
        return JSONResponse({"looked": True}, status_code=201)

    app = Starlette(routes=[Route("/pay", pay, methods=["POST"]), Route("/look", look, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=True, tenant=lambda scope: tenant)
    client = client_for(app)
    keys = [str(uuid.uuid4()) for _ in range(3)]
    for path, key in zip(("/look", "/pay", "/look"), keys, strict=True):
        answer = await client.post(path, headers={"Idempotency-Key": key})
        assert answer.status_code == 201, answer.text
    return seen, keys


@pytest.mark.parametrize("pool", ["own", "app"])
async def test_what_a_background_task_does_to_the_session_after_the_commit_does_not_reach_the_next_request(
    idempotency_database_url: str, leak_role: str, pool: str
) -> None:
    """The lent connection is the handler's until the app returns, background tasks included; on the store's own
    pool the reset rode in the COMMIT's round trip, before them. A call after the COMMIT sends the connection back
    through the full reset: otherwise alice's role and settings would be bob's."""

    async def pay(request: Request) -> Response:
        connection = lent(request)

        async def audit() -> None:
            await connection.execute(f"SET ROLE {leak_role}")
            await connection.execute("SELECT set_config('app.tenant', 'alice', false)")
            await connection.execute("CREATE TEMP TABLE imw_audit (x int)")
            await connection.execute("SELECT pg_advisory_lock(4242)")

        return JSONResponse({"paid": True}, status_code=201, background=BackgroundTask(audit))

    store, app_pool = await store_on(pool, idempotency_database_url)
    try:
        seen, _ = await around(store, pay, "t-after")
        assert seen[1] == seen[0]
    finally:
        await closed(store, app_pool)


@pytest.mark.parametrize("pool", ["own", "app"])
async def test_a_transaction_a_background_task_leaves_open_ends_with_the_loan(
    idempotency_database_url: str, db: asyncpg.Connection, leak_role: str, pool: str
) -> None:
    """A BEGIN after the COMMIT, never ended: on the store's own pool the next claims on that connection would run in
    it and never commit (a 201 whose record does not exist); on an app's pool asyncpg's ROLLBACK on release would
    undo the store's reset with it."""

    async def pay(request: Request) -> Response:
        connection = lent(request)

        async def later() -> None:
            await connection.execute(f"SET ROLE {leak_role}")
            await connection.execute("BEGIN")

        return JSONResponse({"paid": True}, status_code=201, background=BackgroundTask(later))

    async def look(request: Request) -> Response:
        return JSONResponse({"user": await lent(request).fetchval("SELECT current_user::text")}, status_code=201)

    store, app_pool = await store_on(pool, idempotency_database_url)
    try:
        app = Starlette(routes=[Route("/pay", pay, methods=["POST"]), Route("/look", look, methods=["POST"])])
        app.add_middleware(IdempotencyMiddleware, store=store, transactional=True, tenant=lambda scope: "t-open")
        client = client_for(app)
        login = await db.fetchval("SELECT current_user::text")
        assert (await client.post("/pay", headers={"Idempotency-Key": str(uuid.uuid4())})).status_code == 201
        key = str(uuid.uuid4())
        looked = await client.post("/look", headers={"Idempotency-Key": key})
        assert looked.status_code == 201
        assert looked.json() == {"user": login}
        stored = "SELECT count(*) FROM idempotency_responses WHERE tenant = 't-open' AND key = $1"
        assert await db.fetchval(stored, key) == 1  # committed, not left in the task's transaction
    finally:
        await closed(store, app_pool)


@pytest.mark.parametrize("pool", ["own", "app"])
@pytest.mark.parametrize("taken", ["transaction", "statement", "call", "copy"])
async def test_what_was_taken_before_the_commit_and_used_after_it_does_not_reach_the_next_request(
    idempotency_database_url: str, db: asyncpg.Connection, pool: str, taken: str
) -> None:
    """A background task that starts a transaction object the handler took, runs its prepared statement, or awaits
    a call (a COPY, which asyncpg does not count among its queries, too) the handler made: sent after the COMMIT,
    though taken or called before it. On the store's own pool, where the reset rode in the COMMIT's round trip, the
    connection went back without another: the next request ran with alice's settings, or its claim, effect and
    record ran in the transaction left open (a 201 of which nothing committed)."""
    setting = "SELECT set_config('app.tenant', 'alice', false)"

    async def pay(request: Request) -> Response:
        connection = lent(request)
        kept: Any
        if taken == "transaction":
            kept = connection.transaction()
        elif taken == "statement":
            kept = await connection.prepare(setting)
        elif taken == "call":
            kept = connection.execute(setting)  # called now, sent when awaited
        else:
            kept = connection.copy_from_query(setting, output=io.BytesIO())

        async def later() -> None:
            if taken == "transaction":
                await kept.start()  # a BEGIN, never ended
            elif taken == "statement":
                await kept.fetchval()
            else:
                await kept

        return JSONResponse({"paid": True}, status_code=201, background=BackgroundTask(later))

    store, app_pool = await store_on(pool, idempotency_database_url)
    try:
        seen, keys = await around(store, pay, "t-taken")
        assert seen[1] == seen[0]
        stored = "SELECT count(*) FROM idempotency_responses WHERE tenant = 't-taken' AND key = $1"
        assert await db.fetchval(stored, keys[2]) == 1  # committed, not left in the task's transaction
    finally:
        await closed(store, app_pool)


async def test_a_session_authorization_the_apps_pool_set_is_restored_after_a_loan(
    idempotency_database_url: str, app_role: str
) -> None:
    """The reset ends as the login role (SET SESSION AUTHORIZATION DEFAULT); a pool whose init set another session
    authorization (a least-privilege role) gets it back, as it gets back a SET ROLE, and never the login role."""

    async def init(connection: asyncpg.Connection) -> None:
        await connection.execute(f"SET SESSION AUTHORIZATION {app_role}")

    seen: list[tuple[str, str]] = []

    async def look(request: Request) -> Response:
        row = await lent(request).fetchrow("SELECT current_user::text, session_user::text")
        seen.append((row[0], row[1]))
        return JSONResponse({"looked": True}, status_code=201)

    store, app_pool = await store_on("app", idempotency_database_url, init=init)
    assert app_pool is not None
    try:
        app = Starlette(routes=[Route("/look", look, methods=["POST"])])
        app.add_middleware(IdempotencyMiddleware, store=store, transactional=True, tenant=lambda scope: "t-auth")
        client = client_for(app)
        for _ in range(2):
            assert (await client.post("/look", headers={"Idempotency-Key": str(uuid.uuid4())})).status_code == 201
        async with app_pool.acquire() as connection:  # the app's own use of its pool
            after = await connection.fetchval("SELECT session_user::text")
        assert seen == [(app_role, app_role)] * 2
        assert after == app_role
    finally:
        await closed(store, app_pool)


@pytest.mark.parametrize("pool", ["own", "app"])
async def test_a_prepared_statement_kept_past_the_request_is_refused(idempotency_database_url: str, pool: str) -> None:
    """As asyncpg's pool refuses what was taken from a connection once it is released: alice's kept statement, run
    during bob's request, would otherwise read and write in bob's transaction."""
    kept: list[Any] = []
    seen: dict[str, Any] = {}

    async def alice(request: Request) -> Response:
        kept.append(await lent(request).prepare("SELECT current_setting('app.tenant', true)"))
        return JSONResponse({"alice": True}, status_code=201)

    async def bob(request: Request) -> Response:
        await lent(request).execute("SET LOCAL app.tenant = 'bob'")
        try:
            seen["alice"] = await kept[0].fetchval()
        except asyncpg.InterfaceError as error:
            seen["alice"] = str(error)
        return JSONResponse({"bob": True}, status_code=201)

    store, app_pool = await store_on(pool, idempotency_database_url)
    try:
        app = Starlette(routes=[Route("/alice", alice, methods=["POST"]), Route("/bob", bob, methods=["POST"])])
        app.add_middleware(
            IdempotencyMiddleware, store=store, transactional=True, tenant=lambda scope: scope["path"].strip("/")
        )
        client = client_for(app)
        for path in ("/alice", "/bob", "/alice"):  # the store's own statements stay valid across loans
            assert (await client.post(path, headers={"Idempotency-Key": str(uuid.uuid4())})).status_code == 201
        assert "released back to the pool" in seen["alice"]
    finally:
        await closed(store, app_pool)


@pytest.mark.parametrize("pool", ["own", "app"])
async def test_a_query_logger_or_codec_the_handler_set_goes_with_the_connection(
    idempotency_database_url: str, pool: str
) -> None:
    """A query logger sees every later query's arguments (another tenant's card, its response); a jsonb codec
    changes how later requests' statements send and read jsonb. asyncpg's reset reaches neither: the connection
    that had one is closed, not lent again."""
    logged: list[Any] = []

    async def debug(request: Request) -> Response:
        connection = lent(request)
        connection.add_query_logger(logged.append)
        await connection.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")
        return JSONResponse({"debug": True}, status_code=201)

    async def pay(request: Request) -> Response:
        await lent(request).execute("SELECT $1::text", "alice card 4242")
        return JSONResponse({"secret": "alice-receipt"}, status_code=201)

    store, app_pool = await store_on(pool, idempotency_database_url)
    try:
        app = Starlette(routes=[Route("/debug", debug, methods=["POST"]), Route("/pay", pay, methods=["POST"])])
        app.add_middleware(
            IdempotencyMiddleware, store=store, transactional=True, tenant=lambda scope: scope["path"].strip("/")
        )
        client = client_for(app)
        assert (await client.post("/debug", headers={"Idempotency-Key": str(uuid.uuid4())})).status_code == 201
        logged.clear()
        key = str(uuid.uuid4())
        assert (await client.post("/pay", headers={"Idempotency-Key": key})).status_code == 201
        await asyncio.sleep(0.05)  # query loggers are called soon after each query
        assert not [record for record in logged if "alice" in str(record.args)]
        replay = await client.post("/pay", headers={"Idempotency-Key": key})
        assert replay.status_code == 201
        assert replay.headers["idempotent-replayed"] == "true"
        assert replay.json() == {"secret": "alice-receipt"}
    finally:
        await closed(store, app_pool)


@pytest.fixture
async def tenant_role(db: asyncpg.Connection) -> str:
    """A role with the app's grants only, as a handler switches to for row-level security."""
    await db.execute("CREATE TABLE IF NOT EXISTS rls_payments (tenant text, amount int)")
    if not await db.fetchval("SELECT 1 FROM pg_roles WHERE rolname = 'imw_tenant_role'"):
        await db.execute("CREATE ROLE imw_tenant_role NOLOGIN")
    await db.execute("GRANT SELECT, INSERT ON rls_payments TO imw_tenant_role")
    return "imw_tenant_role"


async def test_a_role_the_handler_switches_to_needs_the_records_grants_and_the_log_says_which(
    idempotency_database_url: str, db: asyncpg.Connection, tenant_role: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The completion is written in the handler's transaction, as the role the handler switched to (SET LOCAL ROLE
    for row-level security). Without the grants the guide names, nothing commits, and the log says what to grant;
    with them, the request completes and replays."""

    async def pay(request: Request) -> Response:
        connection = lent(request)
        await connection.execute(f"SET LOCAL ROLE {tenant_role}")
        await connection.execute("INSERT INTO rls_payments VALUES ('alice', 100)")
        return JSONResponse({"paid": True}, status_code=201)

    async with PostgresStore(idempotency_database_url, max_size=2) as store:
        app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
        app.add_middleware(IdempotencyMiddleware, store=store, transactional=True, tenant=lambda scope: "t-rls")
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app, raise_app_exceptions=False), base_url="http://test"
        )
        refused = await client.post("/pay", headers={"Idempotency-Key": str(uuid.uuid4())})
        assert refused.status_code == 500
        assert "SELECT, UPDATE ON idempotency_records" in caplog.text
        await db.execute(
            f"GRANT SELECT, UPDATE ON idempotency_records TO {tenant_role}; "
            f"GRANT SELECT, INSERT, UPDATE ON idempotency_responses TO {tenant_role}"
        )
        try:
            key = str(uuid.uuid4())
            paid = await client.post("/pay", headers={"Idempotency-Key": key})
            assert paid.status_code == 201, paid.text
            again = await client.post("/pay", headers={"Idempotency-Key": key})
            assert again.headers["idempotent-replayed"] == "true"
        finally:
            await db.execute(
                f"REVOKE ALL ON idempotency_records FROM {tenant_role}; "
                f"REVOKE ALL ON idempotency_responses FROM {tenant_role}"
            )
