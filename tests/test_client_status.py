"""The retrying client and a key's status: ``key_status(key)``, and ``AskFirst``, which asks the app's status route
(``key_status_route``) instead of resending a large body whose fate is unknown.

On a fake transport and a fake clock first (every decision, nothing waits), then against a real app on
PostgreSQL through uvicorn on loopback, counting the bytes the server received (``slow``)."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import unquote

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from idempotency_mw import IdempotencyMiddleware, PostgresStore, key_status_route
from idempotency_mw import _problems as problems
from idempotency_mw import client as client_module
from idempotency_mw.client import (
    AskFirst,
    AsyncIdempotentClient,
    IdempotentClient,
    IdempotentResult,
    KeyStatus,
    Retry,
)
from tests.test_client import AUTH, FakeTime, MisbehavingServer, ServerState, recording_layer
from tests.test_docs import recipe

BIG = b"x" * 100_000  # over AskFirst's default 64 KiB
FAST = Retry(attempts=30, deadline=30.0, backoff=0.01, max_backoff=0.05)


def status_answer(key: str, state: str, status: int | None = None) -> httpx.Response:
    seen = "2026-01-01T00:00:00+00:00" if state != "absent" else None
    expires = "2026-01-02T00:00:00+00:00" if state != "absent" else None
    body = {"key": key, "state": state, "status": status, "first_seen": seen, "expires": expires}
    return httpx.Response(200, json=body, headers={"cache-control": "no-store"})


class FakeApp:
    """A server on a fake transport: the writes to /uploads answer as ``writes`` says in turn (a status, or an
    exception to raise), the status route as ``states`` says (a state, or a status code); what it was sent, kept."""

    def __init__(self, writes: list[int | type[httpx.TransportError]], states: list[str | int]) -> None:
        self.writes = list(writes)
        self.states = list(states)
        self.sent: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request)
        if request.method == "GET":
            key = unquote(request.url.raw_path.decode().rsplit("/", 1)[1])
            state = self.states.pop(0)
            return status_answer(key, state) if isinstance(state, str) else httpx.Response(state)
        answer = self.writes.pop(0)
        if isinstance(answer, type):
            raise answer("the answer was lost", request=request)
        if answer == 409:
            return httpx.Response(
                409, headers={"retry-after": "1", "content-type": "application/problem+json"},
                content=problems.in_progress(1).body(),
            )  # fmt: skip
        replayed = {"idempotent-replayed": "true"} if len(self.sent) > 1 else {}
        return httpx.Response(answer, json={"id": "up_1"}, headers=replayed)

    def posted(self) -> list[httpx.Request]:
        return [request for request in self.sent if request.method == "POST"]

    def asked(self) -> list[httpx.Request]:
        return [request for request in self.sent if request.method == "GET"]


def post(
    flavour: str, app: Callable[[httpx.Request], httpx.Response], body: bytes = BIG, calls: int = 1, **options: Any
) -> list[IdempotentResult]:
    """``calls`` POSTs of ``body`` to /uploads through one client with ``options``, on ``app``."""
    options = {"retry": FAST, "ask_first": AskFirst(), "headers": AUTH, **options}
    transport = httpx.MockTransport(app)
    if flavour == "sync":
        with IdempotentClient("http://api.test", transport=transport, **options) as sync_client:
            return [sync_client.post("/uploads", content=body) for _ in range(calls)]

    async def run() -> list[IdempotentResult]:
        async with AsyncIdempotentClient("http://api.test", transport=httpx.MockTransport(app), **options) as client:
            return [await client.post("/uploads", content=body) for _ in range(calls)]

    return asyncio.run(run())


@pytest.fixture(params=["sync", "async"])
def flavour(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(client_module, "time", fake)
    monkeypatch.setattr(client_module, "asyncio", SimpleNamespace(sleep=fake.async_sleep))
    return fake


# -- asking instead of resending ------------------------------------------------------------------------------


def test_a_large_body_is_not_resent_while_its_request_runs(flavour: str, clock: FakeTime) -> None:
    app = FakeApp([httpx.ReadTimeout, 201], ["in_progress", "in_progress", "completed"])
    (result,) = post(flavour, app)
    assert (result.status_code, result.replayed) == (201, True)
    assert result.asked == ("in_progress", "in_progress", "completed")
    assert result.outcomes == ("ReadTimeout", 201)
    assert len(app.posted()) == 2  # sent, then resent once to get its replay: never while it ran
    key = result.key
    assert key is not None
    assert [request.url.path for request in app.asked()] == [f"/idempotency-keys/{key}"] * 3
    assert all(request.headers["authorization"] == AUTH["Authorization"] for request in app.asked())
    assert all(request.content == b"" and "idempotency-key" not in request.headers for request in app.asked())


def test_a_409_in_progress_is_asked_about_not_answered_with_the_body(flavour: str, clock: FakeTime) -> None:
    app = FakeApp([409, 201], ["in_progress", "completed"])
    (result,) = post(flavour, app)
    assert (result.outcomes, result.asked) == ((409, 201), ("in_progress", "completed"))
    assert clock.sleeps[0] >= 1.0  # the 409's Retry-After, before the first question


def test_an_absent_key_is_sent_again(flavour: str, clock: FakeTime) -> None:
    """Nothing took effect (the request never arrived whole, or it failed and freed its key): resend."""
    app = FakeApp([httpx.WriteError, 201], ["absent"])
    (result,) = post(flavour, app)
    assert (result.status_code, result.asked, len(app.posted())) == (201, ("absent",), 2)


def test_a_status_route_that_cannot_answer_for_now_is_asked_again(flavour: str, clock: FakeTime) -> None:
    app = FakeApp([httpx.ReadTimeout, 201], [503, "completed"])
    (result,) = post(flavour, app)
    assert result.asked == (503, "completed")
    assert len(app.posted()) == 2


def test_without_the_route_the_client_resends_and_asks_no_more(flavour: str, clock: FakeTime) -> None:
    """A 404 from the status path: the app did not mount it. The body is resent as without AskFirst, and the client
    remembers: its next calls do not ask."""
    app = FakeApp([httpx.ReadTimeout, 409, 201, httpx.ReadTimeout, 201], [404])
    first, second = post(flavour, app, calls=2)
    assert (first.asked, first.outcomes) == ((404,), ("ReadTimeout", 409, 201))
    assert (second.asked, second.outcomes) == ((), ("ReadTimeout", 201))
    assert len(app.asked()) == 1


def test_a_status_it_cannot_have_is_not_asked_again_in_that_call(flavour: str, clock: FakeTime) -> None:
    """Any other refusal (400: the route reads the tenant from other credentials) ends the questions of that call."""
    app = FakeApp([httpx.ReadTimeout, 409, 201], [400])
    (result,) = post(flavour, app)
    assert (result.asked, result.outcomes) == ((400,), ("ReadTimeout", 409, 201))


@pytest.mark.parametrize(
    ("body", "error", "options"),
    [
        (b"x" * 1000, httpx.ReadTimeout, {}),  # a small body is cheaper to resend than to ask about
        (BIG, httpx.ConnectError, {}),  # never sent: nothing to ask about
        (BIG, httpx.ReadTimeout, {"ask_first": None}),  # not asked for
    ],
    ids=["small-body", "not-sent", "off"],
)
def test_otherwise_the_body_is_resent_without_asking(
    flavour: str, clock: FakeTime, body: bytes, error: type[httpx.TransportError], options: dict[str, Any]
) -> None:
    app = FakeApp([error, 201], [])
    (result,) = post(flavour, app, body=body, **options)
    assert (result.status_code, result.asked, len(app.posted()), app.asked()) == (201, (), 2, [])


def test_questions_count_against_the_attempts(flavour: str, clock: FakeTime) -> None:
    from idempotency_mw.client import RetriesExhausted

    app = FakeApp([httpx.ReadTimeout], ["in_progress"] * 10)
    with pytest.raises(RetriesExhausted) as caught:
        post(flavour, app, retry=Retry(attempts=4, deadline=60, backoff=0.01, max_backoff=0.05))
    assert (caught.value.reason, caught.value.attempts, len(app.asked())) == ("attempts", 1, 3)
    assert isinstance(caught.value.last_error, httpx.ReadTimeout)  # the last attempt's outcome, not a question's


@pytest.mark.parametrize("state", ["completed", "absent", 404, 400])
def test_the_resend_after_a_question_counts_against_the_attempts(
    flavour: str, clock: FakeTime, state: str | int
) -> None:
    """Two HTTP requests in all: the attempt and the question. The resend the answer calls for would be the third."""
    from idempotency_mw.client import RetriesExhausted

    app = FakeApp([httpx.ReadTimeout, 201], [state])
    with pytest.raises(RetriesExhausted) as caught:
        post(flavour, app, retry=Retry(attempts=2, deadline=60, backoff=0.01, max_backoff=0.05))
    assert (caught.value.reason, caught.value.attempts, len(app.sent)) == ("attempts", 1, 2)
    assert isinstance(caught.value.last_error, httpx.ReadTimeout)


def test_no_resend_starts_once_a_question_took_the_deadline(flavour: str, clock: FakeTime) -> None:
    from idempotency_mw.client import RetriesExhausted

    def slow_status(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            clock.now = 9.999  # the answer came in the deadline's last moment
        return app(request)

    app = FakeApp([httpx.ReadTimeout, 201], ["completed"])
    retry = Retry(attempts=10, deadline=10, backoff=0.01, max_backoff=0.05)
    with pytest.raises(RetriesExhausted) as caught:
        post(flavour, slow_status, retry=retry)
    assert (caught.value.reason, len(app.posted())) == ("deadline", 1)


def test_an_in_progress_answer_is_asked_again_after_its_retry_after(flavour: str, clock: FakeTime) -> None:
    def slow_down(request: httpx.Request) -> httpx.Response:
        answer = app(request)
        if request.method == "GET" and answer.json()["state"] == "in_progress":
            answer.headers["retry-after"] = "2"
        return answer

    app = FakeApp([httpx.ReadTimeout, 201], ["in_progress", "completed"])
    (result,) = post(flavour, slow_down)
    assert result.asked == ("in_progress", "completed")
    assert clock.sleeps[-1] >= 2.0  # the wait before the second question


@pytest.mark.parametrize("key", [".", ".."])
def test_a_key_of_dots_is_asked_about_under_its_own_path(clock: FakeTime, key: str) -> None:
    """httpx drops a path's dot segments: a key "." or ".." would ask the path above the status route."""
    app = FakeApp([httpx.ReadTimeout, 201], ["completed", "completed"])
    transport = httpx.MockTransport(app)
    with IdempotentClient(
        "http://api.test", transport=transport, retry=FAST, ask_first=AskFirst(), headers=AUTH
    ) as client:
        result = client.post("/uploads", content=BIG, idempotency_key=key)
        status = client.key_status(key)
    assert (result.asked, status.key) == (("completed",), key)
    assert [request.url.raw_path for request in app.asked()] == [b"/idempotency-keys/" + b"%2E" * len(key)] * 2


