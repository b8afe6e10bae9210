"""A request cancelled (a client gone, an outer timeout, a server shutting down) at each await of its way through the
store leaves no key in progress behind it, and gives back the connection it took; its outcome is reported once."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message

import idempotency_mw
from idempotency_mw import Event, IdempotencyMiddleware, MemoryStore, Outcome, PostgresStore, Store
from idempotency_mw._keys import TenantFromApp
from idempotency_mw.postgres import _lending
from idempotency_mw.postgres._pool import OwnPool
from idempotency_mw.store import Claim, StoreUnavailable
from tests.conftest import http_scope
from tests.test_cycles import app_on as cycles_app_on
from tests.test_cycles import call as call_once
from tests.test_cycles import left_to_the_collector, warmed_up

TENANT = "tenant-cancellation"
BODY = b'{"amount": 1250}'


def app_on(store: Store, events: list[Event], *, from_app: bool = False, **options: Any) -> Starlette:
    """The app, its events in ``events``; ``from_app``: it tells the tenant itself (``idempotency_mw.claim``)."""

    async def charge(request: Request) -> Response:
        await request.body()
        if from_app:
            await idempotency_mw.claim(request, TENANT)
        return JSONResponse({"ok": True}, status_code=201)

    async def unavailable(request: Request) -> Response:
        await request.body()
        return JSONResponse({"error": "upstream down"}, status_code=503)  # transient: the key is released

    app = Starlette(
        routes=[Route("/charge", charge, methods=["POST"]), Route("/unavailable", unavailable, methods=["POST"])]
    )
    tenant = TenantFromApp() if from_app else lambda scope: TENANT
    app.add_middleware(IdempotencyMiddleware, store=store, tenant=tenant, on_event=events.append, **options)
    return app


async def call(app: Starlette, key: str, path: str = "/charge") -> int:
    """One raw ASGI request; its status."""
    statuses: list[int] = []

    async def receive() -> Message:
        await asyncio.sleep(0)  # as a server's: the body comes in a later turn of the loop
        return {"type": "http.request", "body": BODY, "more_body": False}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    await app(http_scope(path, key), receive, send)
    return statuses[0]


def lent(store: PostgresStore) -> int:
    """The connections of the store's pool that are out (lent, or being opened)."""
    connector = store.connector
    assert isinstance(connector, OwnPool)
    return connector.pool.size - connector.pool.idle


async def released(store: PostgresStore, key: str) -> None:
    """Wait for the key to be released (in a task of its own, which outlasts the request), then for every connection
    to be back."""
    for _ in range(100):
        if await store.inspect(TENANT, key) is None and lent(store) == 0:
            break
        await asyncio.sleep(0.02)
    assert await store.inspect(TENANT, key) is None
    assert lent(store) == 0


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
    await released(opened_store, key)
    assert [event.outcome for event in events] == [Outcome.RELEASED]
    assert await call(app, key) == 201  # the retry runs


