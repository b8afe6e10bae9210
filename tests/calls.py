"""Raw ASGI calls: an app driven with hand-made messages, so that a test sees exactly what it sends (each header
pair, each chunk) and decides exactly when the client hangs up."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Send

from tests.conftest import http_scope


def hanging_up_client(hang_up: asyncio.Event) -> Receive:
    """A client's ``receive``: the request body, then ``http.disconnect`` once ``hang_up`` is set."""
    delivered = False

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await hang_up.wait()
        return {"type": "http.disconnect"}

    return receive


async def ignore(message: Message) -> None:
    """A server's ``send`` to a client that has gone."""


def recorder(sent: list[Message]) -> Send:
    """A server's ``send`` that keeps every message in ``sent``."""

    async def send(message: Message) -> None:
        sent.append(message)

    return send


class Call:
    """One raw ASGI request, run as a task, with what the app sent so far."""

    def __init__(
        self, app: ASGIApp, path: str, key: str, *, body: bytes = b"{}", extensions: dict[str, Any] | None = None
    ) -> None:
        self.sent: list[Message] = []
        self.finished = asyncio.Event()  # the final body message reached the client
        scope = http_scope(path, key, spec_version="2.4", extensions=extensions)
        delivered = False
        never = asyncio.Event()

        async def receive() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await never.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            self.sent.append(message)
            if message["type"] == "http.response.pathsend" or (
                message["type"] == "http.response.body" and not message.get("more_body", False)
            ):
                self.finished.set()

        async def run() -> None:
            await app(scope, receive, send)

        self.task = asyncio.create_task(run())

    @property
    def status(self) -> int:
        return int(self.sent[0]["status"])

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")


def keyed_scope(path: str, key: str | None, extra_headers: list[tuple[bytes, bytes]] | None = None) -> dict[str, Any]:
    """A POST as Alice (the default tenant of ``client_for``), keyed unless ``key`` is None; ``path`` may carry a
    query string."""
    headers = [(b"authorization", b"Bearer sk_test_alice"), (b"content-type", b"application/json")]
    if key is not None:
        headers.append((b"idempotency-key", key.encode()))
    headers.extend(extra_headers or [])
    path, _, query = path.partition("?")
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("test", 80),
    }


async def raw_call(
    app: ASGIApp, path: str, key: str | None, *, extra_headers: list[tuple[bytes, bytes]] | None = None
) -> tuple[int, list[tuple[bytes, bytes]], list[bytes]]:
    """Drive the app with raw ASGI messages, so the test sees headers and chunks exactly as sent."""
    sent: list[Message] = []
    delivered = False

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await asyncio.Event().wait()  # the client never disconnects
        raise AssertionError

    await app(keyed_scope(path, key, extra_headers), receive, recorder(sent))
    start = sent[0]
    chunks = [m["body"] for m in sent[1:] if m.get("body")]
    return start["status"], list(start["headers"]), chunks
