"""The retrying client against a real server that misbehaves on purpose.

The server is uvicorn on loopback, in a background thread, running a Starlette app behind IdempotencyMiddleware on
PostgreSQL. Around the middleware, an outer layer records every request the server saw (and with which key) and
can answer the first requests to a path with canned transient errors. In front of it, a loopback TCP proxy can
lose requests before the server sees them, or lose (close or reset) the connection after the server answered.

Every scenario runs with the sync and the async client. Tests count attempts and keys, never time. Tests that
start the server are marked ``slow``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import struct
import threading
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import uvicorn
from hypothesis import given
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from idempotency_mw import Event, IdempotencyMiddleware, Outcome, PostgresStore
from idempotency_mw import _problems as problems
from idempotency_mw import client as client_module
from idempotency_mw._keys import InvalidKey, parse_key
from idempotency_mw._wire import ProblemCode
from idempotency_mw.client import (
    AsyncIdempotentClient,
    IdempotentClient,
    IdempotentResult,
    RetriesExhausted,
    Retry,
    parse_retry_after,
    validate_key,
)

FAST = Retry(attempts=10, deadline=20.0, backoff=0.01, max_backoff=0.05)
AUTH = {"Authorization": "Bearer sk_test_client"}
IN_PROGRESS = "idempotency_request_in_progress"


# -- the misbehaving server ---------------------------------------------------------------------------------


@dataclass
class Seen:
    """One request as it reached the server (outside the middleware)."""

    method: str
    path: str
    keys: tuple[str, ...]  # every Idempotency-Key field value: exactly one for a keyed request
    status: int | None = None


@dataclass(frozen=True)
class Canned:
    status: int
    headers: dict[str, str]
    body: bytes = b""
    content_type: str = "text/plain"


def canned_problem(problem: problems.Problem, headers: dict[str, str] | None = None) -> Canned:
    """The middleware's own problem response, served from the outer layer (so nothing behind it runs)."""
    extra = dict(headers or {})
    if problem.retry_after is not None:
        extra.setdefault("retry-after", str(problem.retry_after))
    return Canned(problem.status, extra, problem.body(), "application/problem+json")


