"""The pytest plugin and helpers apps test with (idempotency_mw.testing): what ``pytest --fixtures`` tells a user,
and running an app's lifespan around a test the way a server does."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest
from starlette.applications import Starlette
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from idempotency_mw.testing import run_lifespan


@pytest.mark.slow
def test_pytest_fixtures_says_what_each_fixture_gives(tmp_path: Path) -> None:
    """``pytest --fixtures`` showed "no docstring available" for both of the plugin's fixtures."""
    (tmp_path / "pytest.ini").write_text("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--fixtures", "-p", "no:cacheprovider", "-q"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    shown = {
        match["name"]: match["doc"]
        for match in re.finditer(r"^(?P<name>idempotency_\w+)\b.*\n(?P<doc>(?:    .*\n)+)", done.stdout, re.MULTILINE)
    }
    assert set(shown) == {"idempotency_database_url", "idempotency_store"}, done.stdout
    for name, doc in shown.items():
        assert "no docstring available" not in doc, name
    assert "DATABASE_URL" in shown["idempotency_database_url"]
    assert "PostgresStore" in shown["idempotency_store"]


# Every test claims the same key: on a database shared between workers, the second worker's claim would find the
# first's in progress.
WORKER_TESTS = """
import asyncpg
import pytest

from idempotency_mw.store import ClaimOutcome


@pytest.mark.asyncio
async def test_the_key_is_this_workers_alone(idempotency_store, idempotency_database_url):
    claim = await idempotency_store.claim("t", "one-key", b"f" * 32, lease=30, ttl=60)
    assert claim.outcome is ClaimOutcome.OWNED
    connection = await asyncpg.connect(idempotency_database_url)
    try:
        name = await connection.fetchval("SELECT current_database()")
    finally:
        await connection.close()
    with open("databases.txt", "a") as seen:
        seen.write(name + "\\n")
"""


@pytest.mark.slow
async def test_each_xdist_worker_on_database_url_gets_a_database_of_its_own(
    tmp_path: Path, idempotency_database_url: str
) -> None:
    """Under pytest-xdist the workers shared $DATABASE_URL's database: one worker's records answered another's
    claims. Each now creates its own, named after the worker, and drops it after the session."""
    (tmp_path / "pytest.ini").write_text("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    (tmp_path / "test_workers.py").write_text(WORKER_TESTS)
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "each", "-p", "no:cacheprovider", "-q"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "DATABASE_URL": idempotency_database_url},
    )
    assert "2 passed" in done.stdout, done.stdout + done.stderr
    base = urlsplit(idempotency_database_url).path.lstrip("/")
    seen = (tmp_path / "databases.txt").read_text().split()
    assert sorted(seen) == [f"{base}_gw0", f"{base}_gw1"]
    connection = await asyncpg.connect(idempotency_database_url)
    try:
        left = await connection.fetch("SELECT datname FROM pg_database WHERE datname = ANY($1)", seen)
    finally:
        await connection.close()
    assert left == []  # dropped after the session


class Recorder:
    """A plain ASGI middleware that notes the lifespan messages passing through it."""

    def __init__(self, app: ASGIApp, seen: list[str]) -> None:
        self.app = app
        self.seen = seen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def noted_receive() -> Message:
            message = await receive()
            self.seen.append(message["type"])
            return message

        async def noted_send(message: Message) -> None:
            self.seen.append(message["type"])
            await send(message)

        await self.app(scope, noted_receive, noted_send)


def app_with(seen: list[str], *, fail: bool = False) -> Any:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if fail:
            raise RuntimeError("the database is not migrated")
        seen.append("open")
        yield
        seen.append("close")

    app = Starlette(lifespan=lifespan)
    app.add_middleware(Recorder, seen=seen)
    return app


async def test_run_lifespan_starts_the_app_before_the_block_and_stops_it_after() -> None:
    """httpx's ASGITransport runs no lifespan, so an app that opens its store at startup had none in its tests."""
    seen: list[str] = []
    async with run_lifespan(app_with(seen)):
        assert seen == ["lifespan.startup", "open", "lifespan.startup.complete"]  # through the middleware too
    assert seen[3:] == ["lifespan.shutdown", "close", "lifespan.shutdown.complete"]


async def test_run_lifespan_raises_when_the_startup_fails() -> None:
    seen: list[str] = []
    with pytest.raises(RuntimeError, match="the database is not migrated"):
        async with run_lifespan(app_with(seen, fail=True)):
            raise AssertionError("the block must not run")