def test_a_key_with_reserved_characters_is_asked_about_percent_encoded(flavour: str, clock: FakeTime) -> None:
    app = FakeApp([httpx.ReadTimeout, 201], ["completed"])
    transport = httpx.MockTransport(app)
    with IdempotentClient(
        "http://api.test", transport=transport, retry=FAST, ask_first=AskFirst(), headers=AUTH
    ) as client:
        result = client.post("/uploads", content=BIG, idempotency_key="orders/7?#%")
    assert result.asked == ("completed",)
    assert app.asked()[0].url.raw_path == b"/idempotency-keys/orders%2F7%3F%23%25"


def test_ask_first_is_checked() -> None:
    with pytest.raises(ValueError, match="min_body"):
        AskFirst(min_body=-1)
    with pytest.raises(ValueError, match="min_body"):
        AskFirst(min_body=True)
    with pytest.raises(ValueError, match="\\{key\\}"):
        IdempotentClient("http://api.test", status_path="/idempotency-keys")


# -- key_status --------------------------------------------------------------------------------------------------


def test_key_status_reads_the_routes_answer(flavour: str) -> None:
    key = str(uuid.uuid4())

    def app(request: httpx.Request) -> httpx.Response:
        assert request.url.path == f"/v1/keys/{key}/status"
        return status_answer(key, "completed", 201)

    transport = httpx.MockTransport(app)
    if flavour == "sync":
        with IdempotentClient("http://api.test", transport=transport, status_path="/v1/keys/{key}/status") as client:
            status = client.key_status(key)
    else:

        async def run() -> KeyStatus:
            async with AsyncIdempotentClient(
                "http://api.test", transport=transport, status_path="/v1/keys/{key}/status"
            ) as client:
                return await client.key_status(key)

        status = asyncio.run(run())
    assert status == KeyStatus(
        key, "completed", 201, datetime(2026, 1, 1, tzinfo=UTC), datetime(2026, 1, 2, tzinfo=UTC)
    )


