"""What every measurement shares: the run's context (database, venv, mode, durations), copies of the library at a
git revision, bulk-loaded records, statistics, markdown helpers, and publishing a result into ``results/``."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
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
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
from peers import EagerVenv
from pgserver import Database
from servers import HERE, REPO, WORK, bench_env

# An app built in this process that resolves tenants its own way keys its request fingerprints under the tenant
# secret. The servers and scripts the harness starts get no IDEMPOTENCY_* variable (servers.bench_env: a peer reads
# some): their apps give the default resolver the benchmarks' secret themselves (benchapp.TENANT_SECRET).
os.environ.setdefault("IDEMPOTENCY_TENANT_SECRET", "benchmark-tenant-secret-0123456789abcdef")

LIBRARIES = WORK / "library"  # copies of the library at git revisions, one directory per commit
TABLES = (
    "idempotency_records",
    "idempotency_responses",
    "idempotency_recovery_points",  # refers to the records: truncated with them
    "idempotency_replays",
    "idempotency_keys",
    "fastapi_idempotency_requests",
)
RESULTS = HERE / "results"
RAW = RESULTS / "raw"
# What run.py runs, in the order the summary lists it: each backs a claim of the project's README.
MEASUREMENTS = ("roundtrips", "overhead", "endtoend", "scale", "gc", "durability", "opcodes")
VERSIONS = (
    "starlette",
    "fastapi",
    "uvicorn",
    "uvloop",
    "httptools",
    "asyncpg",
    "fastidempotent",
    "fastapi-idempotency",
    "sqlalchemy",
    "tortoise-orm",
)


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
    """One goal with what a run measured: the per-measurement files and the summary both list these."""

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


# -- completed records bulk-loaded into the store's tables (scale and purge) ---------------------------------------

REPLAYABLE_EVERY = 100  # every 100th generated key belongs to the load generator's tenant and replays
STORED_BODY = b'{"id":1,"status":"accepted","amount":1250,"currency":"eur","customer":"cus_42"}'
CHUNK = 1_000_000
STORE_TABLES = ("idempotency_records", "idempotency_responses")
# Constraints by kind, in the order they come back: the primary keys before the foreign key that needs one.
KINDS = {"p": "PRIMARY KEY", "u": "UNIQUE"}

BULK_RECORDS = """
INSERT INTO idempotency_records (tenant, key, fingerprint, fence, lease_expires_at, attempts, created_at, expires_at)
SELECT CASE WHEN i % $4 = 0 THEN $1 ELSE 'tenant-' || (i % 997) END,
       $2 || '-' || i, $3, i, NULL, 0,
       now() - interval '1 hour',
       CASE WHEN $7::boolean THEN now() - interval '1 hour' - (i % 3600) * interval '1 second'
            ELSE now() + interval '24 hours' END
FROM generate_series($5::bigint, $6::bigint) AS i
"""

BULK_RESPONSES = """
INSERT INTO idempotency_responses (tenant, key, fence, status, headers, body, body_size, completed_at)
SELECT CASE WHEN i % $4 = 0 THEN $1 ELSE 'tenant-' || (i % 997) END,
       $2 || '-' || i, i, 201, $3::jsonb, $7::bytea, octet_length($7::bytea), now() - interval '1 hour'
FROM generate_series($5::bigint, $6::bigint) AS i
"""


@contextmanager
def as_served() -> Iterator[None]:
    """This process's environment as the servers under test get it (``servers.bench_env``): no ``IDEMPOTENCY_*``."""
    saved = {name: os.environ.pop(name) for name in list(os.environ) if name.startswith("IDEMPOTENCY_")}
    try:
        yield
    finally:
        os.environ.update(saved)


async def served_record() -> tuple[str, bytes]:
    """(tenant, stored fingerprint) of the load generator's request as the benchmark servers' middleware stores it
    (``benchapp``'s ``ours``: the default tenant resolver under the benchmarks' secret). Asked of the library itself,
    a ``MemoryStore`` behind the same middleware, so that bulk-loaded records match the way served ones do, however
    the library keys its fingerprints."""
    import httpx
    from benchapp import TENANT_SECRET, routes
    from loadgen import BODY, HEADERS
    from starlette.applications import Starlette
    from starlette.middleware import Middleware

    from idempotency_mw import AuthorizationTenant, IdempotencyMiddleware, MemoryStore

    store, resolver = MemoryStore(), AuthorizationTenant(TENANT_SECRET)
    with as_served():
        app = Starlette(routes=routes(), middleware=[Middleware(IdempotencyMiddleware, store=store, tenant=resolver)])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench") as client:
        answer = await client.post("/orders", content=BODY, headers={**HEADERS, "idempotency-key": "probe"})
    tenant = resolver({"headers": [(b"authorization", HEADERS["authorization"].encode())]})
    record = await store.inspect(tenant, "probe") if answer.status_code == 201 and tenant else None
    if tenant is None or record is None:
        raise RuntimeError(f"the probe request stored no record under its tenant (answered {answer.status_code})")
    return tenant, record.fingerprint


