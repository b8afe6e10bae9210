"""A loopback TCP proxy that loses HTTP responses on purpose: the network the demo's client has to survive.

For each HTTP/1.1 request that passes through it (keep-alive connections carry several), it rolls its dice:

- **reset** (``reset_rate``): the connection is reset (TCP RST) before the request is forwarded. The server never
  sees it: "request lost".
- **drop** (``drop_rate``): the request reaches the server, the server answers, and the proxy closes the client's
  connection instead of passing the answer on: "response lost after the server processed it", the case that turns
  a naive retry into a second charge.
- **cut** (``cut_rate``): the client's connection is closed as soon as the whole request has been forwarded, while
  the server is still working on it; the answer is discarded when it comes. A quick retry then meets the original
  still in flight (409) or its recorded answer (a replay).

The proxy reads just enough HTTP to do this (the request head's ``Content-Length``, the response's status line and
``Idempotent-Replayed`` header) and counts what it did and saw in :class:`ProxyStats`. The dice come from one seeded
``random.Random``, so a run is reproducible up to the order in which concurrent requests arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import socket
import struct
from collections import Counter
from dataclasses import dataclass, field
from types import TracebackType

CHUNK = 65536
MAX_HEAD = 65536  # a request or response head larger than this is passed through without being looked at
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*([0-9]+)", re.IGNORECASE)
_REPLAYED = re.compile(rb"\r\nidempotent-replayed:[ \t]*true", re.IGNORECASE)


@dataclass
class ProxyStats:
    """What the proxy did, and what it saw of the server's answers (dropped ones included)."""

    connections: int = 0
    requests: int = 0  # requests forwarded to the server
    resets: int = 0  # connections reset instead of forwarding a request
    dropped: int = 0  # answers the server sent that the client never got
    cut: int = 0  # client connections closed while the server was still working
    responses: int = 0  # answers seen from the server
    replays: int = 0  # answers that carried Idempotent-Replayed: true
    statuses: Counter[int] = field(default_factory=Counter)