def test_key_status_raises_for_anything_but_a_status() -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(404))
    with IdempotentClient("http://api.test", transport=transport) as client, pytest.raises(httpx.HTTPStatusError):
        client.key_status("k")
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json={"state": "maybe"}))
    with IdempotentClient("http://api.test", transport=transport) as client, pytest.raises(ValueError, match="status"):
        client.key_status("k")
    with IdempotentClient("http://api.test", transport=transport) as client, pytest.raises(ValueError, match="key"):
        client.key_status("a,b")


@pytest.mark.parametrize("status", [201, 204, 302])
def test_key_status_raises_for_a_success_that_is_not_200(flavour: str, status: int) -> None:
    """Anything but a 200 is not the status route's answer (a catch-all route, a redirect to a login page): the
    status error that says which answer came, not a parse of whatever body it had."""
    transport = httpx.MockTransport(lambda request: httpx.Response(status, json={"state": "completed"}))

    async def ask() -> None:
        async with AsyncIdempotentClient("http://api.test", transport=transport) as client:
            await client.key_status("k")

    with (
        IdempotentClient("http://api.test", transport=transport) as client,
        pytest.raises(httpx.HTTPStatusError) as caught,
    ):
        client.key_status("k") if flavour == "sync" else asyncio.run(ask())
    assert caught.value.response.status_code == status


