"""Response capture and replay, changing nothing on the way through.

The recorder sits in the ASGI ``send`` path and copies what passes: the status, the raw header list (order and
repeats kept: two ``Set-Cookie`` stay two), and every body chunk, up to the storage cap. It either forwards each
message as it comes (the live response streams as if we were not there; only the response start waits for the
first body message, to leave with it) or holds them until the answer is decided (transactional mode: nothing
reaches the client before the record has committed).

A recorded answer goes out with one header that is not recorded: ``Idempotency-Expires``, the record's expiry as an
HTTP-date, until when a retry with the key gets this answer again. The live response gains it as its start goes on
(the owner says whether its answer is recorded), a replay after the stored headers; so a replay is the live
response as it went out, plus ``Idempotent-Replayed: true``.

The request body of a covered request: read once, under a cap, to be fingerprinted; then handed to the handler
as it came, once, before the real channel (which still tells of a client that hangs up).
"""

from __future__ import annotations

import enum
import inspect
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl

import orjson
from starlette.types import Message, Receive, Scope, Send

from idempotency_mw._keys import InvalidKey
from idempotency_mw._wire import EXPIRES_HEADER, REPLAYED_HEADER
from idempotency_mw.store import Headers, StoredResponse

REPLAYED = (REPLAYED_HEADER.lower().encode("ascii"), b"true")
EXPIRES = EXPIRES_HEADER.lower().encode("ascii")
logger = logging.getLogger("idempotency_mw")

_DAYS = (b"Mon", b"Tue", b"Wed", b"Thu", b"Fri", b"Sat", b"Sun")
_MONTHS = (b"Jan", b"Feb", b"Mar", b"Apr", b"May", b"Jun", b"Jul", b"Aug", b"Sep", b"Oct", b"Nov", b"Dec")


def http_date(epoch: float) -> bytes:
    """``epoch`` as an IMF-fixdate (RFC 9110 §5.6.7), rounded down to the second: a client that trusts it is never
    told of a time later than the one it stands for."""
    t = time.gmtime(math.floor(epoch))
    return b"%s, %02d %s %04d %02d:%02d:%02d GMT" % (
        _DAYS[t.tm_wday], t.tm_mday, _MONTHS[t.tm_mon - 1], t.tm_year, t.tm_hour, t.tm_min, t.tm_sec,
    )  # fmt: skip


Added = tuple[tuple[bytes, bytes], ...]  # headers a response gains on its way out, never recorded


def expiry(expires_at: float | None) -> Added:
    """The ``Idempotency-Expires`` header of a record that expires at ``expires_at`` (none when the store does not
    say). Formatted each time: a cache of the last second would make a request's Python work depend on the clock,
    and the counts that steer this library must not move between runs (about 30 opcodes)."""
    if expires_at is None:
        return ()
    return ((EXPIRES, http_date(expires_at)),)


# ASGI extensions that send a response's body around ``send`` (a file by its path), where it could not be recorded:
# the middleware does not offer them to the handler, and the recorder marks a response that used one unreplayable.
WITHHELD_EXTENSIONS = frozenset({"http.response.pathsend", "http.response.zerocopysend"})


def handler_scope(scope: Scope) -> Scope:
    """The scope a covered handler sees: without the extensions that would send its body around the recorder. A
    Starlette FileResponse then streams its file through ``send``."""
    extensions = scope.get("extensions")
    if extensions and not WITHHELD_EXTENSIONS.isdisjoint(extensions):
        scope["extensions"] = {k: v for k, v in extensions.items() if k not in WITHHELD_EXTENSIONS}
    return scope


