"""lending.py: a connection lent to a transactional handler (asyncpg) is the handler's for the request only, and goes
back to its pool as the pool made it, whatever the handler did to its session."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any, cast

import asyncpg
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idempotency_mw import IdempotencyMiddleware, PostgresStore, idempotency_context
from idempotency_mw.postgres import _lending
from idempotency_mw.store import TransactionEnded
from tests.conftest import client_for
from tests.sessions import SESSION_LEAKS, SESSION_STATE


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
        state = await context.connection.fetchrow(SESSION_STATE)
        assert state is not None
        seen.append(dict(state))
        return JSONResponse({"looked": True}, status_code=201)

    app = Starlette(routes=[Route("/leak/{what}", leak, methods=["POST"]), Route("/look", look, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=True, tenant=lambda scope: "t-leak")
    return app


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


async def test_a_reset_that_fails_after_the_commit_keeps_the_committed_answer(
    idempotency_database_url: str, db: asyncpg.Connection, key: str
) -> None:
    """The reset of a lent connection rides in its COMMIT's round trip. If a statement of the reset fails there (here
    the restore of the pool's session state), the COMMIT went through: the answer is the committed one, a retry
    replays it, and the connection, its session in doubt, is closed rather than lent again."""
    await db.execute("CREATE TABLE IF NOT EXISTS lending_effects (key text)")
    backends: list[int] = []

    async def write(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        assert context.connection is not None
        backends.append(await context.connection.fetchval("SELECT pg_backend_pid()"))
        await context.connection.execute("INSERT INTO lending_effects (key) VALUES ($1)", key)
        for connection in list(_lending._restores):  # the restore fails: a real error, after the COMMIT
            _lending._restores[connection] = "SELECT 1 / 0;"
        return JSONResponse({"ok": True}, status_code=201)

    app = Starlette(routes=[Route("/write", write, methods=["POST"])])
    async with PostgresStore(idempotency_database_url, min_size=1, max_size=2) as store:
        app.add_middleware(IdempotencyMiddleware, store=store, transactional=True)
        client = client_for(app)
        first = await client.post("/write", headers={"Idempotency-Key": key})
        assert first.status_code == 201, first.text
        again = await client.post("/write", headers={"Idempotency-Key": key})
        assert again.status_code == 201
        assert again.headers["idempotent-replayed"] == "true"
        assert await db.fetchval("SELECT count(*) FROM lending_effects WHERE key = $1", key) == 1
        gone = await db.fetchval("SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = $1", backends[0])
        assert gone


async def test_a_listener_the_handler_added_does_not_follow_the_connection(
    idempotency_database_url: str, db: asyncpg.Connection
) -> None:
    """asyncpg keeps a listener's callback on its side of the connection, where no SQL reset reaches: a connection
    whose handler added one comes back through asyncpg's own reset too. Otherwise the next user of the connection
    would get the handler's callback, and no LISTEN of its own (asyncpg sends none for a channel it knows)."""
    heard: list[str] = []

    async def listen(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        assert context.connection is not None
        await context.connection.add_listener("imw_lending_chan", lambda *_: heard.append("handler"))
        return JSONResponse({"listened": True}, status_code=201)

    app = Starlette(routes=[Route("/listen", listen, methods=["POST"])])
    async with PostgresStore(idempotency_database_url, min_size=1, max_size=2) as store:  # one connection to lend
        app.add_middleware(IdempotencyMiddleware, store=store, transactional=True)
        answer = await client_for(app).post("/listen", headers={"Idempotency-Key": str(uuid.uuid4())})
        assert answer.status_code == 201
        async with store.connection() as connection:  # the same connection, lent again
            await connection.add_listener("imw_lending_chan", lambda *_: heard.append("next"))
            await db.execute("NOTIFY imw_lending_chan")
            for _ in range(100):  # a bounded wait for the notification to reach this connection
                if heard:
                    break
                await connection.execute("SELECT pg_sleep(0.01)")
    assert heard == ["next"]


async def test_the_reset_deallocates_prepared_statements_only_after_sql_that_said_prepare(
    idempotency_database_url: str,
) -> None:
    """Deallocating SQL-level prepared statements reads pg_prepared_statements and compiles a DO block: about 80 us
    of the server's time, more than three times the rest of the reset. It runs after a loan whose SQL names PREPARE
    (in any case, in a DO block too), and always for a connection whose SQL the store does not see (SQLAlchemy's)."""
    async with PostgresStore(idempotency_database_url, min_size=1, max_size=1) as store:  # one connection for all
        async with store.connection() as lent:
            driver = _lending.driver_connection(cast(_lending.LentConnection, lent)._connection)
            await lent.fetchval("SELECT 1")
            await lent.execute("SELECT $1::text", "PREPARE as a value is no statement")
            assert "DEALLOCATE" not in _lending.reset_sql(driver)
            assert "DEALLOCATE" in _lending.reset_sql(driver, watched=False)
            await lent.execute("do $$ begin execute 'prepare imw_marked as select 1'; end $$")
            assert "DEALLOCATE" in _lending.reset_sql(driver)
            assert "DEALLOCATE" not in _lending.reset_sql(driver)  # once: the reset that runs it clears the mark
            await lent.execute("prepare imw_marked_again as select 2")
        async with store.connection() as again:  # the same connection, given back through its reset
            assert await again.fetchval("SELECT count(*) FROM pg_prepared_statements WHERE from_sql") == 0


@pytest.mark.parametrize("pool", ["own", "app"])
async def test_a_handler_that_deallocates_every_prepared_statement_breaks_no_request(
    idempotency_database_url: str, db: asyncpg.Connection, pool: str
) -> None:
    """DEALLOCATE ALL drops the driver's prepared statements with the session's own: asyncpg's cache of the earlier
    requests' statements, and the store's. The handler's next statement with arguments, its completion, the notice
    of its waiters and the next requests on the connection would each find theirs gone ("prepared statement does not
    exist"), and the request that ran it would be rolled back. asyncpg forgets its statements before the SQL runs,
    and the store prepares its own again: every request answers as if the handler had not run it."""
    await db.execute("CREATE TABLE IF NOT EXISTS lending_effects (key text)")

    async def write(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        assert context.connection is not None
        if request.path_params["how"] == "deallocating":
            await context.connection.execute("DEALLOCATE ALL")
        await context.connection.execute("INSERT INTO lending_effects (key) VALUES ($1)", context.key)
        backends.add(await context.connection.fetchval("SELECT pg_backend_pid()"))
        return JSONResponse({"key": context.key}, status_code=201)

    backends: set[int] = set()
    app_pool = await asyncpg.create_pool(idempotency_database_url, min_size=1, max_size=2) if pool == "app" else None
    store = PostgresStore(app_pool) if app_pool is not None else PostgresStore(idempotency_database_url, max_size=2)
    app = Starlette(routes=[Route("/{how}", write, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=True, tenant=lambda scope: "t-deallocate")
    client = client_for(app)
    try:
        sent = [("deallocating" if index in (1, 3) else "plain", str(uuid.uuid4())) for index in range(6)]
        for how, key in sent:  # on the same connection each time: one request at a time
            answer = await client.post(f"/{how}", headers={"Idempotency-Key": key})
            assert answer.status_code == 201, answer.text
        for how, key in sent:
            again = await client.post(f"/{how}", headers={"Idempotency-Key": key})
            assert again.status_code == 201, again.text
            assert again.headers["idempotent-replayed"] == "true"
        keys = [key for _, key in sent]
        written = await db.fetchval("SELECT count(*) FROM lending_effects WHERE key = ANY($1::text[])", keys)
        assert written == len(keys)
        if pool == "own":  # one connection to lend: never closed for a statement of the store's that failed
            assert len(backends) == 1, backends
    finally:
        await store.close()
        if app_pool is not None:
            await app_pool.close()


async def test_a_deallocation_the_loan_did_not_see_costs_the_next_request_nothing(
    idempotency_database_url: str,
) -> None:
    """DEALLOCATE ALL run through a prepared statement of the handler's is not seen as it runs, and drops the store's
    own statements on that connection: the next request's statement finds its own gone, and was answered 503. It
    never ran, so the store prepares it again and runs it once more."""

    async def tidy(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        assert context.connection is not None
        await (await context.connection.prepare("DEALLOCATE ALL")).fetch()
        return JSONResponse({"busy": True}, status_code=503)  # rolled back, the key released

    async def plain(request: Request) -> Response:
        return JSONResponse({"ok": True}, status_code=201)

    async with PostgresStore(idempotency_database_url, min_size=1, max_size=2) as store:  # one connection to lend
        tx_app = Starlette(routes=[Route("/tidy", tidy, methods=["POST"])])
        tx_app.add_middleware(IdempotencyMiddleware, store=store, transactional=True, tenant=lambda scope: "t-tidy")
        plain_app = Starlette(routes=[Route("/plain", plain, methods=["POST"])])
        plain_app.add_middleware(IdempotencyMiddleware, store=store, tenant=lambda scope: "t-plain")
        assert (
            await client_for(plain_app).post("/plain", headers={"Idempotency-Key": str(uuid.uuid4())})
        ).status_code == 201
        tidied = await client_for(tx_app).post("/tidy", headers={"Idempotency-Key": str(uuid.uuid4())})
        assert tidied.status_code == 503
        for _ in range(2):
            answer = await client_for(plain_app).post("/plain", headers={"Idempotency-Key": str(uuid.uuid4())})
            assert answer.status_code == 201, answer.text


@contextlib.asynccontextmanager
async def charging(
    url: str, pool: str, charge: Any, tenant: str
) -> AsyncIterator[tuple[PostgresStore, httpx.AsyncClient]]:
    """A transactional ``/charge`` route on the store's own pool (``own``) or on an app's asyncpg pool (``app``)."""
    app_pool = await asyncpg.create_pool(url, min_size=1, max_size=2) if pool == "app" else None
    store = PostgresStore(app_pool) if app_pool is not None else PostgresStore(url, max_size=2)
    app = Starlette(routes=[Route("/charge", charge, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=True, tenant=lambda scope: tenant)
    try:
        yield store, client_for(app)
    finally:
        await store.close()
        if app_pool is not None:
            await app_pool.close()


@pytest.mark.parametrize("pool", ["own", "app"])
@pytest.mark.parametrize("ending", ["ROLLBACK; BEGIN", "COMMIT; BEGIN", "COMMIT AND CHAIN"])
async def test_a_handler_that_ends_its_transaction_and_begins_another_gets_no_record(
    idempotency_database_url: str, db: asyncpg.Connection, key: str, pool: str, ending: str
) -> None:
    """The connection is in a transaction again as the handler returns, but not in the one the store began: recorded
    in it, a retry would replay a 201 for a charge rolled back, or the record would commit apart from the half the
    handler committed. Refused as when the handler only ends it (``TransactionEnded``): no record, the key free."""
    await db.execute("CREATE TABLE IF NOT EXISTS lending_effects (key text)")

    async def charge(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        assert context.connection is not None
        await context.connection.execute("INSERT INTO lending_effects (key) VALUES ($1)", key)
        await context.connection.execute(ending)
        return JSONResponse({"charged": True}, status_code=201)

    async with charging(idempotency_database_url, pool, charge, "t-ended") as (store, client):
        with pytest.raises(TransactionEnded):
            await client.post("/charge", headers={"Idempotency-Key": key})
        assert await store.inspect("t-ended", key) is None
        charged = await db.fetchval("SELECT count(*) FROM lending_effects WHERE key = $1", key)
        assert charged == (0 if ending.startswith("ROLLBACK") else 1)  # the handler's own COMMIT stays


async def test_a_step_that_ends_its_transaction_and_begins_another_leaves_no_recovery_point(
    idempotency_database_url: str, db: asyncpg.Connection, key: str
) -> None:
    """A step's recovery point written in the handler's own transaction after its ROLLBACK would commit without the
    step's writes: the retry would resume after a step whose effect never landed."""
    await db.execute("CREATE TABLE IF NOT EXISTS lending_effects (key text)")

    async def charge(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        connection = context.connection
        assert connection is not None

        async def create() -> dict[str, Any]:
            await connection.execute("INSERT INTO lending_effects (key) VALUES ($1)", key)
            await connection.execute("ROLLBACK; BEGIN")
            return {"charge": "c-1"}

        await context.steps.local("create_charge", create)
        return JSONResponse({"charged": True}, status_code=201)

    async with PostgresStore(idempotency_database_url, max_size=2) as store:
        app = Starlette(routes=[Route("/charge", charge, methods=["POST"])])
        app.add_middleware(IdempotencyMiddleware, store=store, transactional=True, tenant=lambda scope: "t-step")
        with pytest.raises(TransactionEnded):
            await client_for(app).post("/charge", headers={"Idempotency-Key": key})
        points = "SELECT count(*) FROM idempotency_recovery_points WHERE tenant = 't-step' AND key = $1"
        assert await db.fetchval(points, key) == 0
        assert await store.inspect("t-step", key) is None
        assert await db.fetchval("SELECT count(*) FROM lending_effects WHERE key = $1", key) == 0


@pytest.mark.parametrize("pool", ["own", "app"])
async def test_the_handler_chooses_its_isolation_level_and_nests_savepoints_in_the_transaction(
    idempotency_database_url: str, db: asyncpg.Connection, key: str, pool: str
) -> None:
    """What the guide promises a handler of the transaction it is lent, which the store marks as it begins: the
    isolation level set first (no query of the store's took the snapshot before it), and asyncpg's savepoints in it
    (``connection.transaction()``), one of which fails and is caught."""
    await db.execute("CREATE TABLE IF NOT EXISTS lending_effects (key text)")
    levels: list[str] = []

    async def charge(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        connection = context.connection
        assert connection is not None
        await connection.execute("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE")
        levels.append(await connection.fetchval("SHOW transaction_isolation"))
        with contextlib.suppress(asyncpg.DivisionByZeroError):  # rolled back to the savepoint: the rest goes on
            async with connection.transaction():
                await connection.execute("INSERT INTO lending_effects (key) VALUES ($1)", key)
                await connection.execute("SELECT 1 / 0")
        async with connection.transaction():
            await connection.execute("INSERT INTO lending_effects (key) VALUES ($1)", key)
        return JSONResponse({"charged": True}, status_code=201)

    async with charging(idempotency_database_url, pool, charge, "t-savepoints") as (_, client):
        assert (await client.post("/charge", headers={"Idempotency-Key": key})).status_code == 201
        again = await client.post("/charge", headers={"Idempotency-Key": key})
        assert again.headers["idempotent-replayed"] == "true"
        assert levels == ["serializable"]
        assert await db.fetchval("SELECT count(*) FROM lending_effects WHERE key = $1", key) == 1