class LossyProxy:
    """``async with LossyProxy(port_of_server, drop_rate=0.2, reset_rate=0.1, seed=1) as proxy: proxy.url``."""

    def __init__(
        self,
        upstream_port: int,
        *,
        upstream_host: str = "127.0.0.1",
        drop_rate: float = 0.0,
        reset_rate: float = 0.0,
        cut_rate: float = 0.0,
        seed: int | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        for name, rate in (("drop_rate", drop_rate), ("reset_rate", reset_rate), ("cut_rate", cut_rate)):
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1, got {rate}")
        if reset_rate + drop_rate + cut_rate > 1.0:
            raise ValueError("reset_rate + drop_rate + cut_rate add up to more than 1")
        self.upstream = (upstream_host, upstream_port)
        self.rates = (reset_rate, drop_rate, cut_rate)
        self.random = random.Random(seed)
        self.stats = ProxyStats()
        self._bind = (host, port)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        assert self._server is not None, "the proxy is not running"
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    @property
    def url(self) -> str:
        return f"http://{self._bind[0]}:{self.port}"

    async def __aenter__(self) -> LossyProxy:
        self._server = await asyncio.start_server(self._accept, *self._bind)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        await self._server.wait_closed()
        self._server = None

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.stats.connections += 1
        try:
            await _Connection(self, reader, writer).run()
        except asyncio.CancelledError:
            # Only __aexit__ cancels these tasks (the proxy is shutting down). Ending normally keeps asyncio's
            # stream machinery from reporting the cancellation as an error.
            pass
        finally:
            self._tasks.discard(task)

    def roll(self) -> str:
        """One throw of the dice for a new request: ``"reset"``, ``"drop"``, ``"cut"`` or ``"pass"``."""
        reset, drop, cut = self.rates
        throw = self.random.random()
        if throw < reset:
            return "reset"
        if throw < reset + drop:
            return "drop"
        if throw < reset + drop + cut:
            return "cut"
        return "pass"


class _Connection:
    """One client connection and its own connection to the server, request by request.

    HTTP/1.1 without pipelining (what httpx sends) alternates: a request, its whole answer, the next request. So
    the first bytes from the server after a request are the head of its answer, and the next bytes from the client
    start a new request.
    """

    def __init__(self, proxy: LossyProxy, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.proxy = proxy
        self.stats = proxy.stats
        self.client_reader, self.client_writer = reader, writer
        self.fate = "pass"  # of the request in flight
        self.expect_head = False  # the next bytes from the server begin an answer
        self.client_gone = False

    async def run(self) -> None:
        try:
            upstream_reader, self.upstream_writer = await asyncio.open_connection(*self.proxy.upstream)
        except OSError:
            _reset(self.client_writer)
            return
        except asyncio.CancelledError:  # the proxy is shutting down: the client's connection goes with it
            _close(self.client_writer)
            raise
        requests = asyncio.create_task(self._requests())
        responses = asyncio.create_task(self._responses(upstream_reader))
        try:
            await asyncio.wait((requests, responses), return_when=asyncio.FIRST_COMPLETED)
            if self.fate == "cut" and not responses.done():
                # The client is gone but the server is still working: let it finish, then discard its answer.
                await asyncio.wait((responses,), timeout=60)
        finally:
            for task in (requests, responses):
                task.cancel()
            await asyncio.gather(requests, responses, return_exceptions=True)
            _close(self.upstream_writer)
            if not self.client_gone:
                _close(self.client_writer)

    async def _requests(self) -> None:
        """Client to server: roll the dice for each new request, forward it, and cut the client off if told to."""
        head = b""
        remaining = 0  # bytes of the current request still to come; -1 while its head is incomplete
        while True:
            data = await self.client_reader.read(CHUNK)
            if not data:
                return
            if remaining == 0:  # the first bytes of a new request
                self.fate = self.proxy.roll()
                if self.fate == "reset":
                    self.stats.resets += 1
                    self.client_gone = True
                    _reset(self.client_writer)
                    return
                self.stats.requests += 1
                self.expect_head = True
                head, remaining = b"", -1
            self.upstream_writer.write(data)
            await self.upstream_writer.drain()
            if remaining < 0:
                head += data
                end = head.find(b"\r\n\r\n")
                if end < 0:
                    if len(head) > MAX_HEAD:  # cannot tell where this request ends: never cut it
                        self.fate = "pass" if self.fate == "cut" else self.fate
                        remaining = 1 << 62
                    continue
                match = _CONTENT_LENGTH.search(head, 0, end + 2)
                remaining = (int(match.group(1)) if match else 0) - (len(head) - end - 4)
            else:
                remaining -= len(data)
            if remaining <= 0:
                remaining = 0
                if self.fate == "cut":  # all of it is with the server now: leave it working on it
                    self.stats.cut += 1
                    self.client_gone = True
                    _close(self.client_writer)
                    return

    async def _responses(self, upstream: asyncio.StreamReader) -> None:
        """Server to client: look at each answer's head, then pass it on, or drop it and hang up."""
        head = b""
        while True:
            data = await upstream.read(CHUNK)
            if not data:
                return
            if self.expect_head:
                head += data
                if b"\r\n\r\n" not in head and len(head) <= MAX_HEAD:
                    continue  # see the whole head before deciding
                self.expect_head = False
                self._count(head)
                data, head = head, b""
                if self.fate in ("drop", "cut"):
                    if self.fate == "drop":
                        self.stats.dropped += 1
                        self.client_gone = True
                        _close(self.client_writer)
                    return  # the answer goes nowhere, and the connection ends here
            self.client_writer.write(data)
            await self.client_writer.drain()

    def _count(self, head: bytes) -> None:
        self.stats.responses += 1
        status = head[9:12]
        if head.startswith(b"HTTP/") and status.isdigit():
            self.stats.statuses[int(status)] += 1
        end = head.find(b"\r\n\r\n")
        if _REPLAYED.search(head, 0, end + 2 if end >= 0 else len(head)):
            self.stats.replays += 1


def _close(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):
        writer.close()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST rather than a FIN: the client sees "connection reset by peer"."""
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(Exception):
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
