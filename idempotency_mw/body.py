"""The request body of a covered request: read once, under a cap, to be fingerprinted; then handed to the handler
as it came, once, before the real channel (which still tells of a client that hangs up)."""

from __future__ import annotations

import enum

from starlette.types import Message, Receive


class Read(enum.Enum):
    WHOLE = "whole"  # the body is in ``BufferedBody.body``
    TOO_LARGE = "too large"  # over the cap (declared or sent): 413
    GONE = "gone"  # the client hung up before sending it all


class BufferedBody:
    def __init__(self, receive: Receive, limit: int) -> None:
        self._receive = receive
        self._limit = limit
        self.body = b""
        self.delivered = False  # handed to the handler (or never buffered: it reads the real channel)

    async def read(self, declared_length: bytes) -> Read:
        """Read the whole body, refusing one over the cap by its ``Content-Length`` before reading it."""
        if declared_length.isdigit() and int(declared_length) > self._limit:
            return Read.TOO_LARGE
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                return Read.GONE
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self._limit:
                return Read.TOO_LARGE
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        self.body = b"".join(chunks)
        return Read.WHOLE

    async def receive(self) -> Message:
        """The handler's ``receive``: the buffered body once, then the real channel."""
        if not self.delivered:
            self.delivered = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        return await self._receive()
