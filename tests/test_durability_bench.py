"""The durability benchmark's own logic (``benchmarks/durability.py``): its verdicts, its reading of PostgreSQL's and
pg_test_fsync's numbers, the shim it builds, and the app it serves. Nothing here times anything."""

from __future__ import annotations

import ctypes
import errno
import importlib
import os
import shutil
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import asyncpg
import httpx
import pytest

import idempotency_mw

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

PG_TEST_FSYNC = """\
5 seconds per test
O_DIRECT supported on this platform for open_datasync and open_sync.

Compare file sync methods using one 8kB write:
(in "wal_sync_method" preference order, except fdatasync is Linux's default)
        open_datasync                      8538.530 ops/sec     117 usecs/op
        fdatasync                           711.763 ops/sec    1405 usecs/op
        fsync                               729.748 ops/sec    1370 usecs/op
        fsync_writethrough                              n/a
        open_sync                          8551.453 ops/sec     117 usecs/op

Compare file sync methods using two 8kB writes:
(in "wal_sync_method" preference order, except fdatasync is Linux's default)
        open_datasync                      4839.255 ops/sec     207 usecs/op
        fdatasync                           690.000 ops/sec    1449 usecs/op
"""


@pytest.fixture
def durability(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("durability")


@pytest.fixture
def durableapp(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("durableapp")


def test_pg_test_fsync_is_read_from_its_first_section(durability: ModuleType) -> None:
    assert durability.parse_pg_test_fsync(PG_TEST_FSYNC) == {
        "open_datasync": 117.0,
        "fdatasync": 1405.0,
        "fsync": 1370.0,
        "open_sync": 117.0,
    }


def test_pg_test_fsync_cut_short_gives_what_it_printed(durability: ModuleType) -> None:
    """The harness stops pg_test_fsync once the first section has its fsync line: a partial output reads as such."""
    partial = PG_TEST_FSYNC.split("        fsync  ")[0]
    assert durability.parse_pg_test_fsync(partial) == {"open_datasync": 117.0, "fdatasync": 1405.0}
    assert durability.parse_pg_test_fsync("5 seconds per test\n") == {}


def rows(**fsyncs: int | None) -> list[dict[str, Any]]:
    return [
        {"backend_type": kind.replace("_", " "), "fsyncs": n, "fsync_time": None if n is None else n * 1.5}
        for kind, n in fsyncs.items()
    ]


def test_wal_flushes_per_request_from_pg_stat_io(durability: ModuleType) -> None:
    """Every backend type's flushes count, a type that cannot flush (NULL) is skipped, the time is per flush."""
    before = durability.Counters.from_rows(1000, rows(client_backend=50, walwriter=3, checkpointer=1, startup=None))
    after = durability.Counters.from_rows(1900, rows(client_backend=650, walwriter=6, checkpointer=1, startup=None))
    measured = before.per_request(after, 300)
    assert measured["flushes"] == pytest.approx(603 / 300)
    assert measured["flushes_by"] == {"client backend": 2.0, "walwriter": 0.01}
    assert measured["commits"] == 3.0
    assert measured["flush_ms"] == pytest.approx(1.5)


def test_wal_flushes_before_postgresql_18(durability: ModuleType) -> None:
    """pg_stat_wal has one wal_sync for the whole server, and no time unless track_wal_io_timing is on."""
    before = durability.Counters.from_rows(10, [{"backend_type": "all", "fsyncs": 100, "fsync_time": 0.0}])
    after = durability.Counters.from_rows(310, [{"backend_type": "all", "fsyncs": 400, "fsync_time": 0.0}])
    measured = before.per_request(after, 300)
    assert (measured["flushes"], measured["commits"], measured["flushes_by"]) == (1.0, 1.0, {"all": 1.0})
    assert measured["flush_ms"] == 0.0


def test_the_shims_counts_per_request(durability: ModuleType) -> None:
    before = dict.fromkeys(durability.SHIM_FIELDS, 0)
    after = {**before, "fdatasync": 600, "fsync": 3, "delayed": 603, "delayed_ns": 603 * 1_100_000}
    assert durability.shim_per_request(before, after, 300) == {"fdatasync": 2.0, "fsync": 0.01, "added_ms": 1.1}
    assert durability.shim_per_request(before, before, 0)["added_ms"] == 0.0


def test_slices_with_unexpected_answers_do_not_count(durability: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    loadgen = importlib.import_module("loadgen")  # a script of benchmarks/, on the path for this test

    def load(statuses: dict[str, int], replayed: int = 0) -> Any:
        return loadgen.Load(100, 1.0, 1.0, 1.0, 1.0, 1.0, statuses, replayed, {"connect": 0, "timeout": 0})

    assert durability.check_load(load({"201": 100})) is None
    assert "statuses" in durability.check_load(load({"201": 99, "503": 1}))
    assert "replays" in durability.check_load(load({"201": 100}, replayed=2))


def slice_(p50: float, rps: float, invalid: str | None = None) -> dict[str, Any]:
    return {
        "c1": {"p50_ms": p50, "p99_ms": p50 * 3, "rps": 1000 / p50, "fdatasync": 1.0, "invalid": invalid},
        "c16": {"p50_ms": p50 * 4, "p99_ms": p50 * 9, "rps": rps, "fdatasync": 0.5, "invalid": invalid},
    }


def counted(flushes: float, commits: float, invalid: str | None = None) -> dict[str, Any]:
    return {
        "flushes": flushes,
        "flushes_by": {"client backend": flushes},
        "commits": commits,
        "flush_ms": 1.2,
        "shim": {"fdatasync": flushes, "fsync": 0.0, "added_ms": 1.1},
        "requests": 300,
        "seconds": 1.0,
        "statuses": {"201": 300},
        "invalid": invalid,
        "p50_ms": 1.3,
    }


def result(
    *, flushes_now: float, slow_now: tuple[float, float], fast_now: tuple[float, float], rounds: int = 6
) -> dict[str, Any]:
    """A raw result: the hand-written app at 4.0 ms / 1300 req/s with the slow flush and 1.6 ms / 1600 without,
    ours before at 4.8 / 780 and 2.0 / 1000, ours now as given (p50 at concurrency 1, requests/s at 16)."""
    counts = {
        condition: {
            "reference": counted(1.0, 1.0),
            "handwritten": counted(2.0, 2.0),
            "before": counted(2.0, 3.0),
            "now": counted(flushes_now, 3.0),
        }
        for condition in ("slow", "fast")
    }
    entry = {
        "order": ["handwritten", "before", "now"],
        "conditions": ["slow", "fast"],
        "slow": {"handwritten": slice_(4.0, 1300), "before": slice_(4.8, 780), "now": slice_(*slow_now)},
        "fast": {"handwritten": slice_(1.6, 1600), "before": slice_(2.0, 1000), "now": slice_(*fast_now)},
    }
    return {
        "settings": {"rounds": rounds, "slice_seconds": 1.0, "delay_ms": 1.0, "requests": 300, "before": "main"},
        "library": {
            "before": {"ref": "main", "commit": "a" * 40, "path": "/x"},
            "now": {"commit": "b" * 40, "dirty": False, "path": "/y"},
            "identical": True,
        },
        "server": {"version": "18.6", "settings": {}},
        "checks": {
            "pg_test_fsync": {"without": {"fdatasync": 110.0, "fsync": 140.0}, "with": {"fdatasync": 1230.0}},
            "insert_ms": {"without": 0.27, "pass_through": 0.27, "with": 1.37},
            "shim_loaded": True,
        },
        "counts": counts,
        "rounds": [entry for _ in range(rounds)],
    }


def verdicts(durability: ModuleType, raw: dict[str, Any]) -> list[bool | None]:
    return [target.ok for target in durability.targets(raw)]


def test_todays_library_misses_the_goals_and_is_no_worse_than_itself(durability: ModuleType) -> None:
    """Before the change (b) and (c) are the same code: two flushes, and the times of ours before."""
    raw = result(flushes_now=2.0, slow_now=(4.8, 780), fast_now=(2.0, 1000))
    assert verdicts(durability, raw) == [False, False, False, False, True, True]


def test_one_flush_and_faster_than_the_two_commit_app_meets_every_goal(durability: ModuleType) -> None:
    raw = result(flushes_now=1.0, slow_now=(2.4, 1400), fast_now=(1.9, 1600))
    assert verdicts(durability, raw) == [True, True, True, True, True, True]
    markdown = durability.render(raw)
    assert "| WAL flushes per fresh transactional request" in markdown
    assert "0.600x (6 rounds, 0.60-0.60x; 95% interval 0.60-0.60x)" in markdown
    assert "the same library code" in markdown


def test_each_goal_just_inside_and_just_outside(durability: ModuleType) -> None:
    """A background flush now and then is allowed, a second flush per request is not."""
    inside = result(flushes_now=1.05, slow_now=(4.0 * 0.599, 1301), fast_now=(2.0 * 1.049, 1521))
    assert verdicts(durability, inside) == [True, True, True, True, True, True]
    outside = result(flushes_now=1.06, slow_now=(4.0 * 0.601, 1299), fast_now=(2.0 * 1.051, 949))
    assert verdicts(durability, outside) == [False, False, False, False, False, False]


def test_slices_that_do_not_count_leave_their_round_out(durability: ModuleType) -> None:
    raw = result(flushes_now=1.0, slow_now=(2.0, 1400), fast_now=(2.0, 1600))
    raw["rounds"] = [
        *raw["rounds"][:5],
        {**raw["rounds"][5], "slow": {**raw["rounds"][5]["slow"], "now": slice_(9.0, 10, invalid="statuses")}},
    ]
    assert len(durability.round_ratios(raw, "slow", "now", "handwritten", "c1.p50_ms")) == 5
    assert durability.slice_values(raw, "slow", "now", "c16.rps") == [1400] * 5
    assert verdicts(durability, raw) == [True, True, True, True, True, True]
    assert "Slices that do not count: round 6, slow, now, c1: statuses" in durability.render(raw)


def test_nothing_to_judge_is_not_a_verdict(durability: ModuleType) -> None:
    """A count with unexpected answers, or no round where both slices count, is n/a, neither met nor missed."""
    raw = result(flushes_now=1.0, slow_now=(2.0, 1400), fast_now=(2.0, 1600))
    raw["counts"]["slow"]["now"] = counted(1.0, 3.0, invalid="statuses {201: 299, 503: 1}")
    for entry in raw["rounds"]:
        entry["fast"] = {**entry["fast"], "before": slice_(2.0, 1000, invalid="statuses")}
    assert verdicts(durability, raw) == [None, True, True, True, None, None]
    durability.render(raw)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="the shim is built with gcc")
def test_the_shim_builds_and_counts_without_delaying(
    durability: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built as the harness builds it, loaded here: with the delay at 0 it passes every call through, counts the
    flushes, leaves the real call's errno, and counts a sync_file_range only when it waits."""
    shim = durability.compile_shim(tmp_path / "build")
    control = durability.SlowFlush(tmp_path / "control")
    monkeypatch.setenv("SLOWFLUSH_CONTROL", str(control.path))
    library = ctypes.CDLL(str(shim), use_errno=True)
    library.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    target = tmp_path / "data"
    target.write_bytes(b"x" * 8192)
    fd = os.open(target, os.O_RDWR)
    try:
        assert library.fdatasync(fd) == 0
        assert library.fsync(fd) == 0
        assert library.sync_file_range(fd, 0, 0, 2) == 0  # SYNC_FILE_RANGE_WRITE: starts writeback, waits for nothing
        assert library.sync_file_range(fd, 0, 0, 2 | 4) == 0  # … | SYNC_FILE_RANGE_WAIT_AFTER
        assert library.fdatasync(-1) == -1
        assert ctypes.get_errno() == errno.EBADF
    finally:
        os.close(fd)
    counts = control.read()
    control.close()
    assert (counts["fdatasync"], counts["fsync"], counts["sync_file_range"], counts["delayed"]) == (2, 1, 1, 0)


def test_the_shim_source_is_what_gcc_is_given(durability: ModuleType, tmp_path: Path) -> None:
    command = durability.compile_command(durability.SHIM_SOURCE, tmp_path / "x.so")
    assert command[0] == "gcc"
    assert "-shared" in command
    assert str(durability.SHIM_SOURCE) in command
    assert durability.SHIM_SOURCE.exists()
    assert durability.SHIM_LAYOUT.size == 8 * len(durability.SHIM_FIELDS)  # struct control in slowflush.c


@pytest.mark.parametrize("variant", ["handwritten", "ours"])
async def test_each_app_inserts_its_row_with_the_record_and_replays(
    durableapp: ModuleType, migrated_url: str, variant: str
) -> None:
    """The apps the benchmark compares, in process: a fresh key runs the handler (one row) and completes the
    record in the same transaction; its retry is replayed without a second row."""
    connection = await asyncpg.connect(migrated_url)
    try:
        await connection.execute(durableapp.CREATE_ORDERS)
        app = durableapp.build(variant, migrated_url)
        key = str(uuid.uuid4())
        headers = {"Idempotency-Key": key, "Authorization": "Bearer bench-token"}
        body = {"amount": 1250, "currency": "eur", "customer": "cus_42"}
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench") as client,
        ):
            first = await client.post("/orders", json=body, headers=headers)
            again = await client.post("/orders", json=body, headers=headers)
            library = (await client.get("/_library")).json()["path"]
        assert first.status_code == 201
        assert first.json()["status"] == "accepted"
        assert again.status_code == 201
        assert again.headers["idempotent-replayed"] == "true"
        assert again.content == first.content
        assert await connection.fetchval(f"SELECT count(*) FROM {durableapp.ORDERS}") == 1
        assert await connection.fetchval("SELECT count(*) FROM idempotency_responses WHERE key = $1", key) == 1
        assert Path(library) == Path(idempotency_mw.__file__).parent  # the copy on the path: here, the working tree
    finally:
        await connection.close()