class ServerState:
    """What the server saw and did; written by the server thread, read by the test once the client returned."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.seen: list[Seen] = []
        self.effects: Counter[str] = Counter()  # key -> effects performed (a charge recorded)
        self.runs: Counter[str] = Counter()  # key -> handler runs, failed ones included
        self.scripts: dict[str, deque[Canned]] = {}
        self.connection_plans: deque[str] = deque()  # proxy: "refuse" | "close" | "reset", one per connection
        self.connection_plan: Callable[[int], str | None] | None = None  # or a rule by connection number
        self.connections = 0
        self.dropped = 0

    def script(self, path: str, *responses: Canned) -> None:
        self.scripts[path] = deque(responses)

    def next_canned(self, path: str) -> Canned | None:
        with self.lock:
            queue = self.scripts.get(path)
            return queue.popleft() if queue else None

    def next_connection_plan(self) -> str | None:
        with self.lock:
            number = self.connections
            self.connections += 1
            if self.connection_plans:
                return self.connection_plans.popleft()
            return self.connection_plan(number) if self.connection_plan else None

    def record(self, seen: Seen) -> None:
        with self.lock:
            self.seen.append(seen)

    def requests(self, path: str = "/charges") -> list[Seen]:
        with self.lock:
            return [s for s in self.seen if s.path == path]

    def keys_seen(self, path: str = "/charges") -> list[tuple[str, ...]]:
        return [s.keys for s in self.requests(path)]

    def answered(self, key: str, status: int) -> int:
        with self.lock:
            return sum(1 for s in self.seen if s.keys == (key,) and s.status == status)


def recording_layer(app: ASGIApp, state: ServerState) -> ASGIApp:
    """Outermost layer: note each request and its keys; answer scripted requests before the middleware sees them."""

    async def layer(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        keys = tuple(v.decode("latin-1") for k, v in scope["headers"] if k == b"idempotency-key")
        seen = Seen(scope["method"], scope["path"], keys)
        state.record(seen)
        canned = state.next_canned(scope["path"])
        if canned is not None:
            seen.status = canned.status
            headers = [(b"content-type", canned.content_type.encode())]
            headers += [(k.encode(), v.encode()) for k, v in canned.headers.items()]
            headers.append((b"content-length", str(len(canned.body)).encode()))
            await send({"type": "http.response.start", "status": canned.status, "headers": headers})
            await send({"type": "http.response.body", "body": canned.body})
            return None

        async def noting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                seen.status = message["status"]
            await send(message)

        return await app(scope, receive, noting_send)

    return layer


def build_app(store: PostgresStore, state: ServerState) -> ASGIApp:
    async def charges(request: Request) -> Response:
        """The effect under test: one charge per logical call. ``?fail=N`` fails the first N runs with 500,
        ``?hold=N`` keeps the first run busy until the server has answered N 409s for its key, ``?bad=1`` is 400."""
        key = request.headers.get("idempotency-key", "-")
        body = (await request.body()).decode("latin-1")
        with state.lock:
            state.runs[key] += 1
            run = state.runs[key]
        if request.query_params.get("bad"):
            return JSONResponse({"error": "amount is required"}, status_code=400)
        if run <= int(request.query_params.get("fail", "0")):
            return JSONResponse({"error": "database hiccup"}, status_code=500)
        hold = int(request.query_params.get("hold", "0"))
        if run == 1 and hold:
            for _ in range(1000):  # at most 10 s; the fixture's stop releases it sooner
                if state.answered(key, 409) >= hold or state.stop.is_set():
                    break
                await asyncio.sleep(0.01)
        with state.lock:
            state.effects[key] += 1
            number = sum(state.effects.values())
        return JSONResponse({"id": f"ch_{number}", "key": key, "body": body}, status_code=201)

    async def items(request: Request) -> Response:
        with state.lock:
            state.runs["GET"] += 1
        return JSONResponse({"items": []})

    app = Starlette(
        routes=[
            Route("/charges", charges, methods=["POST", "PATCH", "PUT", "DELETE"]),
            Route("/items", items, methods=["GET"]),
        ]
    )
    app.add_middleware(
        IdempotencyMiddleware, store=store, methods=("POST", "PATCH", "PUT", "DELETE"), retry_after=1, on_event=None
    )
    return recording_layer(app, state)


class MisbehavingServer:
    """uvicorn plus a lossy TCP proxy, on loopback, in one background thread with its own event loop, serving
    ``build``'s app (:func:`build_app` by default)."""

    def __init__(self, database_url: str, build: Callable[[PostgresStore, ServerState], ASGIApp] = build_app) -> None:
        self.database_url = database_url
        self._build = build
        self.state = ServerState()
        self._app_socket = _listening_socket()
        self._proxy_socket = _listening_socket()
        self.url = f"http://127.0.0.1:{self._app_socket.getsockname()[1]}"
        self.proxy_url = f"http://127.0.0.1:{self._proxy_socket.getsockname()[1]}"
        self._uvicorn: uvicorn.Server | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), name="misbehaving-server")

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(30) or self._error is not None:
            self.stop()
            raise RuntimeError("the test server did not start") from self._error

    def stop(self) -> None:
        self.state.stop.set()  # releases held handlers
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread.is_alive():
            self._thread.join(20)
        assert not self._thread.is_alive(), "the test server did not stop"

    async def _main(self) -> None:
        proxy_tasks: set[asyncio.Task[None]] = set()

        async def on_proxy_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            proxy_tasks.add(task)
            try:
                await self._proxy(reader, writer)
            finally:
                proxy_tasks.discard(task)

        try:
            async with PostgresStore(self.database_url, min_size=1, max_size=4) as store:
                config = uvicorn.Config(
                    self._build(store, self.state),
                    log_level="warning",
                    access_log=False,
                    lifespan="off",
                    timeout_graceful_shutdown=2,
                )
                self._uvicorn = uvicorn.Server(config)
                proxy = await asyncio.start_server(on_proxy_connection, sock=self._proxy_socket)
                serving = asyncio.create_task(self._uvicorn.serve(sockets=[self._app_socket]))
                for _ in range(3000):
                    if self._uvicorn.started or serving.done():
                        break
                    await asyncio.sleep(0.01)
                self._ready.set()
                try:
                    await serving
                finally:
                    proxy.close()
                    for task in list(proxy_tasks):
                        task.cancel()
                    await asyncio.gather(*proxy_tasks, return_exceptions=True)
        except BaseException as error:
            self._error = error
            self._ready.set()
            raise

    async def _proxy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Forward one client connection to uvicorn, or lose it as the connection plan says."""
        plan = self.state.next_connection_plan()
        if plan == "refuse":  # the request is lost before the server sees it
            _reset(writer)
            return
        upstream_reader, upstream_writer = await asyncio.open_connection(*self._app_socket.getsockname()[:2])
        upload = asyncio.create_task(_pump(reader, upstream_writer))
        try:
            if plan in ("close", "reset"):  # the server ran the request; its answer is lost
                await upstream_reader.read(65536)
                with self.state.lock:
                    self.state.dropped += 1
                if plan == "reset":
                    _reset(writer)
                else:
                    writer.close()
            else:
                await _pump(upstream_reader, writer)
        finally:
            upload.cancel()
            upstream_writer.close()
            writer.close()


def _listening_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a crashed peer or a middlebox would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    with contextlib.suppress(Exception):
        writer.close()


@pytest.fixture
def server(idempotency_database_url: str) -> Iterator[MisbehavingServer]:
    """A fresh server per test, stopped by the test that started it."""
    instance = MisbehavingServer(idempotency_database_url)
    instance.start()
    try:
        yield instance
    finally:
        instance.stop()


@pytest.fixture
def dead_url() -> str:
    """A loopback address with nothing listening: a request that was sent anyway would end in ConnectError."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


# -- driving either client the same way ---------------------------------------------------------------------


