"""transaction.py: transactional mode (docs/design.md §6), the effect and the record commit together or neither does.

Every case runs on both flavours of transactional store (``flavour``): a PostgresStore, whose handler writes through
the asyncpg connection it is lent, and a SQLAlchemyStore, whose handler adds ORM objects to the AsyncSession it is
lent (flushed by the middleware before the commit, unless the case asks the handler to flush). The core cases also
run on databases whose default isolation level is each of PostgreSQL's three (``isolated_flavour``). What only one
flavour has (asyncpg's lent connection and its resets, SQLAlchemy's session lifecycle, SQLModel, the FastAPI
dependency) is tested in that flavour's own file: test_lending.py, test_postgres.py, test_sqlalchemy.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from sqlalchemy import exc, select, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from idempotency_mw import IdempotencyMiddleware, MemoryStore, PostgresStore, StoredResponse, idempotency_context
from idempotency_mw._channels import http_date
from idempotency_mw._events import Event, Outcome
from idempotency_mw.sqlalchemy import SQLAlchemyStore, idempotency_session
from idempotency_mw.store import TransactionEnded
from tests.apps import Background
from tests.calls import Call
from tests.conftest import ISOLATION_LEVELS, client_for, opened, tenant_of
from tests.orm import SCHEMA, Effect, Once, create_tables, sqlalchemy_url

# -- the two flavours ---------------------------------------------------------------------------------------------


class Flavour:
    """A transactional store, the test's own connection to its database, and what a handler does through what it
    was lent: write an effect, run a statement. Effects are rows of ``table`` (key, note)."""

    name: str
    table: str
    # The error a handler's statement raises when the database refuses it, by how it was refused.
    refused: dict[str, type[Exception]]

    def __init__(self, store: PostgresStore | SQLAlchemyStore, db: asyncpg.Connection, url: str) -> None:
        self.store = store
        self.db = db
        self.url = url

    async def write(self, request: Request, key: str, note: str, *, flush: bool = False) -> None:
        raise NotImplementedError

    async def execute(self, request: Request, sql: str) -> None:
        raise NotImplementedError

    async def fetchval(self, request: Request, sql: str) -> Any:
        raise NotImplementedError

    async def refuse(self, request: Request, how: str) -> None:
        """Make the database refuse the handler's transaction: at COMMIT (``deferred``, a deferred unique
        constraint), or earlier (``swallowed``, an error the handler catches, which still aborts the transaction)."""
        raise NotImplementedError

    async def forget_with_its_effect(self, tenant: str, key: str) -> bool:
        """Delete the effect and forget its record, in one transaction of the app's own."""
        raise NotImplementedError

    async def effects(self, key: str) -> int:
        return int(await self.db.fetchval(f"SELECT count(*) FROM {self.table} WHERE key = $1", key))

    async def notes(self, note: str) -> int:
        return int(await self.db.fetchval(f"SELECT count(*) FROM {self.table} WHERE note = $1", note))

    async def terminate_own_backend(self, request: Request) -> None:
        """Terminate the server process of the handler's connection, and wait until the driver notices."""
        pid = await self.fetchval(request, "SELECT pg_backend_pid()")
        await self.db.execute("SELECT pg_terminate_backend($1)", pid)
        await asyncio.sleep(0.2)


class Asyncpg(Flavour):
    name = "asyncpg"
    table = "tx_effects"
    refused = {"deferred": asyncpg.PostgresError, "swallowed": asyncpg.PostgresError}

    @staticmethod
    def connection(request: Request) -> Any:
        context = idempotency_context(request)
        assert context is not None
        assert context.connection is not None
        return context.connection

    async def write(self, request: Request, key: str, note: str, *, flush: bool = False) -> None:
        connection = self.connection(request)
        assert connection.is_in_transaction()
        await connection.execute("INSERT INTO tx_effects VALUES ($1, $2)", key, note)

    async def execute(self, request: Request, sql: str) -> None:
        await self.connection(request).execute(sql)

    async def fetchval(self, request: Request, sql: str) -> Any:
        return await self.connection(request).fetchval(sql)

    async def refuse(self, request: Request, how: str) -> None:
        connection = self.connection(request)
        if how == "deferred":
            await connection.execute("INSERT INTO tx_deferred VALUES (1), (1)")  # refused only at COMMIT
        else:
            with contextlib.suppress(asyncpg.DivisionByZeroError):
                await connection.execute("SELECT 1 / 0")  # caught, but the transaction is now aborted

    async def forget_with_its_effect(self, tenant: str, key: str) -> bool:
        assert isinstance(self.store, PostgresStore)
        async with self.store.connection() as connection, connection.transaction():
            await connection.execute("DELETE FROM tx_effects WHERE key = $1", key)
            return await self.store.forget(tenant, key, connection=connection)

    async def terminate_own_backend(self, request: Request) -> None:
        connection = self.connection(request)
        await self.db.execute("SELECT pg_terminate_backend($1)", connection.get_server_pid())
        for _ in range(100):
            if connection.is_closed():
                break
            await asyncio.sleep(0.01)


