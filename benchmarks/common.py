"""What every measurement shares: the run's context (database, venv, mode, durations), copies of the library at a
git revision, and markdown helpers."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
from peers import EagerVenv
from pgserver import Database
from servers import HERE, REPO, WORK, bench_env

# The apps under test key their request fingerprints under the tenant secret (some resolve tenants their own way);
# the servers the harness starts inherit it.
os.environ.setdefault("IDEMPOTENCY_TENANT_SECRET", "benchmark-tenant-secret-0123456789abcdef")

LIBRARIES = WORK / "library"  # copies of the library at git revisions, one directory per commit
TABLES = ("idempotency_records", "idempotency_responses", "idempotency_keys", "fastapi_idempotency_requests")


@dataclass
class Context:
    db: Database
    python: str  # the benchmark venv's interpreter (peers, uvloop, httptools)
    quick: bool
    seconds: float  # one measured load run
    repetitions: int  # interleaved repetitions of the end-to-end runs
    peers: dict[str, str | None]  # peer -> None if usable, else why not
    eager: EagerVenv | None = None  # the same runtime on Python 3.12+, for target 14.1 (end to end only)

    def usable_peers(self) -> list[str]:
        return [name for name, problem in self.peers.items() if problem is None]

    def script(self, name: str, *args: str, timeout: float = 900) -> Any:
        """Run ``benchmarks/<name>`` in the benchmark venv and return the JSON it prints."""
        done = subprocess.run(
            [self.python, str(HERE / name), *args],
            cwd=str(HERE),
            env=bench_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(done.stdout)


async def reset_tables(url: str) -> None:
    """Empty every idempotency table (ours and the peers') and checkpoint, so runs start alike."""
    connection = await asyncpg.connect(url)
    try:
        existing = await connection.fetch("SELECT tablename FROM pg_tables WHERE tablename = ANY($1::text[])", TABLES)
        if existing:  # together: the responses' foreign key refuses a truncation of the records alone
            await connection.execute("TRUNCATE " + ", ".join(f'"{row["tablename"]}"' for row in existing))
        await connection.execute("CHECKPOINT")
    finally:
        await connection.close()


def reset(url: str) -> None:
    asyncio.run(reset_tables(url))


COUNTERS = """
SELECT sum(calls)::bigint AS statements, sum(total_exec_time) AS exec_ms, sum(shared_blks_hit)::bigint AS blks_hit,
       sum(shared_blks_read)::bigint AS blks_read, sum(wal_fpi)::bigint AS wal_fpi, sum(wal_bytes)::bigint AS wal_bytes
FROM pg_stat_statements
WHERE query NOT ILIKE '%pg_stat_statements%'
  AND ($1::text IS NULL OR dbid = (SELECT oid FROM pg_database WHERE datname = $1))
"""


async def _counters(url: str, database: str | None) -> dict[str, float] | None:
    connection = await asyncpg.connect(url)
    try:
        row = await connection.fetchrow(COUNTERS, database)
    except asyncpg.PostgresError:  # pg_stat_statements is not loaded (a DATABASE_URL server)
        return None
    finally:
        await connection.close()
    return {name: float(value or 0) for name, value in row.items()} if row else None


def server_counters(url: str, database: str | None = None) -> dict[str, float] | None:
    """What the server's statements have done so far, summed over ``pg_stat_statements`` (updated as each statement
    ends, so exact at any moment): statements, execution ms, shared-buffer hits and reads (a read is a page that
    was not in shared_buffers), WAL full-page images and WAL bytes; of one ``database`` or all. None where the
    extension is not loaded.

    The difference between two calls divided by the requests in between says where a run's database time went.
    """
    return asyncio.run(_counters(url, database))


STATEMENTS = """
SELECT query, calls::bigint, total_exec_time, wal_bytes::bigint FROM pg_stat_statements
WHERE query NOT ILIKE '%pg_stat_statements%'
"""


def statement_name(query: str) -> str:
    """Which of the store's statements (or the transaction's) a ``pg_stat_statements`` text is."""
    for marker, name in (  # pg_stat_statements shows constants as $n: the markers avoid them
        ("claimed AS (", "claim_locked"),
        ("updated AS (", "claim_or_take_over"),
        ("counted AS (", "claim"),
        ("WITH owned AS", "complete"),
        ("INSERT INTO idempotency_responses", "complete in the transaction"),
        ("SET lease_expires_at", "renew"),
        ("DELETE FROM", "release or purge"),
        ("COMMIT", "COMMIT"),
        ("BEGIN", "BEGIN"),
    ):
        if marker in query:
            return name
    return "other"


async def _statements(url: str) -> dict[str, dict[str, float]] | None:
    connection = await asyncpg.connect(url)
    try:
        rows = await connection.fetch(STATEMENTS)
    except asyncpg.PostgresError:
        return None
    finally:
        await connection.close()
    out: dict[str, dict[str, float]] = {}
    for row in rows:
        entry = out.setdefault(statement_name(row["query"]), {"calls": 0.0, "exec_ms": 0.0, "wal_bytes": 0.0})
        entry["calls"] += row["calls"]
        entry["exec_ms"] += row["total_exec_time"]
        entry["wal_bytes"] += float(row["wal_bytes"] or 0)
    return out


def statements(url: str) -> dict[str, dict[str, float]] | None:
    """``pg_stat_statements`` summed by statement (``statement_name``): calls, execution ms, WAL bytes so far."""
    return asyncio.run(_statements(url))


def statements_per_request(
    before: dict[str, dict[str, float]] | None, after: dict[str, dict[str, float]] | None, requests: int
) -> dict[str, dict[str, float]] | None:
    """Calls, execution µs and WAL bytes per request of each statement, between two ``statements`` readings."""
    if before is None or after is None or not requests:
        return None
    out: dict[str, dict[str, float]] = {}
    for name, end in after.items():
        start = before.get(name, {"calls": 0.0, "exec_ms": 0.0, "wal_bytes": 0.0})
        calls = end["calls"] - start["calls"]
        if calls > 0:
            out[name] = {
                "calls": calls / requests,
                "exec_us": (end["exec_ms"] - start["exec_ms"]) * 1000 / requests,
                "wal_bytes": (end["wal_bytes"] - start["wal_bytes"]) / requests,
            }
    return out


async def _wal_position(url: str) -> int:
    connection = await asyncpg.connect(url)
    try:
        return int(await connection.fetchval("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint"))
    finally:
        await connection.close()


def wal_position(url: str) -> int:
    """Bytes of WAL the server has written since it was created: the difference between two calls is the WAL
    generated in between, by everyone."""
    return asyncio.run(_wal_position(url))


def per_request(
    before: dict[str, float] | None, after: dict[str, float] | None, requests: int
) -> dict[str, float] | None:
    if before is None or after is None or not requests:
        return None
    return {name: (after[name] - before[name]) / requests for name in before}


# --- the library at another git revision ---------------------------------------------------------------------------


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def library_copy(ref: str) -> tuple[str, Path]:
    """(commit, directory holding its ``idempotency_mw``): ``ref``'s library extracted once into .work, to be put
    first on the ``PYTHONPATH`` of a process that runs it beside the working tree's."""
    commit = git("rev-parse", "--verify", f"{ref}^{{commit}}")
    destination = LIBRARIES / commit[:12]
    if not (destination / "idempotency_mw" / "__init__.py").exists():
        archive = subprocess.run(
            ["git", "archive", "--format=tar", commit, "idempotency_mw"], cwd=REPO, capture_output=True, check=True
        ).stdout
        partial = destination.with_name(destination.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(partial, filter="data")
        shutil.rmtree(destination, ignore_errors=True)
        partial.rename(destination)
    return commit, destination


def library_digest(root: Path) -> str:
    """A digest of the library's source (``.py`` and ``.sql`` files under ``root/idempotency_mw``)."""
    digest = hashlib.sha256()
    package = root / "idempotency_mw"
    for path in sorted(p for p in package.rglob("*") if p.suffix in (".py", ".sql") and "__pycache__" not in p.parts):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def working_tree() -> dict[str, Any]:
    """The commit the working tree is on, and whether its library has changes not committed."""
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--", "idempotency_mw"))}


def check_copy(what: str, imported: str | Path, root: Path) -> None:
    """Stop the run unless ``what`` imported ``idempotency_mw`` from ``root``: a copy on the wrong path (or an
    installed library before it) would measure other code than the results name."""
    expected = (root / "idempotency_mw").resolve()
    if Path(imported).resolve() != expected:
        raise RuntimeError(f"{what} imported idempotency_mw from {imported}, not {expected}")


def median(values: Iterable[float]) -> float:
    return float(statistics.median(list(values)))


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval for the median: the k-th smallest and k-th largest value, k the
    largest count such that fewer than k of n values fall below the true median with probability at most
    (1 - confidence) / 2 (each value does with probability one half). None when n is too small for the confidence
    (fewer than 6 values at 95%). No assumption about the shape of the rounds' spread, which a shared machine
    does not give."""
    ordered = sorted(values)
    n = len(ordered)
    tail = (1 - confidence) / 2
    k, below = 0, 0  # below: the number of outcomes of n fair coin flips with fewer than k heads
    while below + math.comb(n, k) <= tail * 2**n:
        below += math.comb(n, k)
        k += 1
    return (ordered[k - 1], ordered[n - k]) if k else None


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else "met" if ok else "**missed**"


@dataclass(frozen=True)
class Target:
    """One target of issue 5 with what a run measured: the per-measurement files and the summary both list these."""

    what: str  # the target, in words
    goal: str  # e.g. "≥ 2x"
    measured: str
    ok: bool | None  # None: nothing to judge (no target set, or not measurable in this run)

    @property
    def verdict(self) -> str:
        return verdict(self.ok)


def target_table(targets: Iterable[Target]) -> str:
    return table(["target", "goal", "measured", "verdict"], [[t.what, t.goal, t.measured, t.verdict] for t in targets])


def machine() -> dict[str, str]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = ""
    try:
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        memory = f"{kib / 1024 / 1024:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "memory": memory,
        "os": platform.platform(),
        "python": sys.version.split()[0],
    }


def load_average() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f} (1 min), {five:.1f} (5 min)"


# -- databases of their own, migrated by a library copy ---------------------------------------------------------

MIGRATE = """\
import asyncio, json, sys
import idempotency_mw
from idempotency_mw import PostgresStore

async def main() -> list[str]:
    store = PostgresStore(sys.argv[1], min_size=1, max_size=1)
    try:
        return list(await store.migrate())
    finally:
        await store.close()

print(json.dumps({"path": idempotency_mw.__path__[0], "applied": asyncio.run(main())}))
"""


def database_url(url: str, name: str) -> str:
    """``url`` with its database replaced by ``name`` (the server, user and options kept)."""
    return urlunsplit(urlsplit(url)._replace(path="/" + name))


async def recreate_databases(url: str, names: Sequence[str], create: bool) -> None:
    """Drop each of ``names`` on the server of ``url`` (one left by an interrupted run too), and create it again
    empty with ``create``."""
    connection = await asyncpg.connect(url)
    try:
        for name in names:
            await connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            if create:
                await connection.execute(f'CREATE DATABASE "{name}"')
    finally:
        await connection.close()


def migrate_with(python: str, url: str, root: Path) -> dict[str, Any]:
    """Migrate ``url`` with the library under ``root``, in a process of its own that imports that copy: the
    directory it imported ``idempotency_mw`` from and the migrations it applied."""
    done = subprocess.run(
        [python, "-c", MIGRATE, url],
        cwd=str(HERE),
        env=bench_env(str(root)),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"migrating with the library under {root} failed:\n{done.stderr[-3000:]}")
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found