# -- against a real app on PostgreSQL ----------------------------------------------------------------------------


def uploads(mounted: bool, received: Counter[str]) -> Callable[[PostgresStore, ServerState], ASGIApp]:
    """An app whose ``POST /uploads?hold=1`` outlasts the client's timeout on its first run, until the server has
    answered two status questions or two 409s for its key; with ``key_status_route`` mounted or not. ``received``
    counts the body bytes each path was sent."""

    def build(store: PostgresStore, state: ServerState) -> ASGIApp:
        async def upload(request: Request) -> Response:
            key = request.headers["idempotency-key"]
            body = await request.body()
            with state.lock:
                state.runs[key] += 1
                first = state.runs[key] == 1
            for _ in range(1000 if first and request.query_params.get("hold") else 0):  # at most 10 s
                with state.lock:
                    asked = sum(1 for seen in state.seen if seen.method == "GET" and key in seen.path)
                if asked >= 2 or state.answered(key, 409) >= 2 or state.stop.is_set():
                    break
                await asyncio.sleep(0.01)
            with state.lock:
                state.effects[key] += 1
            return JSONResponse({"id": "up_1", "bytes": len(body)}, status_code=201)

        routes = [Route("/uploads", upload, methods=["POST"]), Route("/v1/uploads", upload, methods=["POST"])]
        app = Starlette(routes=[*routes, key_status_route(store)] if mounted else routes)
        app.add_middleware(IdempotencyMiddleware, store=store, retry_after=1, on_event=None)
        return counting(recording_layer(app, state), received)

    return build


