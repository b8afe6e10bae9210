"""Response capture and replay, changing nothing on the way through.

The recorder sits in the ASGI ``send`` path and copies what passes: the status, the raw header list (order and
repeats kept: two ``Set-Cookie`` stay two), and every body chunk, up to the storage cap. It either forwards each
message at once (the live response streams as if we were not there) or holds them until ``flush`` (transactional
mode: nothing reaches the client before the record has committed).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import orjson
from starlette.types import Message, Send

from idempotency_mw.store import Headers, StoredResponse

REPLAYED_HEADER = (b"idempotent-replayed", b"true")


class ResponseRecorder:
    def __init__(
        self,
        send: Send,
        *,
        max_body: int,
        hold: bool = False,
        on_overflow: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._send = send
        self._max_body = max_body
        self._hold = hold
        self._on_overflow = on_overflow  # called once, before holding more than the cap
        self._held: list[Message] = []
        self._chunks: list[bytes] = []
        self.status: int | None = None
        self.headers: Headers = []
        self.body_size = 0
        self.finished = False  # the final body message went through

    @property
    def started(self) -> bool:
        return self.status is not None

    @property
    def overflowed(self) -> bool:
        return self.body_size > self._max_body

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.status = message["status"]
            self.headers = list(message.get("headers", ()))
        elif kind == "http.response.body":
            chunk = message.get("body", b"")
            self.body_size += len(chunk)
            if self.overflowed:
                self._chunks.clear()  # past the cap the body is not stored, so keep none of it
            elif chunk:
                self._chunks.append(chunk)
            if not message.get("more_body", False):
                self.finished = True
        if self._hold:
            self._held.append(message)
            if self.overflowed:
                # Holding more would grow without bound: settle the record now, then stream the rest through.
                if self._on_overflow is not None:
                    await self._on_overflow()
                await self.flush()
        else:
            await self._send(message)

    async def flush(self) -> None:
        """Send the held messages and stop holding."""
        held, self._held, self._hold = self._held, [], False
        for message in held:
            await self._send(message)

    def stored_response(self) -> StoredResponse:
        """What to record; without a body when it is over the cap or was cut short (then it cannot be replayed)."""
        assert self.status is not None
        body = b"".join(self._chunks) if self.finished and not self.overflowed else None
        return StoredResponse(self.status, self.headers, body, self.body_size)


async def replay(response: StoredResponse, send: Send) -> None:
    """Send a stored response exactly as first sent, plus ``Idempotent-Replayed: true``."""
    assert response.body is not None
    await send(
        {"type": "http.response.start", "status": response.status, "headers": [*response.headers, REPLAYED_HEADER]}
    )
    await send({"type": "http.response.body", "body": response.body})


def encode_headers(headers: Headers) -> str:
    """Headers as JSON ``[[name, value], …]``; latin-1 keeps every byte, so the round trip is exact."""
    return orjson.dumps([[name.decode("latin-1"), value.decode("latin-1")] for name, value in headers]).decode()


def decode_headers(encoded: str | bytes) -> Headers:
    return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in orjson.loads(encoded)]
