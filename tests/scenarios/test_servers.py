"""The same slice of the conformance suite under uvicorn, Hypercorn and Granian, over real sockets.

Each server runs ``tests/scenarios/server_app.py`` in a child process (``faults.server.ServerProcess``), started once
per module on a free loopback port, with its own command line's defaults (Granian: ``--interface asgi``, which includes
lifespan, and asyncio's event loop). The test ids carry each server's version.

What differs between them, as far as the middleware can tell:

- only Granian offers ``http.response.pathsend`` (the middleware withholds it from the requests it covers, so a
  ``FileResponse`` goes through ``send`` and is recorded; uncovered requests keep it);
- the ASGI spec version they announce (uvicorn and Granian 2.3, Hypercorn 2.1), and so Starlette's streaming
  responses listen for ``http.disconnect`` under all three;
- uvicorn hands the app the body in one message, Hypercorn and Granian in two (the last one empty);
- none of them cancels a handler when its client hangs up: a write to a client that has gone is dropped, and
  ``receive`` answers ``http.disconnect``;
- an exception out of the lifespan (a bad app-wide setting) makes Hypercorn and Granian carry on without lifespan,
  as uvicorn does under its default ``--lifespan auto``; they have no ``--lifespan on``. A failed startup
  (``lifespan.startup.failed``) stops all three, Hypercorn with exit status 0;
- a response without Content-Length goes out chunked under all three; its replay is sent as a body message and an
  empty final one, so that Granian, which frames a lone final message with a Content-Length, streams it too.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
import pytest_asyncio

from faults.server import SERVERS, ServerProcess, ServerStartFailed
from tests.scenarios.server_app import EFFECTS_TABLE, STREAM_CHUNKS

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

VERSIONS = {name: version(name) for name in SERVERS}
SERVER_IDS = [f"{name}-{VERSIONS[name]}" for name in SERVERS]
APP = "tests.scenarios.server_app:create_app"
TOKEN = "sk_test_servers"
FILE_BODY = bytes(range(256)) * 1024  # 256 KiB: several body messages through Starlette's FileResponse
# Added by the server to every response, first or replayed: not part of what the middleware records.
SERVER_HEADERS = {b"date", b"server", b"transfer-encoding"}


@dataclass(frozen=True)
class Served:
    name: str
    host: str
    port: int
    database_url: str

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def client(self) -> httpx.AsyncClient:
        """A client with its own connections (a held request keeps its connection busy)."""
        return httpx.AsyncClient(base_url=self.base_url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)

    async def runs(self, key: str) -> int:
        """How many times a handler ran for this key."""
        connection = await asyncpg.connect(self.database_url)
        try:
            return int(await connection.fetchval("SELECT count(*) FROM server_effects WHERE key = $1", key))
        finally:
            await connection.close()


@pytest.fixture(scope="module")
def served_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("servers") / "receipt.bin"
    path.write_bytes(FILE_BODY)
    return path


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=SERVERS, ids=SERVER_IDS)
async def server(
    request: pytest.FixtureRequest, idempotency_database_url: str, served_file: Path
) -> AsyncIterator[Served]:
    connection = await asyncpg.connect(idempotency_database_url)
    try:
        await connection.execute(EFFECTS_TABLE)
    finally:
        await connection.close()
    env = {"DATABASE_URL": idempotency_database_url, "SERVER_APP_FILE": str(served_file)}
    async with ServerProcess(APP, factory=True, env=env, server=request.param) as process:
        yield Served(request.param, process.host, process.port, idempotency_database_url)


class Probes:
    """Steers the app's probes (tests/scenarios/server_app.py) over a connection of its own."""

    def __init__(self, served: Served) -> None:
        self.http = served.client()

    async def hold(self, name: str) -> None:
        (await self.http.get(f"/probe/{name}/hold")).raise_for_status()

    async def open(self, name: str) -> None:
        (await self.http.get(f"/probe/{name}/open")).raise_for_status()

    async def entered(self, name: str) -> None:
        (await self.http.get(f"/probe/{name}/entered")).raise_for_status()

    async def report(self, name: str) -> dict[str, Any]:
        """What the app sent and how it ended, once it is done with the request."""
        response = await self.http.get(f"/probe/{name}")
        response.raise_for_status()
        report: dict[str, Any] = response.json()
        return report

    async def aclose(self) -> None:
        await self.http.aclose()


