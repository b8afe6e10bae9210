"""Drive an ASGI app with raw messages, so hostile tests control every header byte and every body chunk.

httpx normalises what it sends (it lower-cases names, refuses non-ASCII values, computes Content-Length); a raw
call sends exactly the header list and chunks it is given, the way a misbehaving client or proxy could.
"""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

Headers = list[tuple[bytes, bytes]]


@dataclass
class Reply:
    """What the app sent back. ``error`` holds the traceback of an exception that escaped the app."""

    status: int
    headers: Headers
    body: bytes
    error: str | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def headers_without_replay_marker(self) -> Headers:
        return [(k, v) for k, v in self.headers if k != b"idempotent-replayed"]

    @property
    def replayed(self) -> bool:
        return self.header(b"idempotent-replayed") == b"true"


def scope(method: str, path: str, headers: Headers, *, query: bytes = b"", spec_version: str = "2.3") -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": spec_version},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode("utf-8", "surrogateescape"),
        "query_string": query,
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 80),
        "state": {},
    }


async def call(
    app: Any,
    method: str,
    path: str,
    headers: Headers,
    chunks: Sequence[bytes] = (b"",),
    *,
    query: bytes = b"",
    disconnect_early: bool = False,
    hang_up_after: int | None = None,
    spec_version: str = "2.3",
    patience: float = 20.0,
) -> Reply:
    """One request. ``chunks`` arrive as successive ``http.request`` messages; ``disconnect_early`` makes the
    client hang up after the first chunk instead of sending the rest.

    After the body, ``receive`` blocks (a client waiting for its answer) until the app has finished, or until the
    client hangs up: ``hang_up_after=N`` leaves once N response body chunks have arrived. After that, ``send``
    drops messages silently as uvicorn does (ASGI spec 2.3), or raises ``OSError`` as the spec asks of servers
    from version 2.4 on.
    """
    pending = list(chunks) or [b""]
    sent: list[dict[str, Any]] = []
    done = asyncio.Event()
    hung_up = asyncio.Event()
    body_chunks = 0
    delivered = 0

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if disconnect_early and delivered >= 1:
            return {"type": "http.disconnect"}
        if delivered < len(pending):
            delivered += 1
            return {"type": "http.request", "body": pending[delivered - 1], "more_body": delivered < len(pending)}
        waiters = [asyncio.ensure_future(done.wait()), asyncio.ensure_future(hung_up.wait())]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal body_chunks
        if hung_up.is_set():
            if spec_version >= "2.4":
                raise OSError("the client has gone away")
            return
        sent.append(message)
        if message["type"] == "http.response.body":
            body_chunks += 1
            if hang_up_after is not None and body_chunks >= hang_up_after:
                hung_up.set()

    error: str | None = None
    try:
        request = scope(method, path, headers, query=query, spec_version=spec_version)
        await asyncio.wait_for(app(request, receive, send), patience)
    except Exception:
        error = traceback.format_exc()
    finally:
        done.set()
    starts = [m for m in sent if m["type"] == "http.response.start"]
    if not starts:
        return Reply(status=0, headers=[], body=b"", error=error, messages=sent)  # no answer at all
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return Reply(starts[0]["status"], list(starts[0].get("headers", [])), body, error, sent)