class SQLAlchemy(Flavour):
    name = "sqlalchemy"
    table = f"{SCHEMA}.effects"
    refused = {"deferred": exc.IntegrityError, "swallowed": exc.DBAPIError}

    async def write(self, request: Request, key: str, note: str, *, flush: bool = False) -> None:
        session = idempotency_session(request)
        session.add(Effect(key=key, note=note))  # not flushed: the middleware flushes it before the commit
        if flush:
            await session.flush()

    async def execute(self, request: Request, sql: str) -> None:
        await idempotency_session(request).execute(text(sql))

    async def fetchval(self, request: Request, sql: str) -> Any:
        return (await idempotency_session(request).execute(text(sql))).scalar_one()

    async def refuse(self, request: Request, how: str) -> None:
        session = idempotency_session(request)
        if how == "deferred":
            session.add_all([Once(value=1), Once(value=1)])  # refused only at COMMIT
        else:
            with contextlib.suppress(exc.DBAPIError):
                await session.execute(text("SELECT 1 / 0"))  # caught, but the transaction is now aborted

    async def forget_with_its_effect(self, tenant: str, key: str) -> bool:
        assert isinstance(self.store, SQLAlchemyStore)
        async with AsyncSession(self.store.engine) as session, session.begin():
            effect = (await session.execute(select(Effect).where(Effect.key == key))).scalar_one()
            await session.delete(effect)
            return await self.store.forget(tenant, key, connection=await session.connection())


FLAVOURS = {"asyncpg": Asyncpg, "sqlalchemy": SQLAlchemy}


@contextlib.asynccontextmanager
async def flavour_on(name: str, url: str, *, store_timeout: float = 5.0) -> AsyncIterator[Flavour]:
    """The flavour ``name`` on the database at ``url``, its effect tables made, its store opened (and closed without
    the shutdown grace: tests leave claims in progress on purpose), with the store timeout ``store_timeout``."""
    db = await asyncpg.connect(url)
    try:
        await db.execute("CREATE TABLE IF NOT EXISTS tx_effects (key text, note text)")
        await db.execute(
            "CREATE TABLE IF NOT EXISTS tx_deferred (id int, CONSTRAINT tx_deferred_once UNIQUE (id) "
            "DEFERRABLE INITIALLY DEFERRED)"
        )
        if name == "asyncpg":
            async with opened(PostgresStore(url, timeout=store_timeout)) as store:
                yield Asyncpg(store, db, url)
            return
        await create_tables(url)
        engine = create_async_engine(sqlalchemy_url(url), pool_size=5, max_overflow=0)
        try:
            sqlalchemy_store = SQLAlchemyStore(PostgresStore(url, timeout=store_timeout), engine)
            await sqlalchemy_store.open()
            try:
                yield SQLAlchemy(sqlalchemy_store, db, url)
            finally:
                await sqlalchemy_store.close(grace=0)
        finally:
            await engine.dispose()
    finally:
        await db.close()


@pytest.fixture(params=list(FLAVOURS))
async def flavour(request: pytest.FixtureRequest, idempotency_database_url: str) -> AsyncIterator[Flavour]:
    """Each flavour of transactional store, in turn, on the suite's database."""
    async with flavour_on(request.param, idempotency_database_url) as each:
        yield each


@pytest.fixture(params=[(name, level) for name in FLAVOURS for level in ISOLATION_LEVELS], ids=lambda p: ", ".join(p))
async def isolated_flavour(request: pytest.FixtureRequest, isolation_urls: dict[str, str]) -> AsyncIterator[Flavour]:
    """Each flavour on a database whose default isolation level is each of PostgreSQL's three, in turn."""
    name, level = request.param
    async with flavour_on(name, isolation_urls[level]) as each:
        yield each


# -- the app ------------------------------------------------------------------------------------------------------


class Gate:
    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.go = asyncio.Event()
        self.go.set()


async def held_request(
    flavour: Flavour, path: str, key: str, **options: Any
) -> tuple[httpx.AsyncClient, Gate, asyncio.Task[httpx.Response]]:
    """A keyed ``POST path`` to :func:`build`'s app whose handler has written and waits at its gate (``gate.go``)."""
    gate = Gate()
    gate.go.clear()
    client = client_for(build(flavour, gate, **options))
    request = asyncio.create_task(client.post(path, headers={"Idempotency-Key": key}))
    await asyncio.wait_for(gate.entered.wait(), 5)
    return client, gate, request


class CardDeclined(Exception):
    """An app's own exception, which its exception handler turns into a 402."""


