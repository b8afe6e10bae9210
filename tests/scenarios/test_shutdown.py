"""A graceful shutdown releases the keys of the requests it cancels, so the client's retry runs after the restart.

uvicorn with ``--timeout-graceful-shutdown 1`` and a request still running at SIGTERM: uvicorn cancels the request
and runs the lifespan shutdown at once, which closes the store. The cancelled request releases its key on its way
out, and ``PostgresStore.close()`` waits for that (bounded) before it closes its connections. Before, the release
found the pool closed, the key stayed in progress for a whole lease, and the retry got 409.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from faults.server import free_port
from idempotency_mw import PostgresStore

REPOSITORY = Path(__file__).resolve().parents[1]
TENANT = "t-shutdown"  # what tests/scenarios/shutdown_app.py resolves every request to


class Server:
    """uvicorn serving tests.scenarios.shutdown_app in a child process on loopback; stopped by whoever started it."""

    def __init__(self, database_url: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "tests.scenarios.shutdown_app:app",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--lifespan",
                "on",
                "--timeout-graceful-shutdown",
                "1",
                "--log-level",
                "warning",
            ],
            cwd=REPOSITORY,
            env={**os.environ, "DATABASE_URL": database_url},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )

    async def ready(self) -> None:
        deadline = time.monotonic() + 30
        async with httpx.AsyncClient(base_url=self.url) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"the server exited: {self.output()}")
                try:
                    if (await client.get("/ready")).status_code == 200:
                        return
                except httpx.TransportError:
                    await asyncio.sleep(0.1)
        raise TimeoutError("the server did not start")

    def output(self) -> str:
        if self.process.poll() is None:
            return ""
        assert self.process.stdout is not None
        return self.process.stdout.read().decode(errors="replace")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def close(self) -> None:
        """Stop the server, and close the pipe its output came through (left open, it is a ResourceWarning)."""
        self.stop()
        if self.process.stdout is not None:
            self.process.stdout.close()


async def state_of(store: PostgresStore, key: str) -> str | None:
    record = await store.inspect(TENANT, key)
    return None if record is None else record.state


@pytest.mark.slow
async def test_sigterm_with_a_request_in_flight_releases_its_key(
    pg_store: PostgresStore, idempotency_database_url: str
) -> None:
    key = str(uuid.uuid4())
    server = Server(idempotency_database_url)
    try:
        await server.ready()
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            in_flight = asyncio.create_task(
                client.post("/charge", json={"amount": 5}, headers={"Idempotency-Key": key, "x-sleep": "10"})
            )
            for _ in range(300):  # bounded: the claim is visible once the handler runs
                if await state_of(pg_store, key) == "in_progress":
                    break
                await asyncio.sleep(0.02)
            assert await state_of(pg_store, key) == "in_progress"
            stopped = time.monotonic()
            assert await asyncio.to_thread(server.stop) in (0, -signal.SIGTERM), server.output()  # uvicorn re-raises it
            assert time.monotonic() - stopped < 10  # the graceful timeout, then a bounded wait: not the 10 s handler
            try:
                cut_off = (await in_flight).status_code  # uvicorn answers a cancelled request 500
            except httpx.TransportError:
                cut_off = 0  # or drops the connection
            assert cut_off in (0, 500)
        assert await state_of(pg_store, key) is None, server.output()  # released, not left in progress for a lease
    finally:
        server.close()

    restarted = Server(idempotency_database_url)
    try:
        await restarted.ready()
        async with httpx.AsyncClient(base_url=restarted.url, timeout=30) as client:
            retry = await client.post("/charge", json={"amount": 5}, headers={"Idempotency-Key": key, "x-sleep": "0"})
        assert retry.status_code == 201  # runs now: no 409 for the rest of a lease
        assert "idempotent-replayed" not in retry.headers
    finally:
        restarted.close()
