"""The pytest plugin and helpers apps test with (idempotency_mw.testing): what ``pytest --fixtures`` tells a user,
and running an app's lifespan around a test the way a server does."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

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