def build(flavour: Flavour, gate: Gate, **options: Any) -> Starlette:
    """``POST /write?note=...`` writes an effect (the note, or the body), waits at the gate, then answers as the note
    says. ``flush=1``: the SQLAlchemy handler flushes its write at once, before anything fails."""

    async def write(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        note = request.query_params.get("note") or (await request.body()).decode() or "ok"
        await flavour.write(request, context.key or "none", note, flush=bool(request.query_params.get("flush")))
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
    app.add_middleware(IdempotencyMiddleware, store=flavour.store, transactional=True, **options)
    return app


def scope_for(key: str) -> dict[str, Any]:
    return {
        "type": "http",
        "method": "POST",
        "path": "/write",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"idempotency-key", key.encode()), (b"authorization", b"Bearer sk_test_alice")],
        "scheme": "http",
        "server": ("t", 80),
    }


async def receive_nothing() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


# -- the core cases, under each default isolation level -----------------------------------------------------------


async def test_effect_and_record_commit_together(isolated_flavour: Flavour) -> None:
    flavour = isolated_flavour
    key = str(uuid.uuid4())
    client = client_for(build(flavour, Gate()))
    first = await client.post("/write", headers={"Idempotency-Key": key})
    assert first.status_code == 201
    again = await client.post("/write", headers={"Idempotency-Key": key})
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert await flavour.effects(key) == 1
    info = await flavour.store.inspect(tenant_of(), key)
    assert info is not None
    assert (info.state, info.lease_expires_at) == ("completed", None)  # inspect shows no lease on a completed record
    # The record's expiry, rounded down to the second, on the answer and its replay (tests/test_expiry.py).
    dated = http_date(info.expires_at).decode()
    assert first.headers["idempotency-expires"] == again.headers["idempotency-expires"] == dated


@pytest.mark.parametrize("note", ["raise", "500"])
async def test_handler_failure_rolls_back_effect_and_record(isolated_flavour: Flavour, note: str) -> None:
    flavour = isolated_flavour
    key = str(uuid.uuid4())
    client = client_for(build(flavour, Gate()))
    if note == "raise":
        with pytest.raises(RuntimeError):
            await client.post(f"/write?note={note}&flush=1", headers={"Idempotency-Key": key})
    else:
        response = await client.post(f"/write?note={note}&flush=1", headers={"Idempotency-Key": key})
        assert response.status_code == 500
    assert await flavour.effects(key) == 0
    assert await flavour.store.inspect(tenant_of(), key) is None
    retry = await client.post("/write?note=ok", headers={"Idempotency-Key": key})
    assert retry.status_code == 201
    assert await flavour.effects(key) == 1


async def test_fenced_out_completion_rolls_back_the_handlers_writes(isolated_flavour: Flavour) -> None:
    """A zombie worker (its lease was taken over mid-handler) and the claim that took the key over cannot both
    commit: under READ COMMITTED the zombie can neither commit its effect nor its record; under REPEATABLE READ and
    SERIALIZABLE, whose snapshot may predate the takeover, the first to commit its response wins and the other is
    refused."""
    flavour = isolated_flavour
    key = str(uuid.uuid4())
    client, gate, zombie = await held_request(flavour, "/write?flush=1", key)
    # Another worker takes the key over: the lease lapsed (a long pause, say) and a retry claimed it.
    await flavour.db.execute(
        "UPDATE idempotency_records SET lease_expires_at = now() - interval '1 second' WHERE key = $1", key
    )
    record = await flavour.db.fetchrow("SELECT tenant, fingerprint FROM idempotency_records WHERE key = $1", key)
    assert record is not None
    takeover = await flavour.store.claim(record["tenant"], key, bytes(record["fingerprint"]), lease=60, ttl=600)
    assert takeover.outcome.value == "owned"
    gate.go.set()
    response = await zombie
    info = await flavour.store.inspect(record["tenant"], key)
    done = StoredResponse(201, [], b"{}", 2)
    if await flavour.db.fetchval("SHOW default_transaction_isolation") == "read committed":
        # The zombie's completion sees the takeover: fenced out, and its effect rolls back with it.
        assert response.status_code == 409
        assert response.json()["code"] == "idempotency_request_in_progress"
        assert "idempotency-expires" not in response.headers
        assert await flavour.effects(key) == 0
        info = await flavour.store.inspect(record["tenant"], key)
        assert info is not None
        assert info.state == "in_progress"
        assert info.fence == takeover.fence
        assert await flavour.store.complete(record["tenant"], key, takeover.fence, done)  # the takeover's to finish
    else:
        # The zombie's snapshot predates the takeover: of the two claims the first to commit its response wins
        # (sql/queries.sql, complete_in_transaction). Here that is the zombie, so its effect stands, the takeover
        # cannot complete, and the retry is the zombie's answer replayed: one effect either way.
        assert response.status_code == 201
        assert await flavour.effects(key) == 1
        assert not await flavour.store.complete(record["tenant"], key, takeover.fence, done)
        retry = await client.post("/write?flush=1", headers={"Idempotency-Key": key})
        assert retry.headers["idempotent-replayed"] == "true"
        assert retry.content == response.content
        assert await flavour.effects(key) == 1


