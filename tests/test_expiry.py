"""Idempotency-Expires: a recorded answer, live or replayed, says until when a retry with its key gets it again; on
both stores and in both modes, never later than the record's real expiry, and never part of what is stored."""

from __future__ import annotations

import asyncio
import email.utils
import uuid
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Scope

from idempotency_mw import IdempotencyMiddleware, MemoryStore, StoredResponse
from idempotency_mw._channels import http_date
from idempotency_mw.store import Store
from tests.conftest import client_for, tenant_of
from tests.test_memory import Clock


def expires(response: httpx.Response) -> float:
    value = response.headers["idempotency-expires"]
    assert len(value) == 29  # IMF-fixdate: "Sun, 06 Nov 1994 08:49:37 GMT"
    assert value.endswith(" GMT")
    return email.utils.parsedate_to_datetime(value).timestamp()


def build(store: Store, transactional: bool, **options: Any) -> Starlette:
    async def order(request: Request) -> Response:
        status = int(request.query_params.get("status", "201"))
        if request.query_params.get("stream"):
            return StreamingResponse(iter([b"first,", b"second"]), status_code=status)
        return JSONResponse({"id": "or_" + uuid.uuid4().hex}, status_code=status)

    app = Starlette(routes=[Route("/orders", order, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=transactional, **options)
    return app


async def test_a_recorded_answer_says_until_when_its_key_holds(store_and_mode: tuple[Store, bool]) -> None:
    store, transactional = store_and_mode
    key = str(uuid.uuid4())
    async with client_for(build(store, transactional)) as client:
        first = await client.post("/orders", headers={"Idempotency-Key": key})
        again = await client.post("/orders", headers={"Idempotency-Key": key})
    record = await store.inspect(tenant_of(), key)
    assert record is not None
    assert record.response is not None
    assert first.status_code == again.status_code == 201
    assert expires(first) == int(record.expires_at) <= record.expires_at  # never later than the record's
    assert again.headers["idempotency-expires"] == first.headers["idempotency-expires"]
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert all(name != b"idempotency-expires" for name, _ in record.response.headers)  # not stored
    # A replay is the first answer as it went out, plus Idempotent-Replayed: true.
    assert list(again.headers.raw) == [*first.headers.raw, (b"idempotent-replayed", b"true")]


@pytest.mark.parametrize("status", [402, 409])
async def test_a_recorded_error_says_it_too(store_and_mode: tuple[Store, bool], status: int) -> None:
    store, transactional = store_and_mode
    key = str(uuid.uuid4())
    async with client_for(build(store, transactional)) as client:
        declined = await client.post(f"/orders?status={status}", headers={"Idempotency-Key": key})
    record = await store.inspect(tenant_of(), key)
    assert record is not None
    assert (declined.status_code, expires(declined)) == (status, int(record.expires_at))


@pytest.mark.parametrize("status", [502, 429, 401])
async def test_an_answer_that_releases_the_key_says_nothing(store_and_mode: tuple[Store, bool], status: int) -> None:
    store, transactional = store_and_mode
    key = str(uuid.uuid4())
    async with client_for(build(store, transactional)) as client:
        released = await client.post(f"/orders?status={status}", headers={"Idempotency-Key": key})
        keyless = await client.post("/orders")
    assert released.status_code == status
    assert "idempotency-expires" not in released.headers
    assert await store.inspect(tenant_of(), key) is None
    assert "idempotency-expires" not in keyless.headers  # nothing recorded without a key


async def test_a_streamed_answer_says_it_as_it_starts(store_and_mode: tuple[Store, bool]) -> None:
    store, transactional = store_and_mode
    key = str(uuid.uuid4())
    async with client_for(build(store, transactional)) as client:
        streamed = await client.post("/orders?stream=1", headers={"Idempotency-Key": key})
        again = await client.post("/orders?stream=1", headers={"Idempotency-Key": key})
    record = await store.inspect(tenant_of(), key)
    assert record is not None
    assert streamed.content == again.content == b"first,second"
    assert expires(streamed) == expires(again) == int(record.expires_at)


async def test_a_replay_hooks_answer_keeps_the_records_expiry(store_and_mode: tuple[Store, bool]) -> None:
    """on_replay sees the response as stored (without the header) and may replace it; what it returns goes out with
    the record's expiry and the replay marker, which are the record's, not the response's."""
    store, transactional = store_and_mode
    seen: list[StoredResponse] = []

    def hook(scope: Scope, response: StoredResponse) -> StoredResponse:
        seen.append(response)
        return StoredResponse(200, [(b"content-type", b"text/plain")], b"replaced", 8)

    key = str(uuid.uuid4())
    async with client_for(build(store, transactional, on_replay=hook)) as client:
        first = await client.post("/orders", headers={"Idempotency-Key": key})
        again = await client.post("/orders", headers={"Idempotency-Key": key})
    assert all(name != b"idempotency-expires" for name, _ in seen[0].headers)
    assert (again.status_code, again.content) == (200, b"replaced")
    assert again.headers.raw[-2:] == [
        (b"idempotency-expires", first.headers["idempotency-expires"].encode()),
        (b"idempotent-replayed", b"true"),
    ]


async def test_a_lease_taken_over_says_the_records_first_expiry() -> None:
    """A retry that takes over a lapsed lease inherits the record's expiry, not a new ttl from its own claim: the
    header must not promise the key for longer than the record lives. The request it took over from is fenced out
    when it finishes: its answer is not recorded, and says nothing."""
    clock = Clock()
    store = MemoryStore(clock=clock)
    entered, go = asyncio.Event(), asyncio.Event()

    async def order(request: Request) -> Response:
        if not entered.is_set():
            entered.set()
            await go.wait()  # a worker that stalls past its lease
        return JSONResponse({"id": "or_1"}, status_code=201)

    app = Starlette(routes=[Route("/orders", order, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, ttl=60, lease=10)
    key = str(uuid.uuid4())
    async with client_for(app) as client:
        stalled = asyncio.create_task(client.post("/orders", headers={"Idempotency-Key": key}))
        await entered.wait()
        clock.now += 55  # the lease (10 s) lapsed; the record still expires at +60
        retry = await client.post("/orders", headers={"Idempotency-Key": key})
        go.set()
        fenced_out = await stalled
    record = await store.inspect(tenant_of(), key)
    assert record is not None
    assert record.expires_at == 1065.0  # moved past the new lease (+55 + 10), not to +55 + 60
    assert (retry.status_code, expires(retry)) == (201, 1065)
    assert fenced_out.status_code == 201
    assert "idempotency-expires" not in fenced_out.headers


def test_an_http_date_is_an_imf_fixdate_rounded_down() -> None:
    assert http_date(784111777.9) == b"Sun, 06 Nov 1994 08:49:37 GMT"
    assert http_date(0) == b"Thu, 01 Jan 1970 00:00:00 GMT"
    assert http_date(1709251199.5) == b"Thu, 29 Feb 2024 23:59:59 GMT"
    when = 1_900_000_000.25
    assert email.utils.parsedate_to_datetime(http_date(when).decode()).timestamp() == 1_900_000_000
