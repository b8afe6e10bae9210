"""The lossy proxy (faults.proxy): what it passes, drops, resets and cuts, and that its dice are seeded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from faults.proxy import LossyProxy
from faults.server import serve


class Upstream:
    """An in-process server that records what reached it and can hold a request until told to answer."""

    def __init__(self) -> None:
        self.calls: list[bytes] = []
        self.reached = asyncio.Event()
        self.go = asyncio.Event()
        self.go.set()

    def app(self) -> Starlette:
        async def echo(request: Request) -> Response:
            body = await request.body()
            self.calls.append(body)
            self.reached.set()
            await self.go.wait()
            headers = {"Idempotent-Replayed": "true"} if request.query_params.get("replayed") else {}
            return PlainTextResponse(b"echo:" + body, status_code=201, headers=headers)

        return Starlette(routes=[Route("/echo", echo, methods=["POST"])])


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[Upstream, int]]:
    server = Upstream()
    async with serve(server.app()) as url:
        yield server, int(url.rsplit(":", 1)[1])


async def test_proxy_passes_requests_through_on_one_keep_alive_connection(upstream: tuple[Upstream, int]) -> None:
    server, port = upstream
    bodies = [b"small", b"x" * 200_000, b""]  # the large one arrives in many chunks
    async with LossyProxy(port) as proxy, httpx.AsyncClient(base_url=proxy.url) as client:
        for body in bodies:
            response = await client.post("/echo", content=body)
            assert (response.status_code, response.content) == (201, b"echo:" + body)
        await client.post("/echo?replayed=1", content=b"again")
    assert server.calls == [*bodies, b"again"]
    stats = proxy.stats
    assert (stats.connections, stats.requests, stats.responses, stats.replays) == (1, 4, 4, 1)
    assert stats.statuses == {201: 4}
    assert (stats.dropped, stats.resets, stats.cut) == (0, 0, 0)


async def test_proxy_drops_the_response_after_the_server_answered(upstream: tuple[Upstream, int]) -> None:
    server, port = upstream
    async with LossyProxy(port, drop_rate=1.0) as proxy, httpx.AsyncClient(base_url=proxy.url) as client:
        with pytest.raises(httpx.TransportError):
            await client.post("/echo", content=b"charge")
    assert server.calls == [b"charge"]  # it ran; the client cannot tell
    assert (proxy.stats.dropped, proxy.stats.responses, proxy.stats.statuses[201]) == (1, 1, 1)


async def test_proxy_resets_before_the_request_reaches_the_server(upstream: tuple[Upstream, int]) -> None:
    server, port = upstream
    async with LossyProxy(port, reset_rate=1.0) as proxy, httpx.AsyncClient(base_url=proxy.url) as client:
        with pytest.raises(httpx.TransportError):
            await client.post("/echo", content=b"charge")
    assert server.calls == []
    assert (proxy.stats.resets, proxy.stats.requests) == (1, 0)


async def test_proxy_cuts_the_client_off_while_the_server_works(upstream: tuple[Upstream, int]) -> None:
    server, port = upstream
    server.go.clear()  # the server holds its answer until the client has been cut off
    async with LossyProxy(port, cut_rate=1.0) as proxy, httpx.AsyncClient(base_url=proxy.url) as client:
        with pytest.raises(httpx.TransportError):
            await client.post("/echo", content=b"charge")
        await asyncio.wait_for(server.reached.wait(), 10)
        server.go.set()
        for _ in range(200):  # the proxy still reads (and discards) the answer
            if proxy.stats.responses:
                break
            await asyncio.sleep(0.02)
    assert server.calls == [b"charge"]
    assert (proxy.stats.cut, proxy.stats.responses, proxy.stats.dropped) == (1, 1, 0)


def test_proxy_dice_are_reproducible() -> None:
    def throws(seed: int) -> list[str]:
        proxy = LossyProxy(1, drop_rate=0.3, reset_rate=0.2, cut_rate=0.1, seed=seed)
        return [proxy.roll() for _ in range(200)]

    assert throws(5) == throws(5)
    assert throws(5) != throws(6)
    assert set(throws(5)) == {"pass", "drop", "reset", "cut"}
    with pytest.raises(ValueError, match="between 0 and 1"):
        LossyProxy(1, drop_rate=1.5)
    with pytest.raises(ValueError, match="more than 1"):
        LossyProxy(1, drop_rate=0.6, reset_rate=0.6)