async def test_a_claim_abandoned_in_the_app_keeps_its_connection_until_it_ends(
    opened_store: PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The app tells the tenant (``idempotency_mw.claim``) on a transactional route, and the request is cancelled
    while the claim is on its way on the request's connection: that connection goes back once the claim has ended,
    and the claim, which landed, is released. The run gave it back under the claim, which then failed (the
    connection closed in the middle of its statement): nothing was released, the key was left to its lease, and the
    event said store_error."""
    events: list[Event] = []
    app = app_on(opened_store, events, from_app=True, transactional=True, lease=3)
    for _ in range(3):  # warmed up: the routes read, the pool's connections prepared
        await call(app, str(uuid.uuid4()))
    events.clear()
    claim = _lending.PostgresTransaction.claim
    give_back = OwnPool.give_back
    request: asyncio.Task[int] | None = None
    claiming = 0
    given_back_under_a_claim = 0

    async def cancelled_as_it_claims(transaction: _lending.PostgresTransaction, *args: Any, **kwargs: Any) -> Any:
        nonlocal claiming
        assert request is not None
        asyncio.get_running_loop().call_soon(request.cancel)  # while the claim is on its way
        claiming += 1
        try:
            return await claim(transaction, *args, **kwargs)
        finally:
            claiming -= 1

    async def counted_give_back(lending: Any, *args: Any, **kwargs: Any) -> None:
        nonlocal given_back_under_a_claim
        given_back_under_a_claim += claiming
        await give_back(lending, *args, **kwargs)

    monkeypatch.setattr(_lending.PostgresTransaction, "claim", cancelled_as_it_claims)
    monkeypatch.setattr(OwnPool, "give_back", counted_give_back)
    key = str(uuid.uuid4())
    request = asyncio.create_task(call(app, key))
    with pytest.raises(asyncio.CancelledError):
        await request
    await released(opened_store, key)
    monkeypatch.undo()
    assert given_back_under_a_claim == 0
    assert [event.outcome for event in events] == [Outcome.RELEASED]
    assert await call(app, key) == 201  # the retry runs


async def test_a_request_cancelled_as_its_key_is_released_releases_it_once(
    opened_store: PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transient answer on a transactional route (503: the key is released), and the request cancelled while that
    release is on its way: the release goes on, once, and the event says how it ended. The settlement was asked
    again after the cancellation, which released the key a second time and reported what that one found (released,
    or fenced_out when the first had landed)."""
    events: list[Event] = []
    app = app_on(opened_store, events, transactional=True)
    await call(app, str(uuid.uuid4()))  # warmed up: the routes read, a connection prepared
    events.clear()
    release = opened_store.release
    request: asyncio.Task[int] | None = None
    fences: list[int] = []

    async def cancelled_as_it_releases(tenant: str, key: str, fence: int) -> bool:
        assert request is not None
        fences.append(fence)
        if len(fences) == 1:
            asyncio.get_running_loop().call_soon(request.cancel)  # while the release is on its way
        return await release(tenant, key, fence)

    monkeypatch.setattr(opened_store, "release", cancelled_as_it_releases)
    key = str(uuid.uuid4())
    request = asyncio.create_task(call(app, key, "/unavailable"))
    with pytest.raises(asyncio.CancelledError):
        await request
    await released(opened_store, key)
    monkeypatch.undo()
    assert len(fences) == 1
    assert [event.outcome for event in events] == [Outcome.RELEASED]


class Down(MemoryStore):
    """A store whose claims fail, once ``down``: at once (``waits`` False: a pool closed, a database not migrated)
    or after a wait (a connection lost)."""

    down = False
    waits = False

    async def claim(self, *args: Any, **kwargs: Any) -> Claim:
        if self.down:
            if self.waits:
                await asyncio.sleep(0)
            raise StoreUnavailable("the database is down")
        return await super().claim(*args, **kwargs)


@pytest.mark.parametrize("options", [{}, {"fail_open": True}, {"observe": True}], ids=["503", "fail open", "observing"])
@pytest.mark.parametrize("waits", [False, True], ids=["at once", "after a wait"])
async def test_no_cycles_after_a_claim_that_failed(
    waits: bool, options: dict[str, bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim the store failed (503; or the handler run unprotected, or observed) leaves no reference cycle behind
    (``tests/test_cycles.py``). The claim's task held the error, whose traceback held the claim's frame, whose
    local held the task: the request and all it refers to waited for the cycle collector."""
    # The failure is logged with its traceback: a record that pytest keeps would keep the request alive instead.
    monkeypatch.setattr(logging.getLogger("idempotency_mw"), "disabled", True)
    store = Down()
    app = cycles_app_on(store, **options)
    await warmed_up(app)
    store.down, store.waits = True, waits

    async def failed() -> None:
        assert await call_once(app, "/charge", str(uuid.uuid4())) == (503 if not options else 201)
        await asyncio.sleep(0)  # the callbacks of the claim's task have run: what they held is let go

    assert await left_to_the_collector(failed) == Counter()