class ResponseRecorder:
    """Copy a response as it passes through ``send``, in two steps per message, so the owner can decide in between.

    :meth:`record` copies a message, keeps it back if it must wait, and says whether the answer must be decided
    before it goes on: the final body message (the record is written, or the transaction commits, while the client
    has not yet seen its end, and before anything the app runs after its response: background tasks).
    :meth:`forward` then sends it on, after what waited. The owner decides between the two
    (``PlainRun._send``, ``TransactionalRun._send``); if deciding raises, the message is not sent.

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
        self.started = False  # the response start went on
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
            headers = message.get("headers")
            if not isinstance(headers, (list, tuple)):  # any iterable will do in ASGI, and an iterator reads once:
                headers = list(headers or ())  # the message that goes on carries the pairs recorded (or none:
                message = {**message, "headers": headers}  # they are optional, and the start may gain some)
            self.headers = list(headers)  # a copy of its own: a middleware outside may add to the message's list
            if message.get("trailers", False):
                self.capturable = False  # trailer fields follow the body, and a record keeps none: not replayable
        elif kind == "http.response.body":
            chunk = message.get("body", b"")
            if not isinstance(chunk, bytes):  # a view of a buffer the app may refill for its next chunk: copy it
                chunk = bytes(chunk)
                message = {**message, "body": chunk}
            self.body_size += len(chunk)
            if self.body_size > self._max_body:  # overflowed
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
        overflowed = self.body_size > self._max_body
        decide = final or (self._hold and overflowed)
        if kind == "http.response.start" or (self._hold and not (self.finished or overflowed)):
            self._held.append(message)  # while holding, everything waits until the answer is decided
            return None, decide
        return message, decide

    async def forward(self, message: Message, added: Added = ()) -> None:
        """Send what waited, then ``message``. ``added``: headers the response start gains on its way, which are
        not recorded (the record's expiry); the owner asks for them only while the start has not gone on."""
        self._hold = False  # decided, or never held: what waits goes first
        if self._held:
            for waiting in self._held:
                if added and waiting["type"] == "http.response.start":
                    waiting = {**waiting, "headers": [*waiting["headers"], *added]}
                await self._send(waiting)
            self._held.clear()
            self.started = True
        await self._send(message)

    def stored_response(self) -> StoredResponse:
        """What to record; without a body when it is over the cap, was cut short, or went around the recorder
        (then it cannot be replayed)."""
        assert self.status is not None
        stored = self.finished and self.capturable and not self.overflowed
        body = b"".join(self._chunks) if stored else None
        return StoredResponse(self.status, self.headers, body, self.body_size)


async def replay(response: StoredResponse, send: Send, expires_at: float | None = None) -> None:
    """Send a stored response exactly as first sent (with the record's expiry, ``expires_at``, as the first answer
    had it), plus ``Idempotent-Replayed: true``.

    A body the app streamed without a ``Content-Length`` went out chunked; sent back in one final message, some
    servers (Granian) would frame it with a ``Content-Length`` instead. An empty final message after it keeps the
    framing the client first saw.
    """
    assert response.body is not None
    headers = [*response.headers, *expiry(expires_at), REPLAYED]
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    if response.body and not any(name.lower() == b"content-length" for name, _ in response.headers):
        await send({"type": "http.response.body", "body": response.body, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    else:
        await send({"type": "http.response.body", "body": response.body})


# Sync or async: what it returns (or its coroutine returns) goes out in place of the stored response; None keeps it.
ReplayHook = Callable[[Scope, StoredResponse], "StoredResponse | Awaitable[StoredResponse | None] | None"]


async def replayed(hook: ReplayHook, scope: Scope, response: StoredResponse) -> StoredResponse:
    """The response a replay sends, as the ``on_replay`` hook (sync or async) would have it. A hook that fails, or
    returns anything but a replayable :class:`StoredResponse` or None, is logged, and the response goes out as
    stored."""
    try:
        changed = hook(scope, response)
        if inspect.isawaitable(changed):
            changed = await changed
    except Exception:
        logger.exception("idempotency on_replay hook failed (the response is replayed as stored)")
        return response
    if changed is None:
        return response
    if not isinstance(changed, StoredResponse) or changed.body is None:
        what = type(changed).__name__ if not isinstance(changed, StoredResponse) else "a response without a body"
        logger.error(
            "idempotency on_replay hook returned %s, not a StoredResponse with a body or None: the response is "
            "replayed as stored",
            what,
        )
        return response
    return changed


class Read(enum.Enum):
    WHOLE = "whole"  # the body is in ``BufferedBody.body``
    TOO_LARGE = "too large"  # over the cap (declared or sent): 413
    GONE = "gone"  # the client hung up before sending it all


class BufferedBody:
    def __init__(self, receive: Receive, limit: int) -> None:
        self._receive = receive
        self._limit = limit
        self.body = b""
        self.read = False  # the whole body is in ``body``
        self.ended = False  # the client sent its last body message (``read``, or a body that passed the cap with it)
        self.buffered = False  # some of it was read here (all of it, if ``read``): the handler gets it first
        self.delivered = True  # nothing is waiting for the handler: it reads the real channel

    async def read_all(self, declared_length: bytes) -> Read:
        """Read the whole body, refusing one over the cap by its ``Content-Length`` before reading it."""
        if declared_length.isdigit() and int(declared_length) > self._limit:
            return Read.TOO_LARGE
        chunks: list[bytes] = []
        size = 0
        try:
            while True:
                message = await self._receive()
                if message["type"] == "http.disconnect":
                    return Read.GONE
                chunk = message.get("body", b"")
                chunks.append(chunk)
                size += len(chunk)
                if size > self._limit:
                    self.ended = not message.get("more_body", False)
                    return Read.TOO_LARGE
                if not message.get("more_body", False):
                    break
            self.read = self.ended = True
            return Read.WHOLE
        finally:
            # What was read, whole or not: a handler that runs all the same (the middleware switched off) gets it.
            self.body = b"".join(chunks)
            self.buffered, self.delivered = True, False

    def payload(self, content_type: bytes) -> Any:
        """The body as an app reads it, for a route that takes its key from it: the parsed JSON (any content type,
        as ``request.json()`` reads it), or a form's fields by name; :class:`InvalidKey` for anything else."""
        try:
            return orjson.loads(self.body)
        except orjson.JSONDecodeError:
            pass
        if content_type.split(b";", 1)[0].strip().lower() == b"application/x-www-form-urlencoded":
            return dict(parse_qsl(self.body.decode("latin-1"), keep_blank_values=True))
        raise InvalidKey("this route takes its idempotency key from the body, which must be JSON or a form")

    async def receive(self) -> Message:
        """The handler's ``receive``: the buffered body once (with more to come unless the client sent its last
        message), then the real channel."""
        if not self.delivered:
            self.delivered = True
            return {"type": "http.request", "body": self.body, "more_body": not self.ended}
        return await self._receive()