@pytest.fixture(params=["sync", "async"])
def flavour(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def call(
    flavour: str,
    base_url: str,
    method: str,
    url: str,
    *,
    retry: Retry = FAST,
    client: dict[str, Any] | None = None,
    **kwargs: Any,
) -> IdempotentResult:
    """One logical call through a new client of the given flavour (``.post()``, ``.put()``... by method)."""
    options = {"headers": AUTH, **(client or {})}
    if flavour == "sync":
        with IdempotentClient(base_url=base_url, retry=retry, **options) as sync_client:
            result: IdempotentResult = getattr(sync_client, method.lower())(url, **kwargs)
            return result

    async def run() -> IdempotentResult:
        async with AsyncIdempotentClient(base_url=base_url, retry=retry, **options) as async_client:
            result: IdempotentResult = await getattr(async_client, method.lower())(url, **kwargs)
            return result

    return asyncio.run(run())


def assert_one_key_throughout(state: ServerState, key: str | None, path: str = "/charges") -> None:
    expected = (key,) if key is not None else ()
    assert state.keys_seen(path), "the server saw no request"
    assert all(keys == expected for keys in state.keys_seen(path)), state.keys_seen(path)


# -- retried answers ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_transient_answers_are_retried_with_one_key(server: MisbehavingServer, flavour: str) -> None:
    server.state.script(
        "/charges",
        Canned(408, {}),
        Canned(425, {}),
        Canned(429, {"retry-after": "0"}),
        canned_problem(problems.in_progress(1)),
        canned_problem(
            problems.Problem(409, ProblemCode.IN_PROGRESS, "Request in progress", "still running")
        ),  # no Retry-After
        Canned(409, {"retry-after": "0"}),  # any 409 that says when to come back
        Canned(500, {}),
        Canned(502, {}),
        canned_problem(problems.store_unavailable(1)),
        Canned(504, {"retry-after": "Thu, 01 Jan 1970 00:00:00 GMT"}),  # an HTTP-date, long past
    )
    retry = Retry(attempts=11, deadline=20.0, backoff=0.01, max_backoff=0.05)
    result = call(flavour, server.url, "POST", "/charges", json={"amount": 100}, retry=retry)

    assert result.status_code == 201
    assert result.outcomes == (408, 425, 429, 409, 409, 409, 500, 502, 503, 504, 201)
    assert result.attempts == 11 == len(server.state.requests())
    assert not result.replayed
    assert result.key is not None
    assert_one_key_throughout(server.state, result.key)
    assert server.state.effects == {result.key: 1}


@pytest.mark.slow
def test_handler_failures_are_retried_and_the_effect_happens_once(server: MisbehavingServer, flavour: str) -> None:
    result = call(flavour, server.url, "POST", "/charges?fail=2", data={"amount": "100"})

    assert result.status_code == 201
    assert result.outcomes == (500, 500, 201)
    assert result.key is not None
    assert server.state.runs[result.key] == 3  # the middleware released the key after each 500
    assert server.state.effects[result.key] == 1
    assert_one_key_throughout(server.state, result.key)


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["close", "reset"])
def test_a_lost_response_is_replayed_not_rerun(server: MisbehavingServer, flavour: str, loss: str) -> None:
    server.state.connection_plans.extend([loss, loss])
    result = call(flavour, server.proxy_url, "POST", "/charges", json={"amount": 250})

    assert server.state.dropped == 2
    assert result.status_code == 201
    assert result.replayed
    assert isinstance(result.outcomes[0], str)  # the first attempt ended in a transport error
    assert result.attempts == len(server.state.requests()) >= 3
    assert result.key is not None
    assert_one_key_throughout(server.state, result.key)
    assert server.state.effects == {result.key: 1}
    assert result.json()["key"] == result.key


@pytest.mark.slow
def test_a_lost_request_is_sent_again(server: MisbehavingServer, flavour: str) -> None:
    server.state.connection_plans.extend(["refuse", "refuse"])
    result = call(flavour, server.proxy_url, "PATCH", "/charges", json={"amount": 5})

    assert result.status_code == 201
    assert not result.replayed  # the server never saw the lost attempts
    assert result.attempts == 3
    assert len(server.state.requests()) == 1
    assert result.key is not None
    assert_one_key_throughout(server.state, result.key)
    assert server.state.effects == {result.key: 1}


@pytest.mark.slow
def test_timeout_then_in_progress_then_replay(server: MisbehavingServer, flavour: str) -> None:
    # The first attempt outlives the client's timeout; retries find it running (409) until it ends, then replay.
    patient = Retry(attempts=50, deadline=20.0, backoff=0.01, max_backoff=0.05)  # 409s until the first run ends
    result = call(
        flavour, server.url, "POST", "/charges?hold=2", json={"amount": 7}, retry=patient, client={"timeout": 0.5}
    )

    assert result.outcomes[0] == "ReadTimeout"
    assert result.status_code == 201
    assert result.replayed
    assert result.key is not None
    assert server.state.answered(result.key, 409) >= 2
    assert server.state.runs[result.key] == 1
    assert server.state.effects == {result.key: 1}
    assert_one_key_throughout(server.state, result.key)


# -- final answers ------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "canned",
    [
        Canned(400, {}),
        Canned(401, {}),
        Canned(404, {}),
        canned_problem(problems.response_not_replayable(201, 2048, 1024)),  # a 409 that is not "in progress"
        canned_problem(problems.key_reused()),
    ],
    ids=["400", "401", "404", "409-not-replayable", "422"],
)
def test_final_errors_are_not_retried(server: MisbehavingServer, flavour: str, canned: Canned) -> None:
    server.state.script("/charges", canned)
    result = call(flavour, server.url, "POST", "/charges", json={"amount": 1})

    assert result.status_code == canned.status
    assert result.attempts == 1 == len(server.state.requests())
    assert not server.state.effects


@pytest.mark.slow
def test_a_reused_key_gets_422_once(server: MisbehavingServer, flavour: str) -> None:
    key = f"order-{uuid.uuid4()}"
    first = call(flavour, server.url, "POST", "/charges", json={"amount": 1}, idempotency_key=key)
    second = call(flavour, server.url, "POST", "/charges", json={"amount": 2}, idempotency_key=key)

    assert first.status_code == 201
    assert second.status_code == 422
    assert second.json()["code"] == "idempotency_key_reused"
    assert second.attempts == 1
    assert second.key == key
    assert server.state.effects == {key: 1}


