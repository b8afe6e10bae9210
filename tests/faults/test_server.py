"""The server runner (faults.server): a child process that can be killed and restarted on the same port."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from faults.server import ServerProcess, ServerStartFailed


async def _whoami(request: Request) -> Response:
    return PlainTextResponse(str(os.getpid()))


pid_app = Starlette(routes=[Route("/", _whoami)])  # served by ServerProcess in a child process, below


@pytest.mark.slow
async def test_server_process_survives_a_kill_on_the_same_port() -> None:
    """A killed server comes back on its port, and a request sent while it was down is answered by the new one."""
    async with ServerProcess("tests.faults.test_server:pid_app") as server, httpx.AsyncClient(timeout=30) as client:
        first = (await client.get(server.base_url)).text
        server.kill()
        assert server.process is not None
        await server.process.wait()
        waiting = asyncio.create_task(client.get(server.base_url))  # sits in the listening socket's backlog
        await server.start()
        second = (await waiting).text
    assert first.isdigit()
    assert second.isdigit()
    assert first != second


@pytest.mark.slow
async def test_a_request_that_got_no_answer_carries_the_servers_log() -> None:
    """A scenario whose request ends without an answer (the server closed the connection) shows what the server
    logged at that moment, so a failure seen once in CI can be told apart from a client-side race."""
    async with ServerProcess("tests.faults.test_server:pid_app", log_level="info") as server:
        error = httpx.ReadError("no answer")
        server.note_log(error, "payments worker")
    (note,) = error.__notes__
    assert note.startswith("the payments worker's log ends with:\n")
    assert "Uvicorn running" in note or "Application startup complete" in note


@pytest.mark.slow
async def test_server_process_reports_a_failed_start() -> None:
    with pytest.raises(ServerStartFailed, match="exited during startup"):
        async with ServerProcess("faults.proxy:no_such_app", ready_timeout=30):
            pass
