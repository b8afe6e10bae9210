"""A request cancelled, or its client gone, at the worst moment: while the transaction's answer is held, while its
rollback settles, while its claim is on the wire. Whatever the moment, the key ends settled (released, or
recorded with the effect that committed), and nothing the app runs after its response runs for an effect that did
not happen."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message

from idempotency_mw import (
    IdempotencyMiddleware,
    PostgresStore,
    idempotency_context,
)
from idempotency_mw._events import Event, Outcome
from idempotency_mw.store import Claim, Transaction
from tests.calls import hanging_up_client, ignore
from tests.conftest import http_scope, opened

TENANT = "tenant-cancelled"


def fixed_tenant(scope: Any) -> str:
    return TENANT


@pytest.fixture
async def db(idempotency_database_url: str) -> AsyncIterator[asyncpg.Connection]:
    connection = await asyncpg.connect(idempotency_database_url)
    await connection.execute("CREATE TABLE IF NOT EXISTS cancelled_effects (key text)")
    yield connection
    await connection.close()


async def effects(db: asyncpg.Connection, key: str) -> int:
    return int(await db.fetchval("SELECT count(*) FROM cancelled_effects WHERE key = $1", key))


async def test_transactional_background_task_never_runs_for_a_rolled_back_effect(
    pg_store: PostgresStore, db: asyncpg.Connection
) -> None:
    """docs/design.md §6: when the transaction did not commit, nothing the app runs after its response runs for an
    effect that did not happen ("Background tasks run after the commit").

    Under uvicorn (ASGI spec 2.3) Starlette's StreamingResponse listens for ``http.disconnect`` while it streams; in
    transactional mode its response is held until the commit. A client that hangs up mid-stream (a read timeout:
    it has seen nothing yet) makes the response cancel its own stream, and the transaction then rolls back. Its
    background task (a receipt e-mail, a webhook) must not have run for the charge that rolled back: receipts equal
    committed effects."""
    key = str(uuid.uuid4())
    hang_up = asyncio.Event()
    receipts: list[str] = []

    async def charge(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        assert context.connection is not None
        await context.connection.execute("INSERT INTO cancelled_effects VALUES ($1)", key)

        async def body() -> AsyncIterator[bytes]:
            yield b'{"charged": '
            hang_up.set()  # the client gives up while the (held) response is still being produced
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.Event().wait(), 1)
            yield b"true}"

        return StreamingResponse(
            body(), status_code=201, media_type="application/json", background=BackgroundTask(receipts.append, key)
        )

    app = Starlette(routes=[Route("/charges", charge, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=pg_store, tenant=fixed_tenant, transactional=True)
    await asyncio.gather(
        asyncio.wait_for(app(http_scope("/charges", key), hanging_up_client(hang_up), ignore), 10),
        return_exceptions=True,  # the middleware raises "returned without finishing its response": fine
    )
    assert len(receipts) == await effects(db, key), "a background task ran for an effect that was rolled back"


class PausingRollbackStore(PostgresStore):
    """A PostgresStore whose transactions pause at the start of their rollback until ``resume`` is set."""

    def __init__(self, dsn: str) -> None:
        super().__init__(dsn)
        self.rolling_back = asyncio.Event()
        self.resume = asyncio.Event()

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Transaction]:
        async with super().transaction() as transaction:
            rollback = transaction.rollback

            async def paused_rollback() -> None:
                self.rolling_back.set()
                await self.resume.wait()
                await rollback()

            transaction.rollback = paused_rollback  # type: ignore[method-assign]
            yield transaction


async def test_transient_answer_cancelled_while_settling_releases_the_key(idempotency_database_url: str) -> None:
    """A transactional handler streams a transient answer (503); as its final body message is settled (the rollback
    runs), the client hangs up, and Starlette's StreamingResponse (ASGI spec 2.3, uvicorn) cancels its own stream
    task, which is waiting for the settlement; the app then returns normally. The rollback still settles the
    request: the key is released (no record), so a retry runs at once rather than get 409 until the lease lapses,
    and the one event says ``released``, not ``store_error`` for a store that never failed."""
    key = str(uuid.uuid4())
    events: list[Event] = []
    async with opened(PausingRollbackStore(idempotency_database_url)) as store:
        assert isinstance(store, PausingRollbackStore)

        async def unavailable(request: Request) -> Response:
            async def body() -> AsyncIterator[bytes]:
                yield b'{"error": "try again"}'

            return StreamingResponse(body(), status_code=503, media_type="application/json")

        inner = Starlette(routes=[Route("/charges", unavailable, methods=["POST"])])

        async def app(scope: Any, receive: Any, send: Any) -> None:
            await inner(scope, receive, send)
            store.resume.set()  # the rollback finishes once the app has returned

        middleware = IdempotencyMiddleware(
            app, store=store, tenant=fixed_tenant, transactional=True, on_event=events.append
        )
        await asyncio.wait_for(
            middleware(http_scope("/charges", key), hanging_up_client(store.rolling_back), ignore), 10
        )
        record = await store.inspect(TENANT, key)
        assert ([event.outcome for event in events], record and record.state) == ([Outcome.RELEASED], None)


class ClaimLandsThenStallsStore(PostgresStore):
    """A PostgresStore whose claims land in the database and whose caller is then held before it reads the answer:
    the window between the server running the claim and the client reading its reply."""

    def __init__(self, dsn: str) -> None:
        super().__init__(dsn)
        self.landed = asyncio.Event()
        self.reply = asyncio.Event()

    async def claim(
        self,
        tenant: str,
        key: str,
        fingerprint: bytes,
        *,
        lease: float,
        ttl: float,
        matching: tuple[bytes, ...] = (),
        request: str | None = None,
        parts: bytes | None = None,
    ) -> Claim:
        claim = await super().claim(
            tenant, key, fingerprint, lease=lease, ttl=ttl, matching=matching, request=request, parts=parts
        )
        self.landed.set()
        await self.reply.wait()  # the reply is still on its way when the request is cancelled
        return claim


async def test_request_cancelled_during_its_claim_releases_the_key(idempotency_database_url: str) -> None:
    """docs/design.md §2.6: "a request cancelled before its response started is released". Cancelled while its
    claim is on the wire (the server cancels it at shutdown or because the client hung up; an outer timeout), the
    request still gets the claim's answer (the claim is awaited through the cancellation, as settling is), and a
    claim that turns out to be its own is released: the key is not left in progress under a fence nobody holds
    (409 to every retry until the lease lapses), the handler never ran, and the event does not report a store
    error for a store that never failed."""
    key = str(uuid.uuid4())
    events: list[Event] = []
    handler_runs: list[str] = []

    async def charge(request: Request) -> Response:
        handler_runs.append(key)
        return JSONResponse({"charged": True}, status_code=201)

    async with opened(ClaimLandsThenStallsStore(idempotency_database_url)) as store:
        assert isinstance(store, ClaimLandsThenStallsStore)
        app = Starlette(routes=[Route("/charges", charge, methods=["POST"])])
        app.add_middleware(IdempotencyMiddleware, store=store, tenant=fixed_tenant, on_event=events.append)
        never = asyncio.Event()
        request = asyncio.create_task(app(http_scope("/charges", key), hanging_up_client(never), ignore))
        await asyncio.wait_for(store.landed.wait(), 10)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        store.reply.set()  # the answer arrives after all
        for _ in range(50):  # a release that goes on after the cancellation has time to land
            record = await store.inspect(TENANT, key)
            if record is None:
                break
            await asyncio.sleep(0.02)
        assert handler_runs == []
        assert record is None, f"the key was left {record.state} under a fence nobody holds"
        assert Outcome.STORE_ERROR not in [event.outcome for event in events]


class TransactionalClaimLandsThenStalls(PostgresStore):
    """The same window for a transactional request, whose claim runs on the connection its transaction then uses."""

    def __init__(self, dsn: str) -> None:
        super().__init__(dsn, min_size=0, max_size=2, timeout=1.0)
        self.landed = asyncio.Event()
        self.reply = asyncio.Event()
        claim = self._records.claim

        async def stalling(*args: Any, **kwargs: Any) -> Claim:  # every claim of the store's, its transactions' too
            claimed = await claim(*args, **kwargs)
            if not self.landed.is_set():
                self.landed.set()
                await self.reply.wait()
            return claimed

        self._records.claim = stalling  # type: ignore[method-assign]


async def test_a_transactional_request_cancelled_during_its_claim_gives_its_connection_back(
    idempotency_database_url: str,
) -> None:
    """Cancelled while its claim is on the wire, a transactional request whose claim then lands releases the key and
    gives back the connection the claim ran on, before its outcome is reported: not whenever the garbage collector
    gets to the run. The next request, on a pool with one connection for claims and lent transactions, gets it."""
    key = str(uuid.uuid4())
    runs: list[str] = []
    idle_when_reported: list[int] = []

    async def charge(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        assert context.connection is not None
        await context.connection.execute("SELECT 1")
        runs.append(context.key or "")
        return JSONResponse({"charged": True}, status_code=201)

    async with opened(TransactionalClaimLandsThenStalls(idempotency_database_url)) as store:
        assert isinstance(store, TransactionalClaimLandsThenStalls)

        def reported(event: Event) -> None:
            idle_when_reported.append(store._connector.pool.idle)  # type: ignore[attr-defined]

        app = Starlette(routes=[Route("/charges", charge, methods=["POST"])])
        app.add_middleware(
            IdempotencyMiddleware, store=store, tenant=fixed_tenant, transactional=True, on_event=reported
        )
        request = asyncio.create_task(app(http_scope("/charges", key), hanging_up_client(asyncio.Event()), ignore))
        await asyncio.wait_for(store.landed.wait(), 10)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        store.reply.set()
        for _ in range(50):
            if idle_when_reported:
                break
            await asyncio.sleep(0.02)
        assert await store.inspect(TENANT, key) is None
        assert idle_when_reported == [2], "the outcome was reported with the claim's connection still out"
        sent: list[Message] = []

        async def collect(message: Message) -> None:
            sent.append(message)

        await app(http_scope("/charges", key + "-next"), hanging_up_client(asyncio.Event()), collect)
        assert sent[0]["status"] == 201, f"no connection for the next request: {sent}"
        assert runs == [key + "-next"]