@pytest.mark.slow
def test_a_handler_400_is_final(server: MisbehavingServer, flavour: str) -> None:
    result = call(flavour, server.url, "POST", "/charges?bad=1", json={})

    assert result.status_code == 400
    assert result.attempts == 1
    assert len(server.state.requests()) == 1


# -- giving up, and coming back -----------------------------------------------------------------------------


@pytest.mark.slow
def test_exhausted_retries_carry_the_key_to_resume_later(server: MisbehavingServer, flavour: str) -> None:
    # Every answer is lost: the charge happened on the first attempt but the client never learns it.
    server.state.connection_plans.extend(["close"] * 3)
    retry = Retry(attempts=3, deadline=20.0, backoff=0.01, max_backoff=0.05)
    with pytest.raises(RetriesExhausted) as caught:
        call(flavour, server.proxy_url, "POST", "/charges", json={"amount": 900}, retry=retry)
    error = caught.value

    assert error.reason == "attempts"
    assert error.attempts == 3
    assert error.last_response is None
    assert isinstance(error.last_error, httpx.TransportError)
    assert error.key is not None
    assert error.key in str(error)
    assert server.state.effects == {error.key: 1}

    later = call(flavour, server.proxy_url, "POST", "/charges", json={"amount": 900}, idempotency_key=error.key)
    assert later.status_code == 201
    assert later.replayed
    assert later.key == error.key
    assert server.state.effects == {error.key: 1}
    assert_one_key_throughout(server.state, error.key)


@pytest.mark.slow
def test_exhausted_on_responses_keeps_the_last_one(server: MisbehavingServer, flavour: str) -> None:
    server.state.script("/charges", *[canned_problem(problems.store_unavailable(0))] * 3)
    retry = Retry(attempts=3, deadline=20.0, backoff=0.01, max_backoff=0.05)
    with pytest.raises(RetriesExhausted) as caught:
        call(flavour, server.url, "POST", "/charges", json={"amount": 3}, retry=retry)

    error = caught.value
    assert error.outcomes == (503, 503, 503)
    assert error.last_error is None
    assert error.last_response is not None
    assert error.last_response.json()["code"] == "idempotency_store_unavailable"
    assert error.key is not None
    assert_one_key_throughout(server.state, error.key)
    assert not server.state.effects


@pytest.mark.slow
def test_no_attempt_starts_when_the_wait_would_pass_the_deadline(server: MisbehavingServer, flavour: str) -> None:
    server.state.script("/charges", *[Canned(503, {"retry-after": "60"})] * 5)
    retry = Retry(attempts=10, deadline=2.0, backoff=0.01, max_backoff=120.0)
    with pytest.raises(RetriesExhausted) as caught:
        call(flavour, server.url, "POST", "/charges", json={"amount": 3}, retry=retry)

    assert caught.value.reason == "deadline"
    assert caught.value.attempts == 1 == len(server.state.requests())


@pytest.mark.slow
def test_the_deadline_caps_an_attempt_timeout(server: MisbehavingServer, flavour: str) -> None:
    # The handler holds until the test ends; the client's own timeout (60 s) is longer than the deadline.
    retry = Retry(attempts=10, deadline=0.5, backoff=0.01, max_backoff=0.05)
    with pytest.raises(RetriesExhausted) as caught:
        call(flavour, server.url, "POST", "/charges?hold=99", json={}, retry=retry, client={"timeout": 60.0})

    assert caught.value.reason == "deadline"
    assert caught.value.attempts == 1
    assert isinstance(caught.value.last_error, httpx.ReadTimeout)


def test_connect_errors_are_retried(flavour: str, dead_url: str) -> None:
    retry = Retry(attempts=3, deadline=20.0, backoff=0.01, max_backoff=0.05)
    with pytest.raises(RetriesExhausted) as caught:
        call(flavour, dead_url, "POST", "/charges", json={}, retry=retry)

    assert caught.value.outcomes == ("ConnectError",) * 3
    assert isinstance(caught.value.last_error, httpx.ConnectError)
    assert caught.value.key is not None


# -- which requests carry a key -----------------------------------------------------------------------------


@pytest.mark.slow
def test_each_logical_call_gets_its_own_key(server: MisbehavingServer, flavour: str) -> None:
    first = call(flavour, server.url, "POST", "/charges", json={"amount": 1})
    second = call(flavour, server.url, "POST", "/charges", json={"amount": 1})

    assert first.key is not None
    assert second.key is not None
    assert first.key != second.key
    assert str(uuid.UUID(first.key)) == first.key  # a fresh uuid4 per logical call
    assert server.state.effects == {first.key: 1, second.key: 1}


@pytest.mark.slow
def test_a_caller_key_is_sent_as_is(server: MisbehavingServer, flavour: str) -> None:
    key = f"order:42/payment~{uuid.uuid4()}"
    server.state.script("/charges", Canned(503, {}))
    result = call(flavour, server.url, "POST", "/charges", json={"amount": 1}, idempotency_key=key)

    assert result.key == key
    assert result.attempts == 2
    assert_one_key_throughout(server.state, key)


@pytest.mark.slow
def test_reads_carry_no_key_and_are_retried(server: MisbehavingServer, flavour: str) -> None:
    server.state.script("/items", Canned(503, {}))
    result = call(flavour, server.url, "GET", "/items")

    assert result.status_code == 200
    assert result.key is None
    assert result.attempts == 2
    assert_one_key_throughout(server.state, None, "/items")


