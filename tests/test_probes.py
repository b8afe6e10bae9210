"""docs/operations.md, "gunicorn and several workers" and "Health checks and probes": the snippets, run as they
are; gunicorn with the documented worker class, as a process of its own."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from faults.server import free_port
from idempotency_mw import PostgresStore, StoreUnavailable
from idempotency_mw.store import StoreNotMigrated
from idempotency_mw.testing import run_lifespan
from tests.test_docs import page_snippets, recipe


async def test_readiness_asks_the_store_and_liveness_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, idempotency_database_url: str
) -> None:
    with recipe("probes", tmp_path, monkeypatch, DATABASE_URL=idempotency_database_url) as module:
        transport = httpx.ASGITransport(app=module.app)
        async with run_lifespan(module.app), httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            ready = await client.get("/readyz")
            assert ready.status_code == 200
            assert ready.json()["status"] == "ready"
            assert 0 < ready.json()["store_seconds"] < 5
            await module.store.close()  # as a store whose database went away answers
            unready = await client.get("/readyz")
            assert unready.status_code == 503
            assert unready.json()["status"] == "unavailable"
            live = await client.get("/livez")
            assert (live.status_code, live.json()) == (200, {"status": "alive"})


async def test_ping_names_a_missing_table_and_an_unreachable_server(idempotency_database_url: str) -> None:
    async with PostgresStore(idempotency_database_url, min_size=1, max_size=1) as store:
        assert 0 < await store.ping() < 5
    unmigrated = PostgresStore(idempotency_database_url, min_size=1, max_size=1, schema="imw_never_migrated")
    try:
        with pytest.raises(StoreNotMigrated, match="imw_never_migrated"):
            await unmigrated.ping()
    finally:
        await unmigrated.close()
    nowhere = PostgresStore(f"postgresql://nobody@127.0.0.1:{free_port()}/db", min_size=0, max_size=1, timeout=1)
    try:
        with pytest.raises(StoreUnavailable):
            await nowhere.ping()
    finally:
        await nowhere.close()


class Gunicorn:
    """gunicorn serving the probes snippet with one worker of the given class, on a free loopback port."""

    def __init__(self, project: Path, worker: str, env: dict[str, str]) -> None:
        self.port = free_port()
        command = [sys.executable, "-m", "gunicorn", "probes:app", "-k", worker, "-w", "1"]
        command += ["-b", f"127.0.0.1:{self.port}", "--graceful-timeout", "5"]
        self.process = subprocess.Popen(
            command,
            cwd=project,
            env={**os.environ, "PYTHONPATH": str(project), **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def stop(self) -> str:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        out, _ = self.process.communicate(timeout=60)
        return out

    async def get(self, path: str) -> httpx.Response | None:
        """The answer, once the server takes connections (None if it exited first)."""
        deadline = time.monotonic() + 60
        async with httpx.AsyncClient(timeout=5) as client:
            while time.monotonic() < deadline and self.process.poll() is None:
                try:
                    return await client.get(f"http://127.0.0.1:{self.port}{path}")
                except httpx.TransportError:
                    await asyncio.sleep(0.1)
        return None


def project(tmp_path: Path) -> Path:
    snippets = page_snippets()
    for name in ("workers", "probes"):
        (tmp_path / f"{name}.py").write_text(snippets[name])
    return tmp_path


@pytest.mark.slow
async def test_gunicorn_with_the_documented_worker_stops_on_a_bad_setting(
    tmp_path: Path, idempotency_database_url: str
) -> None:
    """uvicorn's own worker serves 500 on every path after a bad app-wide setting (its lifespan is "auto"); the
    documented worker class stops gunicorn, saying why, and with a good setting serves the probes."""
    where = project(tmp_path)
    bad = {"DATABASE_URL": idempotency_database_url, "IDEMPOTENCY_TENANT_SECRET": "too-short"}
    stock = Gunicorn(where, "uvicorn_worker.UvicornWorker", bad)
    try:
        answer = await stock.get("/livez")
        assert answer is not None
        assert answer.status_code == 500  # up, and useless: the liveness probe included
    finally:
        stock.stop()
    strict = Gunicorn(where, "workers.LifespanOnWorker", bad)
    try:
        assert await strict.get("/livez") is None  # never served
        code = strict.process.wait(timeout=60)
    finally:
        out = strict.stop()
    assert code != 0
    assert "IDEMPOTENCY_TENANT_SECRET" in out
    assert "Worker failed to boot" in out
    good = Gunicorn(where, "workers.LifespanOnWorker", {"DATABASE_URL": idempotency_database_url})
    try:
        live, ready = await good.get("/livez"), await good.get("/readyz")
    finally:
        good.stop()
    assert live is not None
    assert ready is not None
    assert (live.status_code, ready.status_code) == (200, 200)
