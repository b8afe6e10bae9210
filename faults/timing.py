"""An httpx transport that records every attempt: when it started, how long until its answer, and what came back.

The retrying client reports one result per logical call; scenarios that promise "a 503 within bounded time"
need each attempt on its own, so this sits under the client and times the attempts one by one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx


@dataclass(frozen=True)
class Attempt:
    started: float  # time.monotonic()
    seconds: float  # until the response head arrived, or the error
    outcome: int | str  # status code, or the name of the transport error


class TimingTransport(httpx.AsyncBaseTransport):
    def __init__(self, inner: httpx.AsyncBaseTransport | None = None) -> None:
        self.inner = inner or httpx.AsyncHTTPTransport()
        self.attempts: list[Attempt] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        started = time.monotonic()
        try:
            response = await self.inner.handle_async_request(request)
        except httpx.TransportError as error:
            self.attempts.append(Attempt(started, time.monotonic() - started, type(error).__name__))
            raise
        self.attempts.append(Attempt(started, time.monotonic() - started, response.status_code))
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()

    def overlapping(self, start: float, end: float) -> list[Attempt]:
        """Attempts that were under way at some point in ``[start, end)``."""
        return [a for a in self.attempts if a.started < end and a.started + a.seconds >= start]