@pytest.mark.slow
def test_put_and_delete_carry_a_key_only_when_given(server: MisbehavingServer, flavour: str) -> None:
    put_key, delete_key = f"put-{uuid.uuid4()}", f"delete-{uuid.uuid4()}"  # the database outlives the test
    plain = call(flavour, server.url, "PUT", "/charges", json={"amount": 1})
    keyed = call(flavour, server.url, "PUT", "/charges", json={"amount": 1}, idempotency_key=put_key)
    deleted = call(flavour, server.url, "DELETE", "/charges", idempotency_key=delete_key)
    again = call(flavour, server.url, "DELETE", "/charges", idempotency_key=delete_key)

    assert plain.key is None
    assert (keyed.key, deleted.key) == (put_key, delete_key)
    assert again.replayed
    assert server.state.keys_seen() == [(), (put_key,), (delete_key,), (delete_key,)]
    assert server.state.effects == {"-": 1, put_key: 1, delete_key: 1}


@pytest.mark.slow
def test_a_multipart_upload_is_resent_byte_for_byte(server: MisbehavingServer, flavour: str) -> None:
    # The multipart boundary is random per build: a rebuilt request would fingerprint differently (422).
    server.state.connection_plans.append("close")
    files = {"receipt": ("receipt.txt", b"paid in full\n", "text/plain")}
    result = call(flavour, server.proxy_url, "POST", "/charges", data={"amount": "10"}, files=files)

    assert result.status_code == 201
    assert result.replayed
    assert result.key is not None
    assert server.state.effects == {result.key: 1}


# -- refused before anything is sent (to an address where a sent request would fail differently) ----------


@pytest.mark.parametrize("key", ["", "a b", "a,b", "caf\u00e9", "tab\there", "k" * 256])
def test_invalid_caller_keys_are_refused(flavour: str, dead_url: str, key: str) -> None:
    with pytest.raises(ValueError, match="idempotency key"):
        call(flavour, dead_url, "POST", "/charges", json={}, idempotency_key=key)


@pytest.mark.parametrize("key", ['"abc"', '"a', '"a\\"b"', " abc", "abc\t"])
def test_keys_the_server_would_read_differently_are_refused(flavour: str, dead_url: str, key: str) -> None:
    # '"abc"' is the sf-string abc to the server (it would collide with the key abc); '"a' is a 400 there.
    with pytest.raises(ValueError, match="idempotency key"):
        call(flavour, dead_url, "POST", "/charges", json={}, idempotency_key=key)


@given(
    st.text(st.sampled_from('a"\\, \t~\x7f'), max_size=8)  # the characters that matter, often
    | st.text(st.characters(min_codepoint=0, max_codepoint=0x7F), max_size=300)
)
def test_the_client_accepts_exactly_the_keys_the_server_reads_back(key: str) -> None:
    try:
        server_reads: str | None = parse_key(key.encode())
    except InvalidKey:
        server_reads = None
    if server_reads == key:
        assert validate_key(key) == key
    else:
        with pytest.raises(ValueError, match="idempotency key"):
            validate_key(key)


def test_a_key_in_headers_is_refused(flavour: str, dead_url: str) -> None:
    with pytest.raises(ValueError, match="idempotency_key="):
        call(flavour, dead_url, "POST", "/charges", json={}, headers={"idempotency-key": "k1"})
    with pytest.raises(ValueError, match="idempotency_key="):
        call(flavour, dead_url, "POST", "/charges", json={}, client={"headers": {"Idempotency-Key": "k1"}})
    with pytest.raises(ValueError, match="carries no Idempotency-Key"):
        call(flavour, dead_url, "GET", "/items", idempotency_key="k1")


def test_a_key_added_to_the_client_headers_later_is_refused(dead_url: str) -> None:
    with IdempotentClient(base_url=dead_url) as client:
        client._http.headers["Idempotency-Key"] = "fixed"  # what a careless caller could do to the httpx client
        with pytest.raises(ValueError, match="already has an Idempotency-Key"):
            client.post("/charges", json={})


def test_a_hook_that_rewrites_the_key_stops_the_retries(dead_url: str) -> None:
    def rotate(request: httpx.Request) -> None:  # the key-rotation bug, smuggled in through an httpx event hook
        request.headers["Idempotency-Key"] = str(uuid.uuid4())

    with (
        IdempotentClient(base_url=dead_url, event_hooks={"request": [rotate]}) as client,
        pytest.raises(RuntimeError, match="changed between attempts"),
    ):
        client.post("/charges", json={})


def test_a_streaming_body_is_refused(dead_url: str) -> None:
    with IdempotentClient(base_url=dead_url) as client, pytest.raises(ValueError, match="streaming request body"):
        client.post("/charges", content=iter([b"one", b"two"]))

    async def run() -> None:
        async def chunks() -> AsyncIterator[bytes]:
            yield b"one"

        async with AsyncIdempotentClient(base_url=dead_url) as client:
            with pytest.raises(ValueError, match="streaming request body"):
                await client.post("/charges", content=chunks())

    asyncio.run(run())


# -- many calls at once over a lossy path -------------------------------------------------------------------


