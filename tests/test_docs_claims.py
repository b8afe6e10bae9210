"""Claims made in docs/failure-modes.md and docs/semantics.md that no other test pins down.

Several of these pin *limits* on purpose (what can still run twice outside transactional mode), so the docs cannot
drift into promising more than the code does. Failures are injected by subclassing the real PostgresStore; every
statement that does run goes to the real database.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idempotency_mw import IdempotencyMiddleware, PostgresStore, StoredResponse
from idempotency_mw._context import mark_not_executed
from idempotency_mw._events import Event, Outcome
from tests.apps import Probe, build_app
from tests.conftest import client_for, http_scope, tenant_of

ALICE = tenant_of()  # the default tenant of tests.conftest.client_for


class CompleteFails(PostgresStore):
    """The database goes away between the handler's effect and the record of its response."""

    async def complete(self, *args: Any, **kwargs: Any) -> bool:
        raise OSError("connection lost before the completion was written")


class RenewFails(PostgresStore):
    """This worker cannot renew its lease (a partition between it and the database)."""

    async def renew(self, *args: Any, **kwargs: Any) -> bool:
        raise OSError("connection lost while renewing the lease")


async def _until(condition: Any, seconds: float = 5.0) -> None:
    for _ in range(int(seconds / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def test_plain_mode_window_a_lost_completion_runs_again_after_the_lease(
    idempotency_database_url: str, key: str
) -> None:
    """failure-modes.md, "the seen-set window": outside transactional mode, an effect whose record was never
    written is repeated once the lease lapses. Until then, retries get 409."""
    events: list[Event] = []
    async with CompleteFails(idempotency_database_url) as store:
        probe = Probe()
        client = client_for(build_app(store, probe, lease=1.0, on_event=events.append))
        first = await client.post("/charge", content=b"a", headers={"Idempotency-Key": key})
        assert first.status_code == 201  # the client has its answer...
        assert events[-1].outcome is Outcome.STORE_ERROR  # ...but the record stayed in progress
        soon = await client.post("/charge", content=b"a", headers={"Idempotency-Key": key})
        assert soon.status_code == 409
        await asyncio.sleep(1.2)
        late = await client.post("/charge", content=b"a", headers={"Idempotency-Key": key})
        assert late.status_code == 201
        assert "idempotent-replayed" not in late.headers
        assert probe.calls["charge"] == 2  # the duplicate transactional mode exists to prevent


async def test_plain_mode_zombie_is_fenced_out_of_the_record_but_its_effect_ran(
    idempotency_database_url: str, key: str
) -> None:
    """failure-modes.md, "zombie workers": the fence keeps a stale worker from writing the record; outside
    transactional mode it cannot undo what the stale handler already did."""
    events: list[Event] = []
    async with RenewFails(idempotency_database_url) as store:
        probe = Probe()
        client = client_for(build_app(store, probe, lease=0.3, on_event=events.append))
        probe.hold()
        zombie = asyncio.create_task(client.post("/charge", content=b"a", headers={"Idempotency-Key": key}))
        await asyncio.wait_for(probe.entered.wait(), 5)
        await asyncio.sleep(0.5)  # the lease lapses: its renewals failed
        takeover = asyncio.create_task(client.post("/charge", content=b"a", headers={"Idempotency-Key": key}))
        await _until(lambda: probe.calls["charge"] == 2)
        probe.release.set()
        responses = await asyncio.gather(zombie, takeover)
        assert [r.status_code for r in responses] == [201, 201]
        assert probe.calls["charge"] == 2
        assert sorted(e.outcome.value for e in events) == ["executed", "fenced_out"]
        info = await store.inspect(ALICE, key)
        assert info is not None
        assert info.state == "completed"  # by the newer claim: the zombie's completion was refused


async def _call(app: Starlette, key: str, send: Any, *, path: str = "/charge", body: bytes = b"a") -> None:
    """One raw ASGI request whose client never disconnects, so the test controls what ``send`` does."""
    scope = http_scope(path, key, headers=[(b"authorization", b"Bearer sk_test_alice")])  # as client_for sends it
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client stays connected
        raise AssertionError

    await asyncio.wait_for(app(scope, receive, send), 10)


async def test_plain_mode_a_send_that_is_dropped_keeps_the_record(pg_store: PostgresStore, key: str) -> None:
    """failure-modes.md, "lost responses": a server that drops writes to a gone client (uvicorn does) lets the
    handler finish, so the response is recorded and the retry is a replay."""
    probe = Probe()
    app = build_app(pg_store, probe)

    async def dropped(message: dict[str, Any]) -> None:
        return None

    await _call(app, key, dropped)
    retry = await client_for(app).post("/charge", content=b"a", headers={"Idempotency-Key": key})
    assert retry.headers["idempotent-replayed"] == "true"
    assert probe.calls["charge"] == 1


async def test_mark_not_executed_releases_a_starlette_validation_error(pg_store: PostgresStore, key: str) -> None:
    """semantics.md, "released": an app's own 422 is final unless the handler marks it as not executed."""
    runs: list[str] = []

    async def create(request: Request) -> Response:
        body = await request.body()
        runs.append(body.decode())
        if body != b"good":
            if request.query_params.get("mark"):
                mark_not_executed(request)
            return JSONResponse({"error": "invalid"}, status_code=422)
        return JSONResponse({"ok": True}, status_code=201)

    app = Starlette(routes=[Route("/create", create, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=pg_store)
    client = client_for(app)
    unmarked = {"Idempotency-Key": "unmarked-" + key}
    assert (await client.post("/create", content=b"bad", headers=unmarked)).status_code == 422
    corrected = await client.post("/create", content=b"good", headers=unmarked)
    assert corrected.status_code == 422  # recorded: the corrected body is a different request under that key
    assert corrected.json()["code"] == "idempotency_key_reused"
    marked = {"Idempotency-Key": "marked-" + key}
    assert (await client.post("/create?mark=1", content=b"bad", headers=marked)).status_code == 422
    assert (await client.post("/create?mark=1", content=b"good", headers=marked)).status_code == 201
    assert runs == ["bad", "bad", "good"]


async def test_replay_sends_the_body_in_one_message(pg_store: PostgresStore, key: str) -> None:
    """semantics.md, "replay fidelity": the bytes are identical, the chunk boundaries of a stream are not kept."""
    app = build_app(pg_store, Probe())
    live: list[bytes] = []
    replayed: list[bytes] = []
    for bodies in (live, replayed):
        await _call(app, key, _collect_body(bodies), path="/stream")
    assert live == [b"first,", b"second,", b"third"]
    assert replayed == [b"first,second,third"]


def _collect_body(bodies: list[bytes]) -> Any:
    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            bodies.append(message["body"])

    return send


async def test_stored_response_keeps_the_original_date_and_cookies(pg_store: PostgresStore, key: str) -> None:
    """semantics.md, "what is stored": every header is stored as first sent, Set-Cookie and Date included."""
    headers = [(b"date", b"Mon, 01 Jan 2024 00:00:00 GMT"), (b"set-cookie", b"s=1"), (b"x-request-id", b"r1")]
    claim = await pg_store.claim("docs", key, b"f" * 32, lease=60, ttl=600)
    assert await pg_store.complete("docs", key, claim.fence, StoredResponse(201, headers, b"{}", 2))
    again = await pg_store.claim("docs", key, b"f" * 32, lease=60, ttl=600)
    assert again.response is not None
    assert again.response.headers == headers


async def test_under_a_real_server_the_apps_headers_replay_and_the_servers_own_are_fresh(
    pg_store: PostgresStore, key: str
) -> None:
    """semantics.md, "what is stored": the header list the *app* sent is replayed byte for byte, a Date the app set
    included; the headers the server adds itself (uvicorn: date, server) are not the app's, are not stored, and come
    fresh with the replay."""
    import httpx

    from faults.server import serve

    async def receipt(request: Request) -> Response:
        response = JSONResponse({"id": "rc_1"}, status_code=201)
        response.headers["x-request-id"] = "req_original"
        response.headers["last-modified"] = "Mon, 01 Jan 2024 00:00:00 GMT"
        return response

    app = Starlette(routes=[Route("/receipts", receipt, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=pg_store, tenant=lambda scope: "docs-server")
    async with serve(app) as url, httpx.AsyncClient(base_url=url) as client:
        first = await client.post("/receipts", headers={"Idempotency-Key": key})
        await asyncio.sleep(1.1)  # the server's Date has one-second resolution
        again = await client.post("/receipts", headers={"Idempotency-Key": key})
    assert again.headers["idempotent-replayed"] == "true"
    app_headers = ("content-length", "content-type", "x-request-id", "last-modified")
    assert [again.headers[name] for name in app_headers] == [first.headers[name] for name in app_headers]
    assert again.headers["server"] == first.headers["server"] == "uvicorn"  # added by the server, both times
    assert again.headers["date"] != first.headers["date"]  # the server's own clock, at the replay
    stored = await pg_store.inspect("docs-server", key)
    assert stored is not None
    assert stored.response is not None
    assert {name for name, _ in stored.response.headers} == {
        b"content-length",
        b"content-type",
        b"x-request-id",
        b"last-modified",
    }