async def add_records(url: str, start: int, stop: int, *, prefix: str, expired: bool = False) -> float:
    """Insert completed keys ``<prefix>-<start>`` … ``<prefix>-<stop-1>`` (records and their responses); return the
    seconds it took, indexes included.

    Rows come from ``INSERT … SELECT … FROM generate_series`` with the tables' indexes and constraints dropped first
    and rebuilt afterwards from their own definitions, then ``VACUUM ANALYZE``: building a B-tree once is much faster
    than inserting millions of random keys into it, and the result is the table a long-running service would have.
    Every ``REPLAYABLE_EVERY``-th row is the load generator's request under its tenant (:func:`served_record`), so
    those keys replay; the rest are spread over other tenants."""
    from idempotency_mw.store import encode_headers  # how the responses table keeps headers

    tenant, stored_fingerprint = await served_record()
    headers = encode_headers(
        [(b"content-length", str(len(STORED_BODY)).encode()), (b"content-type", b"application/json")]
    )
    began = time.perf_counter()
    connection = await asyncpg.connect(url, command_timeout=3600)
    try:
        await connection.execute("SET maintenance_work_mem = '1GB'")
        foreign_keys = await connection.fetch(
            "SELECT conname, conrelid::regclass::text AS table_name, pg_get_constraintdef(oid) AS definition "
            "FROM pg_constraint WHERE contype = 'f' "
            "AND (conrelid = ANY($1::regclass[]) OR confrelid = ANY($1::regclass[]))",  # the recovery points' too
            list(STORE_TABLES),
        )
        indexes = await connection.fetch(
            "SELECT i.tablename, i.indexname, i.indexdef, c.conname, c.contype FROM pg_indexes i "
            "LEFT JOIN pg_constraint c ON c.conindid = (quote_ident(i.schemaname) || '.' || "
            "quote_ident(i.indexname))::regclass AND c.contype IN ('p', 'u') "
            "WHERE i.tablename = ANY($1::text[])",
            list(STORE_TABLES),
        )
        for foreign_key in foreign_keys:
            await connection.execute(
                f'ALTER TABLE {foreign_key["table_name"]} DROP CONSTRAINT "{foreign_key["conname"]}"'
            )
        for index in indexes:
            if index["conname"]:
                await connection.execute(f'ALTER TABLE {index["tablename"]} DROP CONSTRAINT "{index["conname"]}"')
            else:
                await connection.execute(f'DROP INDEX "{index["indexname"]}"')
        try:
            for low in range(start, stop, CHUNK):
                high = min(stop, low + CHUNK) - 1
                shared = (tenant, prefix, stored_fingerprint, REPLAYABLE_EVERY, low, high)
                await connection.execute(BULK_RECORDS, *shared, expired)
                await connection.execute(BULK_RESPONSES, *shared[:2], headers, *shared[3:], STORED_BODY)
        finally:  # the indexes and constraints come back even if the load failed
            for index in indexes:
                await connection.execute(index["indexdef"])
                if index["conname"]:
                    code = index["contype"]  # a "char": asyncpg returns it as bytes
                    kind = KINDS[code.decode() if isinstance(code, bytes) else code]
                    await connection.execute(
                        f'ALTER TABLE {index["tablename"]} ADD CONSTRAINT "{index["conname"]}" '
                        f'{kind} USING INDEX "{index["indexname"]}"'
                    )
            for foreign_key in foreign_keys:
                await connection.execute(
                    f'ALTER TABLE {foreign_key["table_name"]} ADD CONSTRAINT "{foreign_key["conname"]}" '
                    f"{foreign_key['definition']}"
                )
        for name in STORE_TABLES:
            await connection.execute(f"VACUUM ANALYZE {name}")
        await connection.execute("CHECKPOINT")
    finally:
        await connection.close()
    return time.perf_counter() - began


async def table_size(url: str) -> tuple[int, int]:
    """(records, bytes with indexes of the records and their responses)."""
    connection = await asyncpg.connect(url)
    try:
        rows = await connection.fetchval("SELECT count(*) FROM idempotency_records")
        size = await connection.fetchval(
            "SELECT pg_total_relation_size('idempotency_records') + pg_total_relation_size('idempotency_responses')"
        )
        return int(rows), int(size)
    finally:
        await connection.close()