@pytest.mark.slow
async def test_concurrent_calls_over_a_lossy_path(server: MisbehavingServer) -> None:
    server.state.connection_plan = lambda number: ("close", None, None, "reset", None, None)[number % 6]
    patient = Retry(attempts=30, deadline=20.0, backoff=0.01, max_backoff=0.05)  # a call may be unlucky twice
    async with AsyncIdempotentClient(base_url=server.proxy_url, retry=patient, headers=AUTH) as client:
        results = await asyncio.gather(*(client.post("/charges", json={"amount": n}) for n in range(20)))

    keys = [r.key for r in results]
    assert len(set(keys)) == 20
    assert all(r.status_code == 201 for r in results)
    assert server.state.dropped >= 2
    assert any(r.replayed for r in results)
    assert server.state.effects == dict.fromkeys(keys, 1)
    assert all(len(seen) == 1 and seen[0] in server.state.effects for seen in server.state.keys_seen())
    assert sum(r.attempts for r in results) >= len(server.state.requests())


# -- the policy's arithmetic --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [{"attempts": 0}, {"attempts": 1.5}, {"deadline": 0}, {"backoff": -1}, {"backoff": 2, "max_backoff": 1}],
)
def test_retry_settings_are_checked(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="Retry"):
        Retry(**options)