async def test_a_zombie_whose_snapshot_predates_a_completed_takeover_is_fenced_out(isolated_flavour: Flavour) -> None:
    """Under REPEATABLE READ or SERIALIZABLE the zombie's snapshot still shows its own claim after a takeover; the
    newer claim's response, stored first, is what stops its completion (a serialization failure there): its writes
    roll back, it answers the fenced-out 409, and the key stays with the newer claim."""
    flavour = isolated_flavour
    key = str(uuid.uuid4())
    client, gate, zombie = await held_request(flavour, "/write?flush=1", key)  # its first write took its snapshot
    await flavour.db.execute(
        "UPDATE idempotency_records SET lease_expires_at = now() - interval '1 second' WHERE key = $1", key
    )
    record = await flavour.db.fetchrow("SELECT tenant, fingerprint FROM idempotency_records WHERE key = $1", key)
    assert record is not None
    takeover = await flavour.store.claim(record["tenant"], key, bytes(record["fingerprint"]), lease=60, ttl=600)
    assert takeover.outcome.value == "owned"
    newer = StoredResponse(201, [(b"content-type", b"application/json")], b'{"newer":true}', 14)
    assert await flavour.store.complete(record["tenant"], key, takeover.fence, newer)
    gate.go.set()
    response = await zombie
    assert response.status_code == 409
    assert response.json()["code"] == "idempotency_request_in_progress"
    assert await flavour.effects(key) == 0
    replay = await client.post("/write?flush=1", headers={"Idempotency-Key": key})
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.content == b'{"newer":true}'


@pytest.mark.parametrize("name", list(FLAVOURS))
async def test_a_serialization_failure_at_the_completion_releases_the_key(
    name: str, isolation_urls: dict[str, str]
) -> None:
    """Under SERIALIZABLE, two handlers that each read what the other writes (write skew) cannot both commit, and
    PostgreSQL may refuse the second at any statement: the completion's insert included. That is the handler's
    transaction failing, not a newer claim of its key: the key is released (not held for its lease behind 409s),
    and the retry runs afresh."""
    both_read = asyncio.Barrier(2)
    first_committed = asyncio.Event()
    seen: set[str | None] = set()
    async with flavour_on(name, isolation_urls["serializable"]) as flavour:

        async def skewed(request: Request) -> Response:
            context = idempotency_context(request)
            assert context is not None
            await flavour.fetchval(request, f"SELECT count(*) FROM {flavour.table}")
            retry = context.key in seen
            seen.add(context.key)
            if not retry:
                await both_read.wait()
            await flavour.write(request, context.key or "none", "skew", flush=True)
            if "second" in request.query_params and not retry:
                await first_committed.wait()  # its completion runs after the first transaction committed
            return JSONResponse({"done": True}, status_code=201)

        app = Starlette(routes=[Route("/skew", skewed, methods=["POST"])])
        app.add_middleware(IdempotencyMiddleware, store=flavour.store, transactional=True)
        client = client_for(app)
        first_key, second_key = str(uuid.uuid4()), str(uuid.uuid4())
        first = asyncio.create_task(client.post("/skew", headers={"Idempotency-Key": first_key}))
        second = asyncio.create_task(client.post("/skew?second=1", headers={"Idempotency-Key": second_key}))
        assert (await first).status_code == 201
        first_committed.set()
        (failed,) = await asyncio.gather(second, return_exceptions=True)
        if isinstance(failed, BaseException):  # raised out of the app: its server answers 500
            assert "could not serialize access" in str(failed), repr(failed)
        else:
            assert failed.status_code == 500, failed.text
        assert await flavour.store.inspect(tenant_of(), second_key) is None  # released at once, not left to its lease
        retry = await client.post("/skew?second=1", headers={"Idempotency-Key": second_key})
        assert retry.status_code == 201
        assert await flavour.effects(second_key) == 1


async def test_a_duplicate_refused_while_the_original_runs_does_not_fail_it(isolated_flavour: Flavour) -> None:
    """The duplicate's claim counts its attempt on the record; under REPEATABLE READ or SERIALIZABLE that must not
    make the original's completion a serialization failure (500, nothing committed)."""
    flavour = isolated_flavour
    key = str(uuid.uuid4())
    client, gate, original = await held_request(flavour, "/write", key)
    for _ in range(3):
        duplicate = await client.post("/write", headers={"Idempotency-Key": key})
        assert duplicate.status_code == 409
    gate.go.set()
    assert (await original).status_code == 201
    assert await flavour.effects(key) == 1
    retry = await client.post("/write", headers={"Idempotency-Key": key})
    assert retry.headers["idempotent-replayed"] == "true"


