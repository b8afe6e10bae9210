"""The demo's parts (the lossy proxy, the server helper, the audit) and the demo itself, end to end."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator

import asyncpg
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from idempotency_mw.client import AsyncIdempotentClient
from idempotency_mw.demo import run
from idempotency_mw.demo.audit import audit
from idempotency_mw.demo.payments import create_app
from idempotency_mw.demo.proxy import LossyProxy
from idempotency_mw.demo.server import ServerProcess, ServerStartFailed, serve
from idempotency_mw.demo.workload import Mix, Workload


async def _whoami(request: Request) -> Response:
    return PlainTextResponse(str(os.getpid()))


pid_app = Starlette(routes=[Route("/", _whoami)])  # served by ServerProcess in a child process, below


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


# -- the lossy proxy ---------------------------------------------------------------------------------------------


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


# -- the server helper -------------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_server_process_survives_a_kill_on_the_same_port() -> None:
    """A killed server comes back on its port, and a request sent while it was down is answered by the new one."""
    async with ServerProcess("tests.test_demo:pid_app") as server, httpx.AsyncClient(timeout=30) as client:
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
async def test_server_process_reports_a_failed_start() -> None:
    with pytest.raises(ServerStartFailed, match="exited during startup"):
        async with ServerProcess("idempotency_mw.demo.proxy:no_such_app", ready_timeout=30):
            pass


# -- the audit ---------------------------------------------------------------------------------------------------


async def test_audit_finds_duplicates_and_lost_operations(idempotency_database_url: str) -> None:
    """The audit is the demo's oracle: after a clean run it agrees, after a forged duplicate it must not."""
    app = create_app(idempotency_database_url, pool_size=8)
    run_name = uuid.uuid4().hex[:8]
    api_keys = [f"sk_test_audit_{run_name}_{n}" for n in range(2)]
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        clients = {
            key: AsyncIdempotentClient(
                base_url="http://payments.test", headers={"Authorization": f"Bearer {key}"}, transport=transport
            )
            for key in api_keys
        }
        workload = Workload(Mix(payments=12, concurrency=4, refund_rate=0.5, seed=3), clients, run_name)
        await workload.run()
        async with httpx.AsyncClient(transport=transport, base_url="http://payments.test") as direct:
            clean = await audit(workload, idempotency_database_url, direct)
            assert clean.ok, clean

            # Forge what a retry that minted a new key would leave: a second payment intent for one operation.
            paid = next(op for op in workload.operations if op.kind == "payment_intent" and op.succeeded)
            connection = await asyncpg.connect(idempotency_database_url)
            try:
                await connection.execute(
                    "INSERT INTO payments.payment_intents"
                    " SELECT 'pi_forged' || $2, account, customer, amount, currency, status, payment_method,"
                    "  client_secret, amount_received, 0, last_payment_error, description, metadata, created"
                    " FROM payments.payment_intents WHERE id = $1",
                    paid.object_id,
                    run_name,
                )
                await connection.execute(
                    "INSERT INTO payments.ledger (account, currency, amount, kind, payment_intent, idempotency_key)"
                    " SELECT account, currency, amount, kind, 'pi_forged' || $2, idempotency_key"
                    " FROM payments.ledger WHERE payment_intent = $1 AND kind = 'charge'",
                    paid.object_id,
                    run_name,
                )
            finally:
                await connection.close()
            workload.operations[0].status = None  # and an operation whose answer never came
            forged = await audit(workload, idempotency_database_url, direct)
        for client in clients.values():
            await client.aclose()
    assert (forged.duplicate_objects, forged.duplicate_entries) == (1, 1)
    assert not forged.balances_agree
    assert len(forged.lost) == 1
    assert not forged.ok


# -- the demo, end to end ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_end_to_end(
    idempotency_database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DATABASE_URL", idempotency_database_url)
    code = run.main(["--payments", "30", "--concurrency", "8", "--drop-rate", "0.2", "--reset-rate", "0.1"])
    table = capsys.readouterr().out
    assert code == 0, table

    def number(label: str) -> int:
        match = re.search(rf"^\s+{label}\s+(\d+)", table, re.MULTILINE)
        assert match is not None, f"{label!r} missing from:\n{table}"
        return int(match.group(1))

    assert number("duplicate effects") == 0
    assert number("lost operations") == 0
    assert number("logical operations") >= 30
    assert number("HTTP attempts") > number("logical operations")  # the proxy made the client retry
    assert number("responses dropped") > 0
    assert number("replays received") > 0  # and the retries of dropped answers were replays, not re-runs
    assert "OK: every operation took effect exactly once." in table


@pytest.mark.slow
def test_demo_runs_as_a_module() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "idempotency_mw.demo", "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0
    assert "--drop-rate" in done.stdout