def test_backoff_grows_with_full_jitter_under_its_cap() -> None:
    retry = Retry(backoff=0.1, max_backoff=1.0)
    assert [retry.delay(n, rand=lambda: 1.0) for n in (1, 2, 3, 4, 5, 50)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert retry.delay(3, rand=lambda: 0.0) == 0.0
    assert retry.delay(1, retry_after=0.5, rand=lambda: 0.0) == 0.5  # the server asked for at least this


def test_retry_after_is_honoured_past_max_backoff() -> None:
    retry = Retry(backoff=0.1, max_backoff=1.0)
    assert retry.delay(1, retry_after=30.0, rand=lambda: 1.0) == 30.0  # the deadline, not max_backoff, limits it


# -- on a fake clock: the retry budget against the server's timing ------------------------------------------


class FakeTime:
    """The client module's clock and sleeps, moved by hand: nothing waits for real."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1_700_000_000.0 + self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    async def async_sleep(self, seconds: float) -> None:
        self.sleep(seconds)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(client_module, "time", fake)
    monkeypatch.setattr(client_module, "asyncio", SimpleNamespace(sleep=fake.async_sleep))
    return fake


def jitter(monkeypatch: pytest.MonkeyPatch, draw: float) -> None:
    """Every jitter draw returns ``draw``: 0.0 gives the shortest waits (most attempts), ~1.0 the longest."""
    monkeypatch.setattr(client_module, "random", SimpleNamespace(random=lambda: draw))


def fake_call(
    flavour: str, handler: Callable[[httpx.Request], httpx.Response], retry: Retry | None = None, **client: Any
) -> Any:
    """One POST through a client whose transport is ``handler``; the default Retry unless one is given, and the
    client's other options (``client``)."""
    options: dict[str, Any] = {"transport": httpx.MockTransport(handler), **client}
    if retry is not None:
        options["retry"] = retry
    if flavour == "sync":
        with IdempotentClient(base_url="http://api.test", **options) as sync_client:
            return sync_client.post("/charges", json={"amount": 1})

    async def run() -> IdempotentResult:
        async with AsyncIdempotentClient(base_url="http://api.test", **options) as async_client:
            return await async_client.post("/charges", json={"amount": 1})

    return asyncio.run(run())


DEFAULT_LEASE = 30.0  # the middleware's default lease: how long a crashed server's key stays in progress


@pytest.mark.parametrize("draw", [0.0, 0.999], ids=["shortest-waits", "longest-waits"])
@pytest.mark.parametrize("held_for", [DEFAULT_LEASE, 1.5 * DEFAULT_LEASE], ids=["one-lease", "lease-and-a-half"])
def test_the_default_retry_outlasts_a_crashed_servers_lease(
    flavour: str, clock: FakeTime, monkeypatch: pytest.MonkeyPatch, draw: float, held_for: float
) -> None:
    # The first attempt reaches the handler, the server dies: the client times out after its 5 s. The restarted
    # server answers 409 "in progress" (Retry-After: 1) until the dead claim's lease lapses, then runs it.
    jitter(monkeypatch, draw)
    seen: list[float] = []

    def server(request: httpx.Request) -> httpx.Response:
        seen.append(clock.now)
        if len(seen) == 1:
            clock.now += 5.0
            raise httpx.ReadTimeout("the server died mid-request", request=request)
        if clock.now < 5.0 + held_for:
            return in_progress_409()
        return httpx.Response(201, json={"id": "ch_1"})

    result = fake_call(flavour, server)

    assert result.status_code == 201
    assert result.outcomes[0] == "ReadTimeout"
    assert set(result.outcomes[1:-1]) == {409}
    gaps = [later - earlier for earlier, later in itertools.pairwise(seen[1:])]  # between the 409s
    assert min(gaps) >= 1.0  # never sooner than the server asked: no hammering
    assert len(seen) <= 2 + held_for  # at most one attempt a second while the key is held


def test_a_long_retry_after_is_waited_out_in_full(
    flavour: str, clock: FakeTime, monkeypatch: pytest.MonkeyPatch
) -> None:
    jitter(monkeypatch, 1.0)
    answers = iter([httpx.Response(429, headers={"retry-after": "10"}), httpx.Response(201)])
    result = fake_call(flavour, lambda request: next(answers), Retry(max_backoff=5.0))

    assert result.status_code == 201
    assert clock.sleeps == [10.0]  # what the server asked for, not max_backoff


def test_a_retry_after_past_the_deadline_ends_the_call(
    flavour: str, clock: FakeTime, monkeypatch: pytest.MonkeyPatch
) -> None:
    jitter(monkeypatch, 1.0)
    attempts: list[float] = []

    def server(request: httpx.Request) -> httpx.Response:
        attempts.append(clock.now)
        return httpx.Response(503, headers={"retry-after": "25"})

    with pytest.raises(RetriesExhausted) as caught:
        fake_call(flavour, server, Retry(deadline=60.0))

    assert caught.value.reason == "deadline"
    assert attempts == [0.0, 25.0, 50.0]  # the next wait would end at 75 s, past the deadline: no sleep, no attempt
    assert clock.sleeps == [25.0, 25.0]
    assert caught.value.last_response is not None
    assert caught.value.last_response.status_code == 503


@pytest.mark.parametrize(
    "second",
    [
        lambda: httpx.UnsupportedProtocol("no such scheme"),
        lambda: httpx.DecodingError("garbled"),
        lambda: KeyError("bug"),
    ],
    ids=["unsupported-protocol", "decoding-error", "other-error"],
)
def test_an_error_raised_as_it_is_names_the_key_the_client_minted(
    flavour: str, clock: FakeTime, second: Callable[[], Exception]
) -> None:
    """After an attempt that may have run (a read timeout), the call ends in an error the client raises as it is:
    the key it minted is in the error's notes, so that whoever reads it can resume the call with that key rather
    than run the operation again under another."""
    keys: list[str] = []

    def server(request: httpx.Request) -> httpx.Response:
        keys.append(request.headers["idempotency-key"])
        if len(keys) == 1:
            raise httpx.ReadTimeout("the answer was lost", request=request)
        raise second()

    with pytest.raises((httpx.RequestError, KeyError)) as caught:
        fake_call(flavour, server)

    assert len(keys) == 2
    assert keys[0] == keys[1]
    assert caught.value.__notes__ == [
        f"Idempotency-Key of this call: {keys[0]} (an attempt may have taken effect: resume with "
        f"idempotency_key={keys[0]!r}, not a new key)"
    ]


@pytest.mark.parametrize(
    ("first", "note"),
    [
        (httpx.ConnectError, "no attempt reached the server: nothing took effect under it"),
        (httpx.ReadTimeout, "an attempt may have taken effect: resume with idempotency_key={key!r}, not a new key"),
    ],
    ids=["never-left", "may-have-run"],
)
def test_a_call_stopped_between_attempts_says_whether_one_may_have_run(
    flavour: str, clock: FakeTime, monkeypatch: pytest.MonkeyPatch, first: type[httpx.TransportError], note: str
) -> None:
    """The call is stopped (Ctrl-C, a cancellation) while it waits to retry. Its note names the key either way, but
    says that an attempt may have taken effect only when one may have: a connection refused never carried the
    request, and saying otherwise sends whoever reads it looking for an operation that never reached the server."""
    keys: list[str] = []
    stop = KeyboardInterrupt() if flavour == "sync" else asyncio.CancelledError()

    def server(request: httpx.Request) -> httpx.Response:
        keys.append(request.headers["idempotency-key"])
        raise first("lost", request=request)

    def stopped(seconds: float) -> None:
        raise stop

    monkeypatch.setattr(clock, "sleep", stopped)
    with pytest.raises(type(stop)) as caught:
        fake_call(flavour, server)

    assert len(keys) == 1
    assert caught.value.__notes__ == [f"Idempotency-Key of this call: {keys[0]} ({note.format(key=keys[0])})"]


@pytest.mark.parametrize("status", [303, 307])
def test_a_connection_refused_on_a_redirect_does_not_hide_the_attempt_that_ran(
    flavour: str, clock: FakeTime, monkeypatch: pytest.MonkeyPatch, status: int
) -> None:
    """Following redirects, the server took the charge and sent the client elsewhere (a receipt's host), which
    refused the connection; the call is then stopped while it waits to retry. The refused connection was a later
    hop's, not the attempt's: the attempt reached the server, and the note says it may have taken effect."""
    charged: list[str] = []
    stop = KeyboardInterrupt() if flavour == "sync" else asyncio.CancelledError()

    def server(request: httpx.Request) -> httpx.Response:
        if request.url.host == "api.test":
            charged.append(request.headers["idempotency-key"])
            return httpx.Response(status, headers={"location": "http://receipts.test/r/1"})
        raise httpx.ConnectError("connection refused", request=request)

    def stopped(seconds: float) -> None:
        raise stop

    monkeypatch.setattr(clock, "sleep", stopped)
    with pytest.raises(type(stop)) as caught:
        fake_call(flavour, server, follow_redirects=True)
    assert len(charged) == 1
    assert caught.value.__notes__ == [
        f"Idempotency-Key of this call: {charged[0]} (an attempt may have taken effect: resume with "
        f"idempotency_key={charged[0]!r}, not a new key)"
    ]


async def test_a_cancelled_call_names_the_key_the_client_minted() -> None:
    """A call cancelled while its first attempt is out (an outer timeout): the attempt may run on the server, so the
    cancellation carries the key, as an error the client raises as it is does."""
    keys: list[str] = []
    arrived = asyncio.Event()

    async def server(request: httpx.Request) -> httpx.Response:
        keys.append(request.headers["idempotency-key"])
        arrived.set()
        await asyncio.sleep(60)  # the handler is slow: the caller's timeout comes first
        return httpx.Response(201)

    async with AsyncIdempotentClient(base_url="http://api.test", transport=httpx.MockTransport(server)) as client:
        call = asyncio.ensure_future(client.post("/charges", json={"amount": 1}))
        await arrived.wait()
        call.cancel()
        with pytest.raises(asyncio.CancelledError) as caught:
            await call
    assert caught.value.__notes__ == [
        f"Idempotency-Key of this call: {keys[0]} (an attempt may have taken effect: resume with "
        f"idempotency_key={keys[0]!r}, not a new key)"
    ]


def in_progress_409() -> httpx.Response:
    return httpx.Response(
        409,
        headers={"retry-after": "1", "content-type": "application/problem+json"},
        content=problems.in_progress(1).body(),
    )


def test_retry_after_reads_seconds_and_http_dates() -> None:
    now = 1_700_000_000.0  # 2023-11-14T22:13:20Z
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(" 0 ") == 0.0
    assert parse_retry_after("Tue, 14 Nov 2023 22:13:50 GMT", now=now) == 30.0
    assert parse_retry_after("Tue, 14 Nov 2023 22:00:00 GMT", now=now) == 0.0
    assert parse_retry_after("-1") is None
    assert parse_retry_after("soon") is None
    assert parse_retry_after(None) is None


async def test_client_survives_an_unreadable_retry_after_date() -> None:
    """A ``Retry-After`` date the client cannot read (here a zone offset with too many digits, on which
    ``email.utils.parsedate_to_datetime`` raises OverflowError) is ignored as unreadable, as ``parse_retry_after``
    promises: the call retries and succeeds instead of dying with an error from a header a proxy sent."""
    answers = iter(
        [
            httpx.Response(503, headers={"retry-after": "Mon, 01 Jan 2024 00:00:00 +99999999999999999999"}),
            httpx.Response(201, json={"charged": True}),
        ]
    )
    transport = httpx.MockTransport(lambda request: next(answers))
    async with AsyncIdempotentClient(
        "http://test", transport=transport, retry=Retry(backoff=0.0, max_backoff=0.0)
    ) as client:
        result = await client.post("/charges", json={"amount": 100})
    assert result.status_code == 201


# -- the middleware's answers in an app's own envelope --------------------------------------------------------


def app_envelope(problem: problems.Problem, scope: Scope) -> Response:
    """An app's envelope whose ``code`` is its own ("conflict"): only the ``Idempotency-Problem`` header tells."""
    body = {"error": {"code": "conflict", "message": problem.detail}}
    return JSONResponse(body, status_code=problem.status)


ENVELOPES = {
    "problem+json, reused 422": {},
    "the app's envelope, reused 409": {"problem_renderer": app_envelope, "reused_key_status": 409},
}


@pytest.mark.parametrize("options", ENVELOPES.values(), ids=list(ENVELOPES))
async def test_the_client_reads_the_middlewares_code_from_any_envelope(
    store_and_mode: tuple[Any, bool], options: dict[str, Any]
) -> None:
    """Against an app that renders the middleware's answers its own way, with the status of a reused key changed, the
    client works as against the default: it retries an in-progress key (to its replay), does not retry a reused one,
    and tells its code."""
    store, transactional = store_and_mode
    entered, release = asyncio.Event(), asyncio.Event()
    runs: Counter[str] = Counter()

    async def charge(request: Request) -> Response:
        runs[request.headers["idempotency-key"]] += 1
        entered.set()
        await release.wait()
        return JSONResponse({"id": "ch_1"}, status_code=201)

    def heard(event: Event) -> None:
        if event.outcome is Outcome.IN_PROGRESS:  # the retry met the running original: let it finish
            release.set()

    app = Starlette(routes=[Route("/charges", charge, methods=["POST"])])
    app.add_middleware(
        IdempotencyMiddleware, store=store, transactional=transactional, retry_after=0, on_event=heard, **options
    )
    transport = httpx.ASGITransport(app=app)
    async with AsyncIdempotentClient("http://test", transport=transport, headers=AUTH, retry=FAST) as client:
        key = str(uuid.uuid4())
        original = asyncio.create_task(client.post("/charges", json={"amount": 1}, idempotency_key=key))
        await entered.wait()
        retried = await client.post("/charges", json={"amount": 1}, idempotency_key=key)
        assert (await original).status_code == 201
        reused = await client.post("/charges", json={"amount": 2}, idempotency_key=key)
    assert retried.outcomes[0] == 409
    assert (retried.status_code, retried.replayed, retried.problem_code) == (201, True, None)
    assert reused.outcomes == (options.get("reused_key_status", 422),)  # one attempt: not retried
    assert reused.problem_code == "idempotency_key_reused"
    assert runs == Counter({key: 1})


def test_the_problem_header_decides_over_the_body_and_retry_after() -> None:
    request = httpx.Request("POST", "http://test/charges")

    def answer(status: int, headers: dict[str, str], body: dict[str, Any] | None = None) -> httpx.Response:
        return httpx.Response(status, headers=headers, json=body or {"error": {"code": "conflict"}}, request=request)

    running = answer(409, {"idempotency-problem": IN_PROGRESS})  # no Retry-After (a proxy dropped it)
    reused = answer(409, {"idempotency-problem": "idempotency_key_reused", "retry-after": "1"})
    assert client_module.should_retry(running)
    assert not client_module.should_retry(reused)
    assert client_module.problem_code(reused) == "idempotency_key_reused"  # not the envelope's "conflict"
    older = answer(409, {"retry-after": "1"}, {"code": IN_PROGRESS})  # a server without the header
    assert client_module.should_retry(older)
    assert client_module.problem_code(older) == IN_PROGRESS
    assert client_module.problem_code(answer(409, {})) == "conflict"  # Stripe's envelope
    assert client_module.problem_code(httpx.Response(201, json={"code": "SPRING24"}, request=request)) is None
