"""The request body of a covered request: read once, under a cap, to be fingerprinted; then handed to the handler
as it came, once, before the real channel (which still tells of a client that hangs up)."""

from __future__ import annotations

import enum
from typing import Any
from urllib.parse import parse_qsl

import orjson
from starlette.types import Message, Receive

from idempotency_mw.keys import InvalidKey


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
        self.buffered = False  # some of it was read here (all of it, if ``read``): the handler gets it first
        self.delivered = False  # handed to the handler (or never buffered: it reads the real channel)

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
                    return Read.TOO_LARGE
                if not message.get("more_body", False):
                    break
            self.read = True
            return Read.WHOLE
        finally:
            # What was read, whole or not: a handler that runs all the same (the middleware switched off) gets it.
            self.body = b"".join(chunks)
            self.buffered = True

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
        """The handler's ``receive``: the buffered body once (with more to come when it was read only in part), then
        the real channel."""
        if not self.delivered:
            self.delivered = True
            return {"type": "http.request", "body": self.body, "more_body": not self.read}
        return await self._receive()
