"""capture.py: the recorder copies a response as it passes and the replay sends it back unchanged (status, the
header list with its order and repeats, the body bytes), whatever shape the app's messages take: chunks that are
views of a reused buffer, headers from a generator, a file sent by path, trailers, a test client's debug message.

body.py: a covered request's body, read once under a cap to be fingerprinted, then handed to the handler as it
came, once, before the real channel.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from idempotency_mw import IdempotencyMiddleware, MemoryStore, PostgresStore, Store
from idempotency_mw._channels import BufferedBody, Read
from idempotency_mw._keys import InvalidKey
from tests.apps import Probe, build_app
from tests.calls import Call, hanging_up_client, raw_call, recorder
from tests.conftest import client_for, http_scope

TENANT = "tenant-capture"


def fixed_tenant(scope: Scope) -> str:
    return TENANT


@pytest.mark.parametrize("path", ["/raw-json", "/binary", "/stream", "/cookies"])
async def test_replay_is_byte_identical(store: Store, key: str, path: str) -> None:
    probe = Probe()
    app = build_app(store, probe)
    first_status, first_headers, first_chunks = await raw_call(app, path, key)
    again_status, again_headers, again_chunks = await raw_call(app, path, key)
    assert again_status == first_status
    assert again_headers == [*first_headers, (b"idempotent-replayed", b"true")]
    assert b"".join(again_chunks) == b"".join(first_chunks)
    assert sum(probe.calls.values()) == 1


async def test_headers_sent_as_a_generator_go_out_live_as_in_the_replay(store: Store, key: str) -> None:
    """ASGI allows any iterable of header pairs. A generator can be read once: the recorder's copy must be what
    goes on, or the live response leaves with no headers while its replay has them all."""
    runs = 0

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal runs
        runs += 1
        await receive()
        pairs = [(b"content-type", b"text/plain"), (b"x-run", b"%d" % runs)]
        await send({"type": "http.response.start", "status": 201, "headers": (pair for pair in pairs)})
        await send({"type": "http.response.body", "body": b"made"})

    middleware = IdempotencyMiddleware(app, store=store)
    live_status, live_headers, live_chunks = await raw_call(middleware, "/charge", key)
    *sent, (expires, _) = live_headers  # the app's headers, then the record's expiry (not recorded)
    assert (sent, expires) == ([(b"content-type", b"text/plain"), (b"x-run", b"1")], b"idempotency-expires")
    again_status, again_headers, again_chunks = await raw_call(middleware, "/charge", key)
    assert live_status == again_status == 201
    assert again_headers == [*live_headers, (b"idempotent-replayed", b"true")]
    assert b"".join(live_chunks) == b"".join(again_chunks) == b"made"
    assert runs == 1


@pytest.mark.parametrize("transactional", [False, True], ids=["plain", "transactional"])
async def test_a_response_start_without_headers_goes_out_and_replays(
    store: Store, key: str, transactional: bool
) -> None:
    """ASGI makes a response start's headers optional. The start gains the record's expiry on its way: it read the
    missing field and raised once the record was written (the client got the server's 500, its retry a replay)."""
    if transactional and not isinstance(store, PostgresStore):
        pytest.skip("transactional mode needs PostgreSQL")
    runs = 0

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal runs
        runs += 1
        await receive()
        await send({"type": "http.response.start", "status": 201})
        await send({"type": "http.response.body", "body": b"made"})

    middleware = IdempotencyMiddleware(app, store=store, transactional=transactional)
    live_status, live_headers, live_chunks = await raw_call(middleware, "/charge", key)
    assert [name for name, _ in live_headers] == [b"idempotency-expires"]
    again_status, again_headers, again_chunks = await raw_call(middleware, "/charge", key)
    assert live_status == again_status == 201
    assert again_headers == [*live_headers, (b"idempotent-replayed", b"true")]
    assert b"".join(live_chunks) == b"".join(again_chunks) == b"made"
    assert runs == 1


async def test_live_streaming_response_keeps_its_chunks(store: Store, key: str) -> None:
    _, _headers, chunks = await raw_call(build_app(store, Probe()), "/stream", key)
    assert chunks[:3] == [b"first,", b"second,", b"third"]


async def test_repeated_headers_keep_order_and_repeats(store: Store, key: str) -> None:
    _, live, _ = await raw_call(build_app(store, Probe()), "/cookies", key)
    names = [name for name, _ in live]
    assert names.count(b"set-cookie") == 2
    assert names.index(b"x-between") > names.index(b"set-cookie")


def reusing_buffer_app(store: PostgresStore, **options: Any) -> Starlette:
    """A download that streams a file through one reused buffer, yielding views of it (Starlette's
    StreamingResponse passes memoryview chunks through unchanged)."""

    async def export(request: Request) -> Response:
        buffer = bytearray(4)

        async def chunks() -> AsyncIterator[memoryview]:
            for part in (b"AAAA", b"BBBB", b"CCCC"):
                buffer[:] = part  # readinto() of the next block
                yield memoryview(buffer)

        return StreamingResponse(chunks(), status_code=201, media_type="application/octet-stream")

    app = Starlette(routes=[Route("/exports", export, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, **options)
    return app


async def test_replay_of_a_body_streamed_from_a_reused_buffer(pg_store: PostgresStore) -> None:
    """Chunks that are memoryviews of a buffer the app refills for its next chunk are copied as they pass: the record
    holds each block as it was sent (kept by reference, it would hold the last block three times), so the replay is
    the original, ``AAAABBBBCCCC``, byte for byte."""
    key = str(uuid.uuid4())
    async with client_for(reusing_buffer_app(pg_store)) as client:
        first = await client.post("/exports", headers={"Idempotency-Key": key})
        replay = await client.post("/exports", headers={"Idempotency-Key": key})
    assert first.content == b"AAAABBBBCCCC"
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.content == first.content


async def test_transactional_live_body_streamed_from_a_reused_buffer(pg_store: PostgresStore) -> None:
    """In transactional mode the recorder holds the messages until the commit: the chunks it holds are copies, so the
    client itself receives ``AAAABBBBCCCC``, not the buffer's last block three times."""
    key = str(uuid.uuid4())
    async with client_for(reusing_buffer_app(pg_store, transactional=True)) as client:
        first = await client.post("/exports", headers={"Idempotency-Key": key})
    assert first.status_code == 201
    assert first.content == b"AAAABBBBCCCC"


async def test_replay_keeps_the_response_trailers(pg_store: PostgresStore) -> None:
    """A response that announces trailers (``trailers: True``, the ``http.response.trailers`` extension of HTTP/2 and
    gRPC-style servers) goes out live with its trailer fields; a record keeps no trailers, so its retry is told the
    response cannot be replayed (409 ``idempotency_response_not_replayable``) rather than given a replay without the
    trailers the original had (a checksum, a ``grpc-status``). docs/design.md §2.7: "The stored status, headers and
    body go out unchanged"."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 201, "headers": [], "trailers": True})
        await send({"type": "http.response.body", "body": b"payload"})
        await send({"type": "http.response.trailers", "headers": [(b"x-checksum", b"abc")], "more_trailers": False})

    middleware = IdempotencyMiddleware(app, store=pg_store, tenant=fixed_tenant)
    key = str(uuid.uuid4())
    answers: list[list[Message]] = []
    for _ in range(2):
        sent: list[Message] = []
        scope = http_scope("/stream", key, extensions={"http.response.trailers": {}})
        await middleware(scope, hanging_up_client(asyncio.Event()), recorder(sent))
        answers.append(sent)
    original, retry = answers
    assert [m["type"] for m in original] == ["http.response.start", "http.response.body", "http.response.trailers"]
    assert retry[0]["status"] == 409  # the record keeps no trailers, so it says it cannot be replayed
    assert b"idempotency_response_not_replayable" in retry[1]["body"]


async def test_debug_extension_message_does_not_make_a_response_unreplayable(pg_store: PostgresStore) -> None:
    """Under Starlette's TestClient (the ``http.response.debug`` extension), a ``TemplateResponse`` sends an
    ``http.response.debug`` message before its start. That message carries no body: it passes on and the recorder
    ignores it, so the record keeps its body and the retry is a replay (201), as it is in production, not a 409
    ``idempotency_response_not_replayable`` seen only under the test client."""

    async def app(
        scope: Scope, receive: Receive, send: Send
    ) -> None:  # what TemplateResponse does under the TestClient
        await receive()
        if "http.response.debug" in scope.get("extensions", {}):
            await send({"type": "http.response.debug", "info": {"template": "receipt.html", "context": {}}})
        await send({"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"text/html")]})
        await send({"type": "http.response.body", "body": b"<p>paid</p>"})

    middleware = IdempotencyMiddleware(app, store=pg_store, tenant=fixed_tenant)
    key = str(uuid.uuid4())
    statuses: list[int] = []
    for _ in range(2):
        sent: list[Message] = []
        scope = http_scope("/pay", key, extensions={"http.response.debug": {}})
        await middleware(scope, hanging_up_client(asyncio.Event()), recorder(sent))
        statuses += [m["status"] for m in sent if m["type"] == "http.response.start"]
    assert statuses == [201, 201]


def file_app(store: Store, path: Path, **options: Any) -> tuple[Starlette, list[int]]:
    runs: list[int] = []

    async def download(request: Request) -> Response:
        runs.append(1)
        return FileResponse(path, media_type="application/octet-stream")

    app = Starlette(routes=[Route("/download", download, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, tenant=fixed_tenant, **options)
    return app, runs


async def test_pathsend_file_response_is_captured_and_replayed(store: Store, tmp_path: Path) -> None:
    """Granian offers ``http.response.pathsend``, and Starlette's FileResponse uses it when offered: a covered
    request must still be recorded in full (so its retry replays the file), not as cut short."""
    path = tmp_path / "report.bin"
    path.write_bytes(bytes(range(256)) * 64)
    app, runs = file_app(store, path)
    key = str(uuid.uuid4())
    first = Call(app, "/download", key, extensions={"http.response.pathsend": {}})
    await asyncio.wait_for(first.task, 5)
    assert first.status == 200
    assert first.body == path.read_bytes()
    again = Call(app, "/download", key, extensions={"http.response.pathsend": {}})
    await asyncio.wait_for(again.task, 5)
    assert again.body == path.read_bytes()
    assert (b"idempotent-replayed", b"true") in again.sent[0]["headers"]
    assert runs == [1]


async def test_requests_the_middleware_does_not_cover_keep_pathsend(store: Store, tmp_path: Path) -> None:
    """A request the middleware refuses (an empty key: 400), or does not cover (a GET), sends its file the server's
    way: ``http.response.pathsend`` goes through untouched."""
    path = tmp_path / "plain.txt"
    path.write_bytes(b"hello")
    app, _ = file_app(store, path)
    call = Call(app, "/download", "", extensions={"http.response.pathsend": {}})  # an empty key: refused 400
    await asyncio.wait_for(call.task, 5)
    assert call.status == 400

    async def download(request: Request) -> Response:
        return FileResponse(path)

    bare = Starlette(routes=[Route("/download", download, methods=["POST", "GET"])])
    bare.add_middleware(IdempotencyMiddleware, store=store, tenant=fixed_tenant)
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {
        "type": "http",
        "method": "GET",
        "path": "/download",
        "query_string": b"",
        "root_path": "",
        "headers": [],
        "extensions": {"http.response.pathsend": {}},
    }
    await bare(scope, receive, recorder(sent))
    assert sent[-1] == {"type": "http.response.pathsend", "path": str(path)}


def channel(*messages: Message) -> tuple[Receive, list[Message]]:
    """A client's ``receive`` that sends ``messages`` in order, then the disconnect; and what is left to send."""
    left = list(messages)

    async def receive() -> Message:
        return left.pop(0) if left else {"type": "http.disconnect"}

    return receive, left


def chunk(body: bytes, more: bool = False) -> Message:
    return {"type": "http.request", "body": body, "more_body": more}


async def test_the_whole_body_is_read_from_its_chunks_and_handed_over_once() -> None:
    receive, _ = channel(chunk(b'{"amount":', more=True), chunk(b"", more=True), chunk(b" 10}"))
    body = BufferedBody(receive, limit=100)
    assert await body.read_all(b"") is Read.WHOLE
    assert (body.body, body.read) == (b'{"amount": 10}', True)
    assert await body.receive() == chunk(b'{"amount": 10}')  # the handler's first receive: all of it, at once
    assert body.delivered
    assert await body.receive() == {"type": "http.disconnect"}  # then the real channel, which tells of a hang-up


async def test_a_body_over_the_cap_is_refused_by_its_declared_length_before_anything_is_read() -> None:
    receive, left = channel(chunk(b"x" * 10))
    body = BufferedBody(receive, limit=9)
    assert await body.read_all(b"10") is Read.TOO_LARGE
    assert len(left) == 1  # nothing read
    assert not body.read


async def test_a_body_that_grows_past_the_cap_as_it_is_sent_is_refused() -> None:
    receive, _ = channel(chunk(b"x" * 5, more=True), chunk(b"x" * 5, more=True), chunk(b"x"))
    body = BufferedBody(receive, limit=9)
    assert await body.read_all(b"") is Read.TOO_LARGE  # no Content-Length (chunked), or one that lied
    assert not body.read


async def test_at_the_cap_exactly_the_body_is_read() -> None:
    receive, _ = channel(chunk(b"x" * 9))
    body = BufferedBody(receive, limit=9)
    assert await body.read_all(b"9") is Read.WHOLE
    assert body.body == b"x" * 9


async def test_a_client_that_hangs_up_mid_body_is_gone() -> None:
    receive, _ = channel(chunk(b"part", more=True), {"type": "http.disconnect"})
    body = BufferedBody(receive, limit=100)
    assert await body.read_all(b"100") is Read.GONE
    assert (body.body, body.read) == (b"part", False)  # kept for a handler that runs all the same (switched off)


@pytest.mark.parametrize(
    ("raw", "content_type", "payload"),
    [
        (b'{"id": "evt_1"}', b"application/json", {"id": "evt_1"}),
        (b'{"id": "evt_1"}', b"text/plain", {"id": "evt_1"}),  # JSON whatever its content type, as request.json()
        (b"id=evt_1&empty=", b"application/x-www-form-urlencoded; charset=utf-8", {"id": "evt_1", "empty": ""}),
    ],
)
async def test_the_payload_is_the_body_as_the_app_reads_it(raw: bytes, content_type: bytes, payload: object) -> None:
    receive, _ = channel(chunk(raw))
    body = BufferedBody(receive, limit=100)
    await body.read_all(b"")
    assert body.payload(content_type) == payload


async def test_a_payload_that_is_neither_json_nor_a_form_is_an_invalid_key() -> None:
    receive, _ = channel(chunk(b"id=evt_1"))
    body = BufferedBody(receive, limit=100)
    await body.read_all(b"")
    with pytest.raises(InvalidKey, match="JSON or a form"):
        body.payload(b"text/plain")


async def test_a_body_that_passes_the_cap_in_its_last_message_is_handed_over_as_ended() -> None:
    """Refused for the cap, it may still go to a handler (observing, switched off): whole, and with nothing more to
    come, since the client sent its last message; a handler told of more would wait for it for ever."""
    receive, _ = channel(chunk(b"x" * 5, more=True), chunk(b"x" * 5))
    body = BufferedBody(receive, limit=9)
    assert await body.read_all(b"") is Read.TOO_LARGE
    assert await body.receive() == chunk(b"x" * 10)


WEBHOOK = {"/upload": {"key_from": lambda event: event.get("id"), "tenant": lambda scope: "provider"}}


@pytest.mark.parametrize(
    "options",
    [{"observe": True}, {"observe": True, "routes": WEBHOOK}, {"enabled": False, "routes": WEBHOOK}],
    ids=["observing", "observing a webhook", "switched off"],
)
async def test_a_handler_gets_a_chunked_body_over_the_cap_whole(options: dict[str, Any]) -> None:
    """A chunked upload (no Content-Length) whose last message passes ``max_request_bytes``: observing, or switched
    off (where a route that takes its key from the body reads it first), the middleware fails no request for it,
    and the handler reads it to its end."""
    received: list[bytes] = []

    async def upload(request: Request) -> Response:
        received.append(await request.body())
        return Response(b"ok")

    app = Starlette(routes=[Route("/upload", upload, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), max_request_bytes=64, **options)
    receive, _ = channel(chunk(b"x" * 126))  # then the disconnect, which a handler told of more would meet
    sent: list[Message] = []
    headers = [(b"content-type", b"application/json"), (b"authorization", b"Bearer sk_test_upload")]
    scope = http_scope("/upload", str(uuid.uuid4()), headers=headers)
    await asyncio.wait_for(app(scope, receive, recorder(sent)), 5)
    assert (sent[0]["status"], received) == (200, [b"x" * 126])
