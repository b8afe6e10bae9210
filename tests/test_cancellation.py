"""A request cancelled (a client gone, an outer timeout, a server shutting down) at each await of its way through the
store leaves no key in progress behind it, and gives back the connection it took; its outcome is reported once."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message

from idempotency_mw import Event, IdempotencyMiddleware, Outcome, PostgresStore, Store
from idempotency_mw.postgres import _lending
from idempotency_mw.postgres._pool import OwnPool
from tests.conftest import http_scope

TENANT = "tenant-cancellation"
BODY = b'{"amount": 1250}'


def app_on(store: Store, events: list[Event], **options: Any) -> Starlette:
    async def charge(request: Request) -> Response:
        await request.body()
        return JSONResponse({"ok": True}, status_code=201)

    app = Starlette(routes=[Route("/charge", charge, methods=["POST"])])
    app.add_middleware(
        IdempotencyMiddleware, store=store, tenant=lambda scope: TENANT, on_event=events.append, **options
    )
    return app


async def call(app: Starlette, key: str) -> int:
    """One raw ASGI request; its status."""
    statuses: list[int] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": BODY, "more_body": False}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    await app(http_scope("/charge", key), receive, send)
    return statuses[0]


def lent(store: PostgresStore) -> int:
    """The connections of the store's pool that are out (lent, or being opened)."""
    connector = store.connector
    assert isinstance(connector, OwnPool)
    return connector.pool.size - connector.pool.idle


@pytest.fixture
async def opened_store(idempotency_database_url: str) -> AsyncIterator[PostgresStore]:
    store = PostgresStore(idempotency_database_url, min_size=1, max_size=4)
    await store.open()
    try:
        yield store
    finally:
        await store.close(grace=0)


async def test_a_request_cancelled_as_its_transaction_begins_frees_its_key(
    opened_store: PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled while BEGIN is on its way (the claim landed, on the same connection): nothing ran, so the key is
    released and the connection given back, though the request is gone. The key was left in progress, its lease
    renewed for as long as the process lived, and every retry got 409."""
    events: list[Event] = []
    app = app_on(opened_store, events, transactional=True, lease=1.5)
    await call(app, str(uuid.uuid4()))  # warmed up: the routes read, a connection prepared
    events.clear()
    begin = _lending.PostgresTransaction.begin
    request: asyncio.Task[int] | None = None

    async def cancelled_as_it_begins(transaction: _lending.PostgresTransaction) -> None:
        assert request is not None
        asyncio.get_running_loop().call_soon(request.cancel)  # while BEGIN is on its way
        await begin(transaction)

    monkeypatch.setattr(_lending.PostgresTransaction, "begin", cancelled_as_it_begins)
    key = str(uuid.uuid4())
    request = asyncio.create_task(call(app, key))
    with pytest.raises(asyncio.CancelledError):
        await request
    monkeypatch.undo()
    for _ in range(100):  # the release goes on in a task of its own
        if await opened_store.inspect(TENANT, key) is None:
            break
        await asyncio.sleep(0.02)
    assert await opened_store.inspect(TENANT, key) is None
    assert lent(opened_store) == 0
    assert [event.outcome for event in events] == [Outcome.RELEASED]
    assert await call(app, key) == 201  # the retry runs