# -- publishing: results/<name>.md, results/raw/<name>.json and the summary, results/README.md ----------------------


def installed_versions() -> dict[str, str]:
    """The versions of ``VERSIONS`` installed in this interpreter (a measurement that runs in the project's venv)."""
    found = {}
    for name in VERSIONS:
        with suppress(PackageNotFoundError):
            found[name] = version(name)
    return found


def measurement_meta(
    *,
    began: float,
    mode: str,
    postgres: str,
    database: str,
    load_before: str,
    versions: dict[str, str],
    seconds: float,
) -> dict[str, Any]:
    """What :func:`publish` records beside a measurement's result: when, how, on what."""
    return {
        "started": datetime.datetime.fromtimestamp(began).strftime("%Y-%m-%d %H:%M"),
        "mode": mode,
        "minutes": (time.time() - began) / 60,
        "machine": machine(),
        "postgres": postgres,
        "database": database,
        "load_start": load_before,
        "load_end": load_average(),
        "versions": {k: versions.get(k) for k in VERSIONS},
        "seconds_per_run": seconds,
    }


def header(meta: dict[str, Any]) -> str:
    m = meta["machine"]
    return (
        f"_Measured {meta['started']} ({meta['mode']} mode, {meta['minutes']:.1f} min) on {m['cpu']}, "
        f"{m['cores']} cores, {m['memory']}, {m['os']}; Python {m['python']}, PostgreSQL {meta['postgres']} "
        f"({meta['database']}). Load average before {meta['load_start']}, after {meta['load_end']}: this is a "
        "shared machine, so compare ratios within one run, not absolute numbers across runs._"
    )


def publish(name: str, markdown: str, result: dict[str, Any], targets: Iterable[Target], **meta: Any) -> Path:
    """Write one measurement: ``raw/<name>.json`` (its result, the targets judged from it, and
    ``measurement_meta(**meta)``), ``<name>.md`` (the markdown and its header), then the summary again; return the
    markdown file."""
    recorded = measurement_meta(**meta)
    RAW.mkdir(parents=True, exist_ok=True)
    judged = [dataclasses.asdict(t) for t in targets]
    raw = {"meta": recorded, "targets": judged, "result": result}
    (RAW / f"{name}.json").write_text(json.dumps(raw, indent=1, default=str) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown + "\n\n" + header(recorded) + "\n")
    (RESULTS / "README.md").write_text(summary() + "\n")
    return RESULTS / f"{name}.md"


def summary() -> str:
    """``results/README.md``: the targets of every measurement as judged when it ran, read from ``raw/``. Only the
    measurements in ``MEASUREMENTS`` and the comparisons of ``compare.py`` (``compare``, ``compare-<name>``) are
    listed, whatever else lies there."""
    rows: list[list[str]] = []
    runs, modes = [], set()
    comparisons = sorted(path.stem for path in RAW.glob("compare*.json"))
    for name in (*MEASUREMENTS, *comparisons):
        path = RAW / f"{name}.json"
        if not path.exists():
            if name in MEASUREMENTS:
                rows.append([name, "", "not measured yet: run.py --only " + name, "n/a", ""])
            continue
        data = json.loads(path.read_text())
        meta = data.get("meta", {})
        link = f"[{name}.md]({name}.md) ({meta.get('mode', '?')})"
        if "targets" not in data:
            rows.append([name, "", f"raw/{name}.json was written by an older harness: re-run it", "n/a", link])
            continue
        rows += [[t.what, t.goal, t.measured, t.verdict, link] for t in (Target(**found) for found in data["targets"])]
        if meta:
            runs.append(f"{name} {meta['started']} ({meta['mode']} mode, {meta['minutes']:.1f} min)")
            modes |= {meta["mode"]} & {"quick", "full"}  # a count (opcodes.py's "exact") has no quick mode
    mixed = (
        [f"**These results come from runs in different modes** ({', '.join(sorted(modes))}): see each row's mode."]
        if len(modes) > 1
        else []
    )
    return "\n\n".join(
        [
            "# Benchmark results",
            "Written by `benchmarks/run.py` (`./dev bench --quick`, or without `--quick` the full run) and by the "
            "scripts run on their own (`opcodes.py`, `durability.py`, `compare.py`); see [../README.md](../README.md) "
            "for what is measured and how. Each verdict is computed from the measurement's raw result "
            "(`raw/<name>.json`, where it is kept beside the result), and every ratio compares numbers taken side by "
            "side in one run on one machine. Absolute numbers in the linked files are context for that machine only.",
            table(["target", "goal", "measured", "verdict", "details (mode)"], rows),
            *mixed,
            f"Runs: {'; '.join(runs)}.",
        ]
    )