def counting(app: ASGIApp, received: Counter[str]) -> ASGIApp:
    async def counted(scope: Scope, receive: Receive, send: Send) -> None:
        async def receive_counted() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                received[scope["path"]] += len(message.get("body", b""))
            return message

        await app(scope, receive_counted, send)

    return counted


def two_uploads(flavour: str, url: str) -> list[IdempotentResult]:
    """Two held uploads of BIG through one client that asks first."""
    options: dict[str, Any] = {"retry": FAST, "ask_first": AskFirst(), "headers": AUTH, "timeout": 0.5}
    if flavour == "sync":
        with IdempotentClient(url, **options) as sync_client:
            return [sync_client.post("/uploads?hold=1", content=BIG) for _ in range(2)]

    async def run() -> list[IdempotentResult]:
        async with AsyncIdempotentClient(url, **options) as client:
            return [await client.post("/uploads?hold=1", content=BIG) for _ in range(2)]

    return asyncio.run(run())


@pytest.fixture
def served(
    idempotency_database_url: str, request: pytest.FixtureRequest
) -> Iterator[tuple[MisbehavingServer, Counter[str]]]:
    """The uploads app, with the status route mounted (``mounted``) or not, started and stopped by the test."""
    received: Counter[str] = Counter()
    server = MisbehavingServer(idempotency_database_url, uploads(request.param == "mounted", received))
    server.start()
    try:
        yield server, received
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("served", ["mounted"], indirect=True)
def test_a_large_upload_is_sent_twice_at_most_while_it_runs(
    served: tuple[MisbehavingServer, Counter[str]], flavour: str
) -> None:
    """The first attempt times out while the upload runs; the client asks its key's status until it completed,
    then resends once and gets the replay: the body crossed the wire twice, never during the run."""
    server, received = served
    results = two_uploads(flavour, server.url)
    for result in results:
        assert (result.status_code, result.replayed, result.outcomes) == (201, True, ("ReadTimeout", 201))
        assert result.json()["bytes"] == len(BIG)
        assert len(result.asked) >= 2
        assert set(result.asked[:-1]) == {"in_progress"}
        assert result.asked[-1] == "completed"
    assert received["/uploads"] == 2 * 2 * len(BIG)
    assert server.state.effects == {result.key: 1 for result in results}
    assert not [seen for seen in server.state.seen if seen.method == "GET" and seen.keys]  # no key on a question


@pytest.mark.slow
@pytest.mark.parametrize("served", ["missing"], indirect=True)
def test_without_the_status_route_a_large_upload_is_resent_as_before(
    served: tuple[MisbehavingServer, Counter[str]], flavour: str
) -> None:
    """The app has no status route: the first question gets 404, and the client resends as it would without
    AskFirst (409s, then the replay); its next call asks nothing."""
    server, received = served
    first, second = two_uploads(flavour, server.url)
    assert first.asked == (404,)
    assert second.asked == ()
    for result in (first, second):
        assert (result.status_code, result.replayed) == (201, True)
        assert result.outcomes[0] == "ReadTimeout"
        assert set(result.outcomes[1:-1]) == {409}
    questions = [seen for seen in server.state.seen if seen.method == "GET"]
    assert [seen.status for seen in questions] == [404]
    assert received["/uploads"] == (first.attempts + second.attempts) * len(BIG)  # every attempt carried the body
    assert server.state.effects == {first.key: 1, second.key: 1}


@pytest.mark.slow
@pytest.mark.parametrize("served", ["mounted"], indirect=True)
def test_the_client_pages_snippet(
    served: tuple[MisbehavingServer, Counter[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, received = served
    key, never = str(uuid.uuid4()), str(uuid.uuid4())
    with recipe("ask_first", tmp_path, monkeypatch, API_URL=server.url, API_TOKEN="sk_test_snippet") as module:

        async def run() -> tuple[str, bool, bool]:
            try:
                return await module.upload(BIG, key), await module.took_effect(key), await module.took_effect(never)
            finally:
                await module.client.aclose()

        uploaded, done, not_done = asyncio.run(run())
    assert (uploaded, done, not_done) == ("up_1", True, False)
    assert received["/v1/uploads"] == len(BIG)