@pytest_asyncio.fixture(loop_scope="module")
async def probes(server: Served) -> AsyncIterator[Probes]:
    steering = Probes(server)
    yield steering
    await steering.aclose()


def new_key() -> str:
    return str(uuid.uuid4())


def new_probe() -> str:
    return uuid.uuid4().hex


def keyed(key: str, probe: str = "") -> dict[str, str]:
    return {"Idempotency-Key": key, "X-Probe": probe or new_probe()}


def recorded_headers(response: httpx.Response) -> list[tuple[bytes, bytes]]:
    """The header list as the app sent it: without what the server adds to every response."""
    return [(name.lower(), value) for name, value in response.headers.raw if name.lower() not in SERVER_HEADERS]


def assert_replay_of(replay: httpx.Response, first: httpx.Response) -> None:
    assert replay.status_code == first.status_code
    assert recorded_headers(replay) == [*recorded_headers(first), (b"idempotent-replayed", b"true")]
    assert replay.content == first.content


def problem_code(response: httpx.Response) -> str:
    code: str = response.json()["code"]
    return code


async def send_raw(
    served: Served, path: str, key: str, probe: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A keyed POST over a raw socket, which the test then closes (hangs up) when it chooses."""
    reader, writer = await asyncio.open_connection(served.host, served.port)
    body = b'{"amount": 100}'
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: {served.host}:{served.port}\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Idempotency-Key: {key}\r\nX-Probe: {probe}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    return reader, writer


async def read_until(reader: asyncio.StreamReader, marker: bytes) -> None:
    seen = b""
    while marker not in seen:
        chunk = await asyncio.wait_for(reader.read(4096), 30)
        assert chunk, f"the connection closed before {marker!r} came: {seen!r}"
        seen += chunk


# -- fresh, replay, conflict, mismatch ------------------------------------------------------------------------------


async def test_fresh_request_runs_and_its_retry_replays_byte_for_byte(server: Served) -> None:
    key = new_key()
    async with server.client() as client:
        first = await client.post("/charge", json={"amount": 100}, headers=keyed(key))
        replay = await client.post("/charge", json={"amount": 100}, headers=keyed(key))

    assert first.status_code == 201
    assert "idempotent-replayed" not in first.headers
    assert first.headers.get_list("set-cookie") == ["a=1; Path=/", "b=2; Path=/"]
    assert_replay_of(replay, first)
    assert await server.runs(key) == 1


async def test_a_retry_while_the_original_runs_gets_409_with_retry_after(server: Served, probes: Probes) -> None:
    key, original = new_key(), new_probe()
    await probes.hold(original)
    async with server.client() as client, server.client() as other:
        running = asyncio.ensure_future(client.post("/charge", json={"amount": 1}, headers=keyed(key, original)))
        await probes.entered(original)
        conflict = await other.post("/charge", json={"amount": 1}, headers=keyed(key))
        await probes.open(original)
        first = await running

    assert conflict.status_code == 409
    assert problem_code(conflict) == "idempotency_request_in_progress"
    assert conflict.headers["retry-after"] == "1"
    assert first.status_code == 201
    assert await server.runs(key) == 1


async def test_a_reused_key_with_another_body_gets_422(server: Served) -> None:
    key = new_key()
    async with server.client() as client:
        first = await client.post("/charge", json={"amount": 1}, headers=keyed(key))
        reused = await client.post("/charge", json={"amount": 2}, headers=keyed(key))

    assert first.status_code == 201
    assert reused.status_code == 422
    assert problem_code(reused) == "idempotency_key_reused"
    assert await server.runs(key) == 1


# -- streaming and hang-ups -----------------------------------------------------------------------------------------


async def test_a_streamed_response_is_captured_and_replayed(server: Served, probes: Probes) -> None:
    key, original = new_key(), new_probe()
    async with server.client() as client:
        first = await client.post("/stream", json={"amount": 5}, headers=keyed(key, original))
        replay = await client.post("/stream", json={"amount": 5}, headers=keyed(key))
    sent = (await probes.report(original))["messages"]

    assert first.status_code == 200
    assert first.content == b"".join(STREAM_CHUNKS)
    assert sent.count("http.response.body") > len(STREAM_CHUNKS)  # one message per chunk, and the final one
    assert replay.status_code == 200
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.headers["x-run"] == first.headers["x-run"] == "1"
    assert replay.content == first.content
    assert await server.runs(key) == 1


async def test_a_streamed_response_is_replayed_with_its_own_header_list(server: Served) -> None:
    """A response without Content-Length went out streamed, and its replay is streamed too (Granian frames a lone
    final body message with a Content-Length the original did not have)."""
    key = new_key()
    async with server.client() as client:
        first = await client.post("/stream", json={"amount": 6}, headers=keyed(key))
        replay = await client.post("/stream", json={"amount": 6}, headers=keyed(key))

    assert "content-length" not in first.headers
    assert_replay_of(replay, first)


async def test_a_client_that_hangs_up_mid_handler_frees_the_key(server: Served, probes: Probes) -> None:
    """The handler notices the client left before its work began and gives up: the retry runs it."""
    key, original = new_key(), new_probe()
    await probes.hold(original)
    _, connection = await send_raw(server, "/attentive", key, original)
    await probes.entered(original)
    connection.close()
    ended = await probes.report(original)
    async with server.client() as client:
        retry = await client.post("/attentive", json={"amount": 100}, headers=keyed(key))

    assert ended["outcome"] == "raised ClientDisconnect"
    assert retry.status_code == 201
    assert "idempotent-replayed" not in retry.headers
    assert await server.runs(key) == 1


async def test_a_handler_that_finishes_after_its_client_left_keeps_the_key(server: Served, probes: Probes) -> None:
    """None of the servers cancels the handler: it finishes, its answer is recorded, and the retry replays it."""
    key, original = new_key(), new_probe()
    await probes.hold(original)
    _, connection = await send_raw(server, "/charge", key, original)
    await probes.entered(original)
    connection.close()
    await probes.open(original)
    ended = await probes.report(original)
    async with server.client() as client:
        retry = await client.post("/charge", json={"amount": 100}, headers=keyed(key))

    assert ended["outcome"] == "returned"
    assert retry.status_code == 201
    assert retry.headers["idempotent-replayed"] == "true"
    assert await server.runs(key) == 1


async def test_a_client_that_hangs_up_mid_stream_keeps_the_key_without_a_replay(server: Served, probes: Probes) -> None:
    """Plain mode: the final status had gone out, so the key is kept without its body, and the retry hears 409."""
    key, original = new_key(), new_probe()
    await probes.hold(original)
    answer, connection = await send_raw(server, "/stream", key, original)
    await read_until(answer, STREAM_CHUNKS[1])
    await probes.entered(original)
    connection.close()
    ended = await probes.report(original)  # Starlette's StreamingResponse stops when it hears the disconnect
    await probes.open(original)
    async with server.client() as client:
        retry = await client.post("/stream", json={"amount": 100}, headers=keyed(key))

    assert ended["outcome"] == "returned"
    assert retry.status_code == 409
    assert problem_code(retry) == "idempotency_response_not_replayable"
    assert "cut short" in retry.json()["detail"]
    assert "retry-after" not in retry.headers
    assert await server.runs(key) == 1


# -- files, background tasks, transactions --------------------------------------------------------------------------


async def test_a_file_response_is_captured_and_replayed(server: Served, probes: Probes) -> None:
    key, original, again = new_key(), new_probe(), new_probe()
    async with server.client() as client:
        first = await client.post("/file", headers=keyed(key, original))
        replay = await client.post("/file", headers=keyed(key, again))
    sent = (await probes.report(original))["messages"]

    assert first.status_code == 200
    assert first.content == FILE_BODY
    assert "http.response.pathsend" not in sent  # withheld: the body goes through send, where it is recorded
    assert sent.count("http.response.body") > 1
    assert_replay_of(replay, first)
    assert await server.runs(key) == 1


@pytest.mark.parametrize("method", ["GET", "POST"], ids=["uncovered-method", "no-key"])
async def test_an_uncovered_file_response_keeps_pathsend(server: Served, probes: Probes, method: str) -> None:
    probe = new_probe()
    async with server.client() as client:
        response = await client.request(method, "/file", headers={"X-Probe": probe})
    report = await probes.report(probe)

    assert response.status_code == 200
    assert response.content == FILE_BODY
    assert report["offered_pathsend"] == (server.name == "granian")  # the only one of the three that offers it
    assert ("http.response.pathsend" in report["messages"]) == report["offered_pathsend"]


async def test_a_retry_during_a_background_task_gets_the_replay(server: Served, probes: Probes) -> None:
    """The record settles as the final body goes out, before the background task runs."""
    key, original = new_key(), new_probe()
    await probes.hold(original)  # the background task waits at the checkpoint; the handler does not
    async with server.client() as client:
        first = await client.post("/background", json={"amount": 3}, headers=keyed(key, original))
    await probes.entered(original)
    async with server.client() as client:
        retry = await client.post("/background", json={"amount": 3}, headers=keyed(key))
    await probes.open(original)
    ended = await probes.report(original)

    assert first.status_code == 201
    assert_replay_of(retry, first)
    assert ended["background"] == "done"
    assert await server.runs(key) == 1


async def test_a_transactional_route_commits_and_replays(server: Served) -> None:
    key = new_key()
    async with server.client() as client:
        first = await client.post("/transactional", json={"amount": 9}, headers=keyed(key))
        replay = await client.post("/transactional", json={"amount": 9}, headers=keyed(key))

    assert first.status_code == 201
    assert first.json() == {"run": 1}
    assert_replay_of(replay, first)
    assert await server.runs(key) == 1


# -- startup --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SERVERS, ids=SERVER_IDS)
async def test_a_bad_route_declaration_stops_the_server(name: str) -> None:
    """The middleware refuses the route policies at lifespan startup, and every server then refuses to start."""
    process = ServerProcess("tests.scenarios.server_app:misdeclared", factory=True, server=name, ready_timeout=30)
    with pytest.raises(ServerStartFailed, match="exited during startup") as failed:
        async with process:
            pass
    assert "idempotency_mw: transactional mode needs a store with database transactions" in str(failed.value)
    assert process.process is not None
    # Hypercorn 0.18 loses its worker's exit status: a server that refused to start exits with 0.
    assert (process.process.returncode == 0) == (name == "hypercorn")


@pytest.mark.parametrize("name", SERVERS, ids=SERVER_IDS)
async def test_a_bad_app_wide_setting_under_each_server(name: str) -> None:
    """It raises out of the lifespan. Only uvicorn run with ``--lifespan on`` (as ServerProcess runs it) refuses to
    start; Hypercorn and Granian carry on without lifespan, and every request fails with the error."""
    process = ServerProcess("tests.scenarios.server_app:misconfigured", factory=True, server=name, ready_timeout=30)
    if name == "uvicorn":
        with pytest.raises(ServerStartFailed, match="exited during startup"):
            async with process:
                pass
        return
    async with process, httpx.AsyncClient(base_url=process.base_url) as client:
        response = await client.post("/charge", headers={"Authorization": f"Bearer {TOKEN}"})
        log = process.log_tail(200)
    assert response.status_code == 500
    assert "fail_open cannot be combined with transactional" in log