async def test_a_handler_that_outlives_lease_renewals_completes(isolated_flavour: Flavour) -> None:
    """Renewals write the record while the handler runs; under REPEATABLE READ that must not keep a handler that
    runs longer than a third of its lease from ever completing."""
    flavour = isolated_flavour
    key = str(uuid.uuid4())
    _, gate, original = await held_request(flavour, "/write", key, lease=0.3)
    await asyncio.sleep(0.5)  # a renewal every 0.1 s
    gate.go.set()
    assert (await original).status_code == 201
    assert await flavour.effects(key) == 1


async def test_the_handlers_transaction_keeps_the_databases_isolation_level(isolated_flavour: Flavour) -> None:
    flavour = isolated_flavour

    async def level(request: Request) -> Response:
        return JSONResponse({"level": await flavour.fetchval(request, "SHOW transaction_isolation")})

    app = Starlette(routes=[Route("/level", level, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=flavour.store, transactional=True)
    expected = await flavour.db.fetchval("SHOW default_transaction_isolation")
    answer = await client_for(app).post("/level", headers={"Idempotency-Key": str(uuid.uuid4())})
    assert answer.json() == {"level": expected}


# -- the answer and the commit ------------------------------------------------------------------------------------


async def test_response_is_sent_only_after_the_commit(flavour: Flavour) -> None:
    """When the first byte reaches the client, the effect and the completed record are already visible."""
    key = str(uuid.uuid4())
    seen: dict[str, Any] = {}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            seen["effects"] = await flavour.effects(key)
            seen["completed"] = await flavour.db.fetchval(
                "SELECT count(*) FROM idempotency_responses WHERE key = $1", key
            )

    await build(flavour, Gate())(scope_for(key), receive_nothing, send)
    assert seen == {"effects": 1, "completed": 1}


async def test_client_gone_after_commit_keeps_the_record(flavour: Flavour) -> None:
    """The response was lost after the commit: the retry is answered by the replay, never by a second effect."""
    key = str(uuid.uuid4())
    app = build(flavour, Gate())

    async def send(message: Message) -> None:
        raise OSError("client disconnected")

    with pytest.raises(OSError, match="client disconnected"):
        await app(scope_for(key), receive_nothing, send)
    retry = await client_for(app).post("/write", headers={"Idempotency-Key": key})
    assert retry.headers["idempotent-replayed"] == "true"
    assert await flavour.effects(key) == 1


async def test_keyless_request_on_a_transactional_route_gets_a_transaction(flavour: Flavour) -> None:
    client = client_for(build(flavour, Gate()))
    assert (await client.post("/write?note=keyless")).status_code == 201
    assert await flavour.notes("keyless") >= 1
    before = await flavour.notes("500")
    assert (await client.post("/write?note=500")).status_code == 500
    assert await flavour.notes("500") == before


async def test_keyless_request_on_a_transactional_route_keeps_its_body(flavour: Flavour) -> None:
    note = f"body-{uuid.uuid4()}"
    assert (await client_for(build(flavour, Gate())).post("/write", content=note.encode())).status_code == 201
    assert await flavour.notes(note) == 1


async def test_response_over_the_cap_commits_before_streaming(flavour: Flavour) -> None:
    key = str(uuid.uuid4())
    client = client_for(build(flavour, Gate(), max_response_bytes=1000))
    live = await client.post("/write?note=big", headers={"Idempotency-Key": key})
    assert live.content == b"y" * 5000
    assert "idempotency-expires" in live.headers  # recorded (without its body): the key holds until then
    retry = await client.post("/write?note=big", headers={"Idempotency-Key": key})
    assert retry.status_code == 409
    assert retry.json()["code"] == "idempotency_response_not_replayable"
    assert await flavour.effects(key) == 1


async def test_a_handler_failing_after_an_over_cap_commit_keeps_its_record(flavour: Flavour) -> None:
    """Past the cap the transaction commits so the response can stream; a later failure cannot undo that. The
    event says what happened (executed, not released) and the retry gets 409 instead of a second effect."""
    key = str(uuid.uuid4())
    events: list[Event] = []

    async def write(request: Request) -> Response:
        await flavour.write(request, key, "stream")

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(3):
                yield b"z" * 800
            raise RuntimeError("failed mid-stream")

        return StreamingResponse(chunks())

    app = Starlette(routes=[Route("/write", write, methods=["POST"])])
    app.add_middleware(
        IdempotencyMiddleware, store=flavour.store, transactional=True, max_response_bytes=1000, on_event=events.append
    )
    client = client_for(app)
    with pytest.raises(RuntimeError, match="mid-stream"):
        await client.post("/write", headers={"Idempotency-Key": key})
    assert [event.outcome for event in events] == [Outcome.EXECUTED]
    retry = await client.post("/write", headers={"Idempotency-Key": key})
    assert retry.status_code == 409
    assert retry.json()["code"] == "idempotency_response_not_replayable"
    assert await flavour.effects(key) == 1


async def test_downstream_key_is_stable_per_tenant_key_and_label(flavour: Flavour) -> None:
    key = str(uuid.uuid4())
    app = build(flavour, Gate())
    a = await client_for(app, token="a").post("/write", headers={"Idempotency-Key": key})
    b = await client_for(app, token="b").post("/write", headers={"Idempotency-Key": key})
    a_again = await client_for(app, token="a").post("/write", headers={"Idempotency-Key": key})
    assert a.json()["downstream"] == a_again.json()["downstream"]
    assert a.json()["downstream"] != b.json()["downstream"]
    assert len(a.json()["downstream"]) == 64


@pytest.mark.parametrize(("note", "status"), [("http400", 400), ("declined", 402)])
async def test_an_exception_turned_into_a_response_rolls_back_and_is_recorded(
    flavour: Flavour, note: str, status: int
) -> None:
    """A handler that writes, then raises an exception the app answers (HTTPException, or one with an exception
    handler): its writes roll back as a raised exception does anywhere else, while the answer is final and recorded,
    so the retry gets the same answer and nothing ran twice."""
    key = str(uuid.uuid4())
    client = client_for(build(flavour, Gate()))
    first = await client.post(f"/write?note={note}&flush=1", headers={"Idempotency-Key": key})
    assert first.status_code == status
    assert await flavour.effects(key) == 0
    retry = await client.post(f"/write?note={note}&flush=1", headers={"Idempotency-Key": key})
    assert retry.headers["idempotent-replayed"] == "true"
    assert (retry.status_code, retry.content) == (status, first.content)
    assert await flavour.effects(key) == 0
    assert first.headers["idempotency-expires"] == retry.headers["idempotency-expires"]  # recorded outside it


async def test_a_returned_4xx_commits_the_handlers_writes(flavour: Flavour) -> None:
    """A 4xx the handler returns is its answer, written with its effect (a declined card that records the attempt)."""
    key = str(uuid.uuid4())
    client = client_for(build(flavour, Gate()))
    assert (await client.post("/write?note=402", headers={"Idempotency-Key": key})).status_code == 402
    assert await flavour.effects(key) == 1
    retry = await client.post("/write?note=402", headers={"Idempotency-Key": key})
    assert retry.headers["idempotent-replayed"] == "true"
    assert await flavour.effects(key) == 1


async def test_forget_in_the_deleting_transaction(flavour: Flavour) -> None:
    """The resource-deleted race: deleting a resource and its creation record together means a late retry of
    the creation runs again (creating anew) instead of replaying a response naming a resource that is gone."""
    key = str(uuid.uuid4())
    client = client_for(build(flavour, Gate()))
    assert (await client.post("/write", headers={"Idempotency-Key": key})).status_code == 201
    assert await flavour.forget_with_its_effect(tenant_of(), key)
    assert await flavour.store.inspect(tenant_of(), key) is None
    again = await client.post("/write", headers={"Idempotency-Key": key})
    assert "idempotent-replayed" not in again.headers
    assert await flavour.effects(key) == 1


# -- what the database refuses, and a handler that ends the transaction itself -----------------------------------


@pytest.mark.parametrize("how", ["deferred", "swallowed"])
async def test_a_transaction_the_database_refuses_is_a_handler_failure(
    flavour: Flavour, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Not a 503 "store unavailable" (the store is fine, and a retry would fail the same way): the request fails
    like a handler error, nothing is committed, the log says why and what to do (a savepoint), and the key is free
    for a corrected retry."""

    async def write(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        assert context.key is not None
        how = request.query_params["how"]
        await flavour.write(request, context.key, how)
        if how != "fixed":
            await flavour.refuse(request, how)
        return JSONResponse({"written": how}, status_code=201)

    app = Starlette(routes=[Route("/write", write, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=flavour.store, transactional=True)
    key = str(uuid.uuid4())
    client = client_for(app)
    with pytest.raises(flavour.refused[how]):
        await client.post(f"/write?how={how}", headers={"Idempotency-Key": key})
    assert await flavour.effects(key) == 0
    assert await flavour.store.inspect(tenant_of(), key) is None
    assert "could not commit" in caplog.text
    assert "savepoint" in caplog.text
    retry = await client.post("/write?how=fixed", headers={"Idempotency-Key": key})
    assert retry.status_code == 201
    assert await flavour.effects(key) == 1


@pytest.mark.parametrize("statement", ["ROLLBACK", "COMMIT"])
async def test_a_handler_that_ends_its_transaction_gets_no_record(
    flavour: Flavour, key: str, statement: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The handler runs COMMIT or ROLLBACK on what it was lent (SQLAlchemy passes a raw one on without knowing that
    it ends the transaction). The record is refused: recorded, a 201 after a ROLLBACK would tell every retry of an
    effect that never happened. The request fails like a handler error, the log says why and what to use instead
    (a savepoint), and the key is free."""

    async def write(request: Request) -> Response:
        await flavour.write(request, key, statement, flush=True)
        await flavour.execute(request, statement)
        return JSONResponse({"ok": True}, status_code=201)

    app = Starlette(routes=[Route("/write", write, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=flavour.store, transactional=True)
    with pytest.raises(TransactionEnded):
        await client_for(app).post("/write", headers={"Idempotency-Key": key})
    assert await flavour.store.inspect(tenant_of(), key) is None
    assert await flavour.effects(key) == (1 if statement == "COMMIT" else 0)
    assert "savepoint" in caplog.text


# -- the connection lost ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [201, 500])
async def test_a_connection_lost_mid_transaction_is_503_and_frees_the_key(
    flavour: Flavour, key: str, status: int
) -> None:
    """The handler wrote; then its connection died under it (an operator's pg_terminate_backend, a failover),
    before the record could be written (201) or before the rollback (500). The database could not be reached, so
    the answer is 503 (retry later), not a handler error, and the retry runs afresh."""

    async def write(request: Request) -> Response:
        await flavour.write(request, key, "lost", flush=True)
        await flavour.terminate_own_backend(request)
        return JSONResponse({"status": status}, status_code=status)

    app = Starlette(routes=[Route("/write", write, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=flavour.store, transactional=True)
    response = await client_for(app).post("/write", headers={"Idempotency-Key": key})
    assert response.status_code == 503
    assert response.json()["code"] == "idempotency_store_unavailable"
    assert await flavour.store.inspect(tenant_of(), key) is None  # released: the retry runs afresh
    assert await flavour.effects(key) == 0


async def test_a_backend_terminated_while_the_handler_runs_is_503_and_frees_the_key(flavour: Flavour, key: str) -> None:
    """The handler's own statement dies with its connection (an operator's pg_terminate_backend, a failover): the
    store is what failed, so the answer is 503 with the key released, not a 500."""
    runs: list[int] = []

    async def write(request: Request) -> Response:
        runs.append(1)
        if len(runs) == 1:
            pid = await flavour.fetchval(request, "SELECT pg_backend_pid()")
            await flavour.db.execute("SELECT pg_terminate_backend($1)", pid)
        await flavour.execute(request, "SELECT pg_sleep(0.05)")
        return JSONResponse({"ok": True}, status_code=201)

    app = Starlette(routes=[Route("/write", write, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=flavour.store, transactional=True)
    client = client_for(app)
    response = await client.post("/write", headers={"Idempotency-Key": key})
    assert response.status_code == 503
    assert response.json()["code"] == "idempotency_store_unavailable"
    assert await flavour.store.inspect(tenant_of(), key) is None
    retry = await client.post("/write", headers={"Idempotency-Key": key})
    assert retry.status_code == 201
    assert runs == [1, 1]


@pytest.mark.parametrize("name", list(FLAVOURS))
async def test_a_frozen_database_costs_one_timeout_not_one_per_statement(
    name: str, idempotency_database_url: str, key: str
) -> None:
    """A server that stops answering mid-request (a hung host, a partition) fails the request's next statement after
    the store's timeout: 503. Its transaction is not then rolled back over the dead connection, which would wait out
    a second timeout (and asyncpg's unfinished cancellation) for nothing: closing the connection rolls it back."""
    timeout = 0.5
    frozen: list[int] = []
    async with flavour_on(name, idempotency_database_url, store_timeout=timeout) as flavour:

        async def write(request: Request) -> Response:
            await flavour.write(request, key, "frozen", flush=True)
            pid = int(await flavour.fetchval(request, "SELECT pg_backend_pid()"))
            try:
                os.kill(pid, signal.SIGSTOP)  # this request's backend stops answering
                frozen.append(pid)
            except (ProcessLookupError, PermissionError):
                pass  # a server on another host, or another user's: skipped below
            return JSONResponse({"ok": True}, status_code=201)

        app = Starlette(routes=[Route("/write", write, methods=["POST"])])
        app.add_middleware(IdempotencyMiddleware, store=flavour.store, transactional=True)
        try:
            started = time.monotonic()
            response = await client_for(app).post("/write", headers={"Idempotency-Key": key})
            took = time.monotonic() - started
        finally:
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
        if not frozen:
            pytest.skip("the database's processes cannot be signalled from here")
        assert response.status_code == 503
        assert took < 2 * timeout, f"{took:.2f}s: the request waited out more than the one timeout"
        assert await flavour.store.inspect(tenant_of(), key) is None
        assert await flavour.effects(key) == 0


async def test_a_handler_that_never_finishes_its_response_frees_the_key_once(
    flavour: Flavour, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The transaction rolls back and the key is released as the rollback settles; answering the error that follows
    must not release it a second time (a round trip for nothing)."""
    releases: list[str] = []
    release = flavour.store.release

    async def counted(tenant: str, key: str, fence: int) -> bool:
        releases.append(key)
        return await release(tenant, key, fence)

    monkeypatch.setattr(flavour.store, "release", counted)

    async def start_only(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 201, "headers": []})

    app = IdempotencyMiddleware(start_only, store=flavour.store, transactional=True)
    with pytest.raises(RuntimeError, match="without finishing its response"):
        await client_for(app).post("/write", headers={"Idempotency-Key": key})
    assert releases == [key]
    assert await flavour.store.inspect(tenant_of(), key) is None


# -- background tasks and files: the answer is settled before anything runs after it -----------------------------

TENANT = "tenant-settle"


def fixed_tenant(scope: Scope) -> str:
    return TENANT


def background_app(flavour: Flavour, background: Background, events: list[Event]) -> Starlette:
    async def charge(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        assert context.key is not None
        await flavour.write(request, context.key, "charge")
        return JSONResponse({"charged": True}, status_code=201, background=BackgroundTask(background))

    app = Starlette(routes=[Route("/charge", charge, methods=["POST"])])
    app.add_middleware(
        IdempotencyMiddleware, store=flavour.store, tenant=fixed_tenant, transactional=True, on_event=events.append
    )
    return app


async def test_transactional_commit_and_answer_come_before_background_tasks(flavour: Flavour) -> None:
    key = str(uuid.uuid4())
    background = Background()
    events: list[Event] = []
    call = Call(background_app(flavour, background, events), "/charge", key)
    await asyncio.wait_for(background.started.wait(), 5)
    assert call.finished.is_set()  # the client has its answer while the background task runs
    assert call.status == 201
    assert await flavour.effects(key) == 1  # committed, visible to others
    info = await flavour.store.inspect(TENANT, key)
    assert info is not None
    assert info.state == "completed"
    assert [e.outcome for e in events] == [Outcome.EXECUTED]
    background.go.set()
    await asyncio.wait_for(call.task, 5)


async def test_transactional_background_failure_never_undoes_the_effect(flavour: Flavour) -> None:
    key = str(uuid.uuid4())
    background = Background()
    events: list[Event] = []
    background.fail = True
    background.go.set()
    app = background_app(flavour, background, events)
    call = Call(app, "/charge", key)
    with pytest.raises(RuntimeError, match="background task failed"):
        await asyncio.wait_for(call.task, 5)
    assert call.status == 201  # the client got the real answer, not a 500
    assert await flavour.effects(key) == 1
    assert [e.outcome for e in events] == [Outcome.EXECUTED]
    retry = await client_for(app).post("/charge", json={}, headers={"Idempotency-Key": key})
    assert retry.headers["idempotent-replayed"] == "true"
    assert await flavour.effects(key) == 1


async def test_transactional_pathsend_file_response_commits_and_replays(flavour: Flavour, tmp_path: Path) -> None:
    path = tmp_path / "receipt.pdf"
    path.write_bytes(b"%PDF-1.7 receipt" * 100)
    key = str(uuid.uuid4())

    async def receipt(request: Request) -> Response:
        await flavour.write(request, key, "receipt")
        return FileResponse(path, media_type="application/pdf")

    app = Starlette(routes=[Route("/receipt", receipt, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=flavour.store, tenant=fixed_tenant, transactional=True)
    first = Call(app, "/receipt", key, extensions={"http.response.pathsend": {}})
    await asyncio.wait_for(first.task, 5)
    assert first.status == 200
    assert first.body == path.read_bytes()
    again = Call(app, "/receipt", key, extensions={"http.response.pathsend": {}})
    await asyncio.wait_for(again.task, 5)
    assert again.body == path.read_bytes()
    assert await flavour.effects(key) == 1


# -- without a flavour ------------------------------------------------------------------------------------------


def test_transactional_mode_needs_a_database_store() -> None:
    with pytest.raises(TypeError, match="PostgresStore"):
        IdempotencyMiddleware(Starlette(), MemoryStore(), transactional=True)


async def test_database_down_is_503(key: str) -> None:
    async def never(request: Request) -> Response:
        raise AssertionError("the handler ran without its transaction")

    app = Starlette(routes=[Route("/write", never, methods=["POST"])])
    app.add_middleware(
        IdempotencyMiddleware,
        store=PostgresStore("postgresql://nobody@127.0.0.1:1/none", timeout=0.5),
        transactional=True,
    )
    response = await client_for(app).post("/write", headers={"Idempotency-Key": key})
    assert response.status_code == 503
