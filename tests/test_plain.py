"""recording.py: in plain mode a request settles as the response's final body message passes, not when the app
callable returns.

Background tasks (Starlette's and FastAPI's ``BackgroundTasks``) run after the final body message, inside the app
callable. They must find the answer already settled: the record completed before they start, and their failure must
never change it. Settling must also survive a cancellation of the request. (The same promises in transactional mode,
where the transaction commits before the answer goes out: test_transaction.py. Responses sent from a file:
test_capture.py.)
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message

from idempotency_mw import IdempotencyMiddleware, MemoryStore, Store, StoredResponse
from idempotency_mw._events import Event, Outcome
from tests.apps import Background
from tests.calls import Call
from tests.conftest import client_for, http_scope

TENANT = "tenant-settle"


def fixed_tenant(scope: Any) -> str:
    return TENANT


def plain_app(store: Store, background: Background, events: list[Event], **options: Any) -> Starlette:
    async def charge(request: Request) -> Response:
        await request.body()
        return JSONResponse({"charged": True}, status_code=201, background=BackgroundTask(background))

    app = Starlette(routes=[Route("/charge", charge, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, tenant=fixed_tenant, on_event=events.append, **options)
    return app


async def test_plain_record_is_completed_before_background_tasks_run(store: Store) -> None:
    key = str(uuid.uuid4())
    background = Background()
    events: list[Event] = []
    app = plain_app(store, background, events)
    call = Call(app, "/charge", key)
    await asyncio.wait_for(background.started.wait(), 5)
    assert call.finished.is_set()
    info = await store.inspect(TENANT, key)
    assert info is not None
    assert info.state == "completed"  # while the background task still runs
    assert [e.outcome for e in events] == [Outcome.EXECUTED]
    retry = await client_for(app).post("/charge", json={}, headers={"Idempotency-Key": key})
    assert retry.headers["idempotent-replayed"] == "true"  # a replay, not 409 in progress
    background.go.set()
    await asyncio.wait_for(call.task, 5)


async def test_the_status_line_leaves_with_the_first_body_message(store: Store) -> None:
    """The response start waits for the message after it (as PEP 3333 asks of WSGI servers): status line, headers
    and a one-message body reach the server back to back, after the record is complete, so the server writes them
    together and wakes the client once instead of twice (benchmarks/README.md). A stream's start leaves with its
    first chunk."""
    first_chunk_made = asyncio.Event()

    async def stream(request: Request) -> Response:
        async def chunks() -> AsyncIterator[bytes]:
            first_chunk_made.set()
            yield b"first,"
            yield b"second"

        return StreamingResponse(chunks(), status_code=201)

    async def charge(request: Request) -> Response:
        return JSONResponse({"charged": True}, status_code=201)

    app = Starlette(routes=[Route("/charge", charge, methods=["POST"]), Route("/stream", stream, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, tenant=fixed_tenant)

    async def arrivals(path: str, key: str) -> list[tuple[str, bytes, str | None, bool]]:
        """Each message as the server gets it, with the record's state and whether the first chunk was made."""
        seen: list[tuple[str, bytes, str | None, bool]] = []

        async def send(message: Message) -> None:
            info = await store.inspect(TENANT, key)
            state = info.state if info is not None else None
            seen.append((message["type"], message.get("body", b""), state, first_chunk_made.is_set()))

        bodies = [{"type": "http.request", "body": b"{}", "more_body": False}]

        async def receive() -> Message:
            if bodies:
                return bodies.pop()
            await asyncio.Event().wait()  # the client stays
            raise AssertionError("unreachable")

        await app(http_scope(path, key), receive, send)
        return seen

    charged = await arrivals("/charge", str(uuid.uuid4()))
    assert [(kind, state) for kind, _, state, _ in charged] == [
        ("http.response.start", "completed"),  # not "in_progress": nothing left before the record was written
        ("http.response.body", "completed"),
    ]
    streamed = await arrivals("/stream", str(uuid.uuid4()))
    assert [(kind, body, made) for kind, body, _, made in streamed] == [
        ("http.response.start", b"", True),  # sent once the first chunk was there, with it
        ("http.response.body", b"first,", True),
        ("http.response.body", b"second", True),
        ("http.response.body", b"", True),
    ]


async def test_plain_background_failure_changes_nothing(store: Store) -> None:
    key = str(uuid.uuid4())
    background = Background()
    events: list[Event] = []
    background.fail = True
    background.go.set()
    app = plain_app(store, background, events)
    call = Call(app, "/charge", key)
    with pytest.raises(RuntimeError, match="background task failed"):
        await asyncio.wait_for(call.task, 5)
    assert call.status == 201
    assert [e.outcome for e in events] == [Outcome.EXECUTED]
    info = await store.inspect(TENANT, key)
    assert info is not None
    assert info.state == "completed"
    assert info.response is not None
    assert info.response.body == call.body


async def test_events_are_emitted_before_the_final_body_goes_out(store: Store) -> None:
    """Server-span instrumentations end their span when the last body message is sent: the event (and the span
    attributes set from it) must come before that, or it lands on a span that no longer records."""
    key = str(uuid.uuid4())
    order: list[str] = []
    background = Background()
    background.go.set()

    async def charge(request: Request) -> Response:
        return JSONResponse({"charged": True}, status_code=201)

    inner = Starlette(routes=[Route("/charge", charge, methods=["POST"])])
    inner.add_middleware(
        IdempotencyMiddleware, store=store, tenant=fixed_tenant, on_event=lambda e: order.append(e.outcome.value)
    )

    async def outer(scope: Any, receive: Any, send: Any) -> None:
        async def spy(message: Message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                order.append("final body")
            await send(message)

        await inner(scope, receive, spy)

    for _ in range(2):
        call = Call(outer, "/charge", key)
        await asyncio.wait_for(call.task, 5)
    assert order == ["executed", "final body", "replayed", "final body"]


class SlowCompleteStore(MemoryStore):
    """A store whose ``complete`` waits until the test lets it go: room to cancel the request meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.completing = asyncio.Event()
        self.go = asyncio.Event()

    async def complete(self, tenant: str, key: str, fence: int, response: StoredResponse) -> bool:
        self.completing.set()
        await self.go.wait()
        return await super().complete(tenant, key, fence, response)


async def test_cancellation_during_complete_still_completes() -> None:
    """Server shutdown or an outer timeout cancels the request while its record is being written: the record must
    still complete, or the key would sit in progress and the handler would run again once the lease lapsed."""
    store = SlowCompleteStore()
    key = str(uuid.uuid4())
    background = Background()
    events: list[Event] = []
    background.go.set()
    call = Call(plain_app(store, background, events), "/charge", key)
    await asyncio.wait_for(store.completing.wait(), 5)
    call.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call.task
    store.go.set()
    for _ in range(100):
        info = await store.inspect(TENANT, key)
        if info is not None and info.state == "completed":
            break
        await asyncio.sleep(0.01)
    assert info is not None
    assert info.state == "completed"
