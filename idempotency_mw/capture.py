"""Response capture and replay, changing nothing on the way through.

The recorder sits in the ASGI ``send`` path and copies what passes: the status, the raw header list (order and
repeats kept: two ``Set-Cookie`` stay two), and every body chunk, up to the storage cap. It either forwards each
message as it comes (the live response streams as if we were not there; only the response start waits for the
first body message, to leave with it) or holds them until the answer is decided (transactional mode: nothing
reaches the client before the record has committed).
"""

from __future__ import annotations

from starlette.types import Message, Send

from idempotency_mw.store import Headers, StoredResponse
from idempotency_mw.wire import REPLAYED_HEADER, WITHHELD_EXTENSIONS

REPLAYED = (REPLAYED_HEADER.lower().encode("ascii"), b"true")


class ResponseRecorder:
    """Copy a response as it passes through ``send``, in two steps per message, so the owner can decide in between.

    :meth:`record` copies a message, keeps it back if it must wait, and says whether the answer must be decided
    before it goes on: the final body message (the record is written, or the transaction commits, while the client
    has not yet seen its end, and before anything the app runs after its response: background tasks).
    :meth:`forward` then sends it on, after what waited. The owner decides between the two
    (``IdempotentRequest._send_recorded``, ``TransactionalRun._send``); if deciding raises, the message is not sent.

    The response start always waits for the message after it, as PEP 3333 asks of WSGI servers: status line,
    headers and the first body chunk then reach the server back to back, which writes them together and wakes the
    client once.

    With ``hold``, messages are kept back until the answer is decided (transactional mode: nothing reaches the
    client before the commit). A held response that outgrows ``max_body`` must be decided early (the record then
    says the body was too large to store) and streams the rest through, so holding never grows without bound.

    The recorder keeps no reference to its owner: an owner that keeps the recorder would otherwise make a reference
    cycle of every request, which only the cycle collector frees (tests/test_cycles.py).
    """

    def __init__(self, send: Send, *, max_body: int, hold: bool = False) -> None:
        self._send = send
        self._max_body = max_body
        self._hold = hold
        self._held: list[Message] = []
        self._chunks: list[bytes] = []
        self.status: int | None = None
        self.headers: Headers = []
        self.body_size = 0
        self.finished = False  # the final body message went through
        self.capturable = True  # False once a message came that the recorder cannot store (then: no body)

    @property
    def overflowed(self) -> bool:
        return self.body_size > self._max_body

    def record(self, message: Message) -> tuple[Message | None, bool]:
        """Copy ``message``; return it as it must go on now (a buffer view becomes bytes), or None when it waits for
        a later message, and whether the answer must be decided before anything goes on."""
        kind = message["type"]
        final = False
        if kind == "http.response.start":
            self.status = message["status"]
            headers = message.get("headers", ())
            if not isinstance(headers, (list, tuple)):  # any iterable will do in ASGI, and an iterator reads once:
                headers = list(headers)  # the message that goes on carries the pairs recorded
                message = {**message, "headers": headers}
            self.headers = list(headers)  # a copy of its own: a middleware outside may add to the message's list
            if message.get("trailers", False):
                self.capturable = False  # trailer fields follow the body, and a record keeps none: not replayable
        elif kind == "http.response.body":
            chunk = message.get("body", b"")
            if not isinstance(chunk, bytes):  # a view of a buffer the app may refill for its next chunk: copy it
                chunk = bytes(chunk)
                message = {**message, "body": chunk}
            self.body_size += len(chunk)
            if self.overflowed:
                self._chunks.clear()  # past the cap the body is not stored, so keep none of it
            elif chunk:
                self._chunks.append(chunk)
            final = not message.get("more_body", False)
        elif kind in WITHHELD_EXTENSIONS:  # the body goes around send (a file by its path): nothing here to store
            self.capturable = False
            final = kind == "http.response.pathsend"
        # Anything else (trailers, a test client's http.response.debug) carries no body: it passes as it is.
        if final:
            self.finished = True
        decide = final or (self._hold and self.overflowed)
        if kind == "http.response.start" or (self._hold and not (self.finished or self.overflowed)):
            self._held.append(message)  # while holding, everything waits until the answer is decided
            return None, decide
        return message, decide

    async def forward(self, message: Message) -> None:
        """Send what waited, then ``message``."""
        self._hold = False  # decided, or never held: what waits goes first
        if self._held:
            for waiting in self._held:
                await self._send(waiting)
            self._held.clear()
        await self._send(message)

    def stored_response(self) -> StoredResponse:
        """What to record; without a body when it is over the cap, was cut short, or went around the recorder
        (then it cannot be replayed)."""
        assert self.status is not None
        stored = self.finished and self.capturable and not self.overflowed
        body = b"".join(self._chunks) if stored else None
        return StoredResponse(self.status, self.headers, body, self.body_size)


async def replay(response: StoredResponse, send: Send) -> None:
    """Send a stored response exactly as first sent, plus ``Idempotent-Replayed: true``.

    A body the app streamed without a ``Content-Length`` went out chunked; sent back in one final message, some
    servers (Granian) would frame it with a ``Content-Length`` instead. An empty final message after it keeps the
    framing the client first saw.
    """
    assert response.body is not None
    await send({"type": "http.response.start", "status": response.status, "headers": [*response.headers, REPLAYED]})
    if response.body and not any(name.lower() == b"content-length" for name, _ in response.headers):
        await send({"type": "http.response.body", "body": response.body, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    else:
        await send({"type": "http.response.body", "body": response.body})
