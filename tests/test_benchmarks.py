"""The benchmarks' own logic, where it could go wrong without anyone seeing it in a run: the intervals and verdicts
they compute, the opcode count (exact, and every library module a request enters), the two-revision runner's
copies of the library, the bulk-loaded records the scale and purge runs stand on, and what the summary lists.
Nothing here times anything."""

from __future__ import annotations

import collections
import importlib
import itertools
import json
import os
import shutil
import sys
import uuid
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

import asyncpg
import httpx
import pytest

import idempotency_mw

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
LIBRARY = os.path.join(os.path.dirname(os.path.abspath(idempotency_mw.__file__)), "")  # as the tracer sees it


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``bench("name")``: the benchmark script ``benchmarks/name.py``, imported with benchmarks/ on the path."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module


# -- statistics and the end-to-end verdicts --------------------------------------------------------------------------


def test_the_median_comes_with_an_order_statistic_interval(bench: Any) -> None:
    """The 6th smallest and 6th largest of 20 rounds (P(fewer than 6 of 20 below the median) is 21,700 / 2^20, about
    2.1%, at most the 2.5% a tail may have; 7 would be 5.8%), and none for 5 rounds, which cannot give 95% (the
    extremes hold the median with probability 1 - 2/32)."""
    common = bench("common")
    rounds = [float(n) for n in range(20, 0, -1)]  # unordered on purpose
    assert common.median_interval(rounds) == (6.0, 15.0)
    assert common.median_interval([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]) == (1.0, 6.0)
    assert common.median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None


def test_the_paired_verdict_is_shown_to_the_digit_it_is_judged_on(bench: Any) -> None:
    """A median of 0.8988 misses 0.90: shown as "0.90x" it read as a pass beside "missed"."""
    endtoend = bench("endtoend")
    ratios = [0.85, 0.86, 0.87, 0.88, 0.89, 0.8976, 0.9, 0.91, 0.92, 0.93, 0.95, 0.97]
    paired = {"rounds": 12, "slice_seconds": 2.0, "ratios": ratios, "median_ratio": 0.8988, "invalid": []}
    target = endtoend.targets({"summary": {}, "paired": paired})[1]
    assert target.measured == "0.899x hand-written (95% interval 0.87 to 0.93x, 12 rounds)"
    assert target.verdict == "**missed**"


def test_the_paired_measurement_is_judged_again_on_the_eager_interpreter_when_one_ran(bench: Any) -> None:
    """The Python 3.12+ pair is a row of its own beside the main verdict, never in its place; a run without one says
    why instead of leaving the row out."""
    endtoend = bench("endtoend")

    def measured(ratios: list[float]) -> dict[str, object]:
        return {
            "rps": {"handwritten": [1000.0] * len(ratios), "ours": [1000.0 * r for r in ratios]},
            "ratios": ratios,
            "median_ratio": sorted(ratios)[len(ratios) // 2],
            "invalid": [],
        }

    main, eager = measured([0.8, 0.85, 0.86, 0.88, 0.89, 0.9, 0.91]), measured([0.9, 0.93, 0.94, 0.95, 0.96, 0.97, 1.0])
    paired = {"rounds": 7, "slice_seconds": 2.0, **main, "eager": {"python": "3.12.1", **eager}}
    found = endtoend.targets({"summary": {}, "paired": paired})
    assert [t.verdict for t in found[1:3]] == ["**missed**", "met"]
    assert found[2].what.startswith("14.1 on Python 3.12.1")
    assert "| 7 | 1000 | 910 | 0.91x | 1000 | 1000 | 1.00x |" in "\n".join(endtoend.paired_section(paired))

    paired["eager"] = {"missing": "no Python 3.12 or later found"}
    found = endtoend.targets({"summary": {}, "paired": paired})
    assert found[2].measured == "not measured: no Python 3.12 or later found"
    assert found[2].ok is None


# -- compare.py: two revisions against the noise ---------------------------------------------------------------------


def slice_(rps: float, invalid: str | None = None) -> dict[str, Any]:
    return {"requests": int(rps), "seconds": 1.0, "rps": rps, "p50_ms": 10.0, "p99_ms": 30.0, "invalid": invalid}


def compared(now: list[float], again: list[float], base: list[float]) -> dict[str, Any]:
    """A raw result of compare.py with these fresh-key requests/s per round (replays: ten times as many)."""
    rounds = []
    for number, (a, b, c) in enumerate(zip(now, again, base, strict=True)):
        entry: dict[str, Any] = {"modes": ["fresh", "replay"]}
        for mode, scale in (("fresh", 1), ("replay", 10)):
            entry[mode] = {"now": slice_(a * scale), "now-again": slice_(b * scale), "base": slice_(c * scale)}
        entry["order"] = list(itertools.permutations(["now", "now-again", "base"]))[number % 6]
        rounds.append(entry)
    return {
        "settings": {"base": "v0.1.0", "rounds": len(rounds), "slice_seconds": 1.0, "connections": 32, "pool": 1000},
        "library": {
            "base": {"ref": "v0.1.0", "commit": "4" * 40, "path": "/copy", "digest": "d" * 64},
            "now": {"commit": "5" * 40, "dirty": True, "path": "/repo", "digest": "e" * 64},
            "identical": False,
        },
        "servers": {
            name: {"database": f"db_{name}", "migrations": ["0001_initial.sql"], "tables": ["idempotency_records"]}
            for name in ("now", "now-again", "base")
        },
        "server": {"version": "18.1"},
        "rounds": rounds,
    }


NOISY = [1000.0, 1040.0, 960.0, 1020.0, 980.0, 1010.0, 990.0, 1030.0, 970.0, 1000.0, 1050.0, 950.0]


def test_compare_takes_ratios_round_by_round_and_leaves_out_slices_that_do_not_count(bench: Any) -> None:
    compare = bench("compare")
    raw = compared([1000.0] * 6, [1100.0] * 6, [800.0] * 6)
    assert compare.round_ratios(raw, "fresh", "now", "base") == [1.25] * 6
    assert compare.round_ratios(raw, "replay", "now-again", "now") == pytest.approx([1.1] * 6)
    raw["rounds"][2]["fresh"]["base"] = slice_(800.0, invalid="statuses {'201': 9, '409': 1}")
    assert len(compare.round_ratios(raw, "fresh", "now", "base")) == 5
    assert len(compare.round_ratios(raw, "fresh", "now-again", "now")) == 6  # its own pair counts
    assert "Slices that do not count: round 3, fresh, base: statuses" in compare.render(raw)


def test_compare_reads_the_change_against_the_noise_band(bench: Any) -> None:
    compare = bench("compare")
    assert compare.noise_band([0.97, 0.98, 0.99, 1.01, 1.02, 1.03]) == (0.97, 1.03)
    assert compare.noise_band([0.90, 0.91, 0.92, 0.93, 0.94, 0.95]) == (0.90, 1.0)  # stretched to hold 1.0
    assert compare.noise_band([0.9, 1.1, 1.0, 1.0, 1.0]) is None  # 5 rounds give no 95% interval
    noise = [0.97, 0.98, 0.99, 1.0, 1.01, 1.02]
    assert compare.judge([0.99, 1.0, 1.01, 1.02, 1.03, 1.04], noise) is True  # holds 1.0
    assert compare.judge([0.90, 0.92, 0.93, 0.94, 0.95, 0.97], noise) is True  # touches the band at 0.97
    assert compare.judge([0.90, 0.92, 0.93, 0.94, 0.95, 0.96], noise) is False  # below it
    assert compare.judge([1.03, 1.04, 1.05, 1.06, 1.07, 1.08], noise) is False  # above it: faster is a move too
    assert compare.judge([0.99, 1.0, 1.01, 1.02, 1.03], noise) is None  # too few rounds
    assert compare.judge([0.99, 1.0, 1.01, 1.02, 1.03, 1.04], noise[:5]) is None


def test_compare_within_the_noise_and_outside_it(bench: Any) -> None:
    """1% slower than the base, and now-again 1% slower than now: the change is the size of the noise. 10% is not."""
    compare = bench("compare")
    raw = compared(NOISY, [r * 0.99 for r in NOISY], [r * 1.01 for r in NOISY])
    found = compare.targets(raw)
    assert [t.what for t in found] == [
        "compare: fresh keys, requests/s of the working tree / `v0.1.0` (4444444), paired slices",
        "compare: replays, requests/s of the working tree / `v0.1.0` (4444444), paired slices",
    ]
    assert [t.verdict for t in found] == ["met", "met"]
    assert found[0].measured == (
        "0.990x (95% interval 0.99 to 0.99x, 12 rounds); now/now 0.990x (95% interval 0.99 to 0.99x, 12 rounds)"
    )
    markdown = compare.render(raw)
    assert "| fresh keys | now / base | 0.990x" in markdown
    assert "within the noise (band 0.99 to 1.00x)" in markdown
    assert "| 1 | now now-again base | 1000 | 990 | 1010 | 0.990 | 0.990 |" in markdown
    raw = compared(NOISY, NOISY, [r * 1.10 for r in NOISY])
    assert [t.verdict for t in compare.targets(raw)] == ["**missed**", "**missed**"]
    assert "**outside the noise** (band 1.00 to 1.00x)" in compare.render(raw)
    few = compared(NOISY[:4], NOISY[:4], NOISY[:4])
    assert [t.ok for t in compare.targets(few)] == [None, None]


def test_compare_puts_every_server_before_every_other_equally_often_over_six_rounds(bench: Any) -> None:
    compare = bench("compare")
    orders = [compare.ORDERS[number % len(compare.ORDERS)] for number in range(6)]
    for first, second in itertools.permutations(compare.NAMES, 2):
        assert sum(order.index(first) < order.index(second) for order in orders) == 3
    for name in compare.NAMES:
        assert sorted(order.index(name) for order in orders) == [0, 0, 1, 1, 2, 2]


def test_the_library_of_a_revision_is_extracted_once_and_checked_where_it_is_run(
    bench: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What keeps compare.py (and opcodes.py, durability.py) from measuring other code than the results name: a
    revision must be a commit; its library is extracted once, whole, into a directory of its own; a process that
    imported ``idempotency_mw`` from anywhere else stops the run; the digest sees a change to the source and not
    to a cache; each server gets a database of its own on the same server."""
    common = bench("common")
    compare = bench("compare")
    monkeypatch.setattr(common, "LIBRARIES", tmp_path / "library")
    commit, copy = common.library_copy("HEAD")
    assert commit == common.git("rev-parse", "HEAD")
    assert copy == tmp_path / "library" / commit[:12]
    assert (copy / "idempotency_mw" / "__init__.py").exists()
    assert not list((tmp_path / "library").glob("*.partial"))
    assert common.library_copy("HEAD") == (commit, copy)  # extracted once
    with pytest.raises(Exception, match="rev-parse"):
        common.library_copy("no-such-revision-" + uuid.uuid4().hex)
    common.check_copy("base", copy / "idempotency_mw", copy)
    with pytest.raises(RuntimeError, match="imported idempotency_mw from"):
        common.check_copy("base", Path(idempotency_mw.__file__).parent, copy)

    twin = tmp_path / "twin"
    shutil.copytree(copy, twin)
    assert common.library_digest(twin) == common.library_digest(copy)
    (twin / "idempotency_mw" / "__pycache__").mkdir(exist_ok=True)
    (twin / "idempotency_mw" / "__pycache__" / "x.py").write_text("compiled")
    assert common.library_digest(twin) == common.library_digest(copy)
    with open(twin / "idempotency_mw" / "__init__.py", "a") as source:
        source.write("# changed\n")
    assert common.library_digest(twin) != common.library_digest(copy)

    assert len(set(compare.DATABASES.values())) == len(compare.NAMES)
    assert (
        common.database_url("postgresql://postgres:@/postgres?host=/tmp/x", "compare_base")
        == "postgresql://postgres:@/compare_base?host=/tmp/x"
    )
    assert common.database_url("postgresql://u:p@db:5433/app", "b") == "postgresql://u:p@db:5433/b"


# -- opcodes.py: the count and the budget -----------------------------------------------------------------------------


async def test_the_opcode_count_is_exact_and_sees_every_library_module_a_request_enters(
    bench: Any, migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two counts of the working tree agree to the opcode, and each request's calls and modules entered are those
    that a second hook of CPython's (``sys.setprofile``, beside the tracer) sees in the library's files: the modules
    the budget counts are the ones the request enters."""
    opcodes = bench("opcodes")
    root = LIBRARY
    assert opcodes.library_root() == root
    seen: list[collections.Counter[str]] = []
    counted = opcodes.counted

    async def counted_and_profiled(library: str, request: Any) -> Any:
        calls: collections.Counter[str] = collections.Counter()

        def profile(frame: FrameType, event: str, arg: object) -> None:
            if event == "call" and frame.f_code.co_filename.startswith(root):
                calls[frame.f_code.co_filename[len(root) :]] += 1

        sys.setprofile(profile)
        try:
            return await counted(library, request)
        finally:
            sys.setprofile(None)
            seen.append(calls)

    monkeypatch.setattr(opcodes, "counted", counted_and_profiled)
    first = await opcodes.count_budget_app(migrated_url)
    second = await opcodes.count_budget_app(migrated_url)
    assert first == second
    assert list(first) == list(opcodes.REQUESTS)
    for request, profiled in zip(opcodes.REQUESTS, seen, strict=False):
        assert {name: entry["calls"] for name, entry in first[request].items()} == dict(profiled)
        assert all(entry["opcodes"] > 0 for entry in first[request].values())
    found = {request: opcodes.totals(first[request]) for request in opcodes.REQUESTS}
    assert set(first["fresh transactional"]) - set(first["fresh plain"])  # its transaction's own modules
    assert found["fresh plain"]["opcodes"] > found["replay"]["opcodes"]


def counts(opcodes: ModuleType, fresh: int, transactional: int, replay: int, modules: int) -> dict[str, Any]:
    """A request's count: ``modules`` modules entered, the opcodes all in the first."""

    def request(total: int) -> dict[str, dict[str, int]]:
        names = [f"_m{n}.py" for n in range(modules)]
        return {name: {"calls": 1, "opcodes": total - (modules - 1) if n == 0 else 1} for n, name in enumerate(names)}

    return {
        "budget": {
            "fresh plain": request(fresh),
            "fresh transactional": request(transactional),
            "replay": request(replay),
        },
        "benchapp": {"fresh": request(fresh - 50), "replay": request(replay - 50)},
    }


def test_the_opcode_budget_is_judged_on_the_last_revision_counted(bench: Any) -> None:
    opcodes = bench("opcodes")
    today = {"revision": "7b59cfc", "label": "today", "commit": "7b59cfc" + "0" * 33, "dirty": False, "digest": "a"}
    now = {"revision": opcodes.WORKTREE, "label": "now", "commit": "9" * 40, "dirty": True, "digest": "b"}
    revisions: list[dict[str, Any]] = [
        {**today, **counts(opcodes, 3146, 3878, 2055, 20)},
        {**now, **counts(opcodes, 2500, 3101, 1600, 12)},
    ]
    result = {"warm_up": 60, "revisions": revisions}
    found = opcodes.targets(result)
    assert [t.measured for t in found] == ["2,500 / 3,101 / 1,600", "12 / 12 / 12"]
    assert [t.goal for t in found] == ["≤ 2,500 / 3,100 / 1,600", "≤ 12 / 12 / 10"]
    assert [t.ok for t in found] == [False, False]
    markdown = opcodes.render(result)
    assert "| fresh plain | opcodes | ≤ 2,500 | 3,146 | 2,500 | met |" in markdown
    assert "| fresh transactional | opcodes | ≤ 3,100 | 3,878 | 3,101 | **missed** by 1 |" in markdown
    assert "| replay | modules entered | ≤ 10 | 20 | 12 | **missed** by 2 |" in markdown
    assert "| `_m0.py` | 2,489 | 3,090 | 1,589 |" in markdown  # where the opcodes go, in the last revision
    assert "| all library | **2,500** | **3,101** | **1,600** |" in markdown

    revisions[1].update(counts(opcodes, 2400, 3000, 1500, 10))
    assert [t.ok for t in opcodes.targets(result)] == [True, True]


# -- the records the scale and purge runs stand on --------------------------------------------------------------------


async def test_bulk_loaded_records_keep_every_constraint_and_replay_as_served_ones_do(
    bench: Any, migrated_url: str
) -> None:
    """The load drops the tables' constraints and puts them all back, the responses' foreign key included; and a
    replayable record holds the fingerprint the benchmark servers' middleware stores for the load generator's request,
    so that a replay is one claim, not a mismatch claimed again."""
    common, benchapp, loadgen, pgserver = (bench(name) for name in ("common", "benchapp", "loadgen", "pgserver"))
    query = "SELECT conrelid::regclass::text, contype::text FROM pg_constraint WHERE conrelid = ANY($1::regclass[])"
    connection = await asyncpg.connect(migrated_url)
    try:
        constraints = sorted(map(tuple, await connection.fetch(query, list(common.STORE_TABLES))))
        await common.add_records(migrated_url, 0, 10, prefix="test-bulk")
        assert sorted(map(tuple, await connection.fetch(query, list(common.STORE_TABLES)))) == constraints
        assert ("idempotency_responses", "f") in constraints
        assert await connection.fetchval("SELECT count(*) FROM idempotency_responses") == 10

        app, start, stop = benchapp.build("ours", pgserver.Database(migrated_url, embedded=False, settings={}))
        await start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench") as client:
                headers = {**loadgen.HEADERS, "idempotency-key": "served"}
                assert (await client.post("/orders", content=loadgen.BODY, headers=headers)).status_code == 201
                headers["idempotency-key"] = "test-bulk-0"  # every REPLAYABLE_EVERY-th key is the generator's
                replay = await client.post("/orders", content=loadgen.BODY, headers=headers)
        finally:
            await stop()
        assert replay.headers.get("idempotent-replayed") == "true"
        stored = await connection.fetch(
            "SELECT key, tenant, fingerprint, attempts FROM idempotency_records WHERE key IN ('served', 'test-bulk-0') "
            "ORDER BY key"
        )
        assert [row["key"] for row in stored] == ["served", "test-bulk-0"]
        assert stored[0]["tenant"] == stored[1]["tenant"]
        assert stored[0]["fingerprint"] == stored[1]["fingerprint"]
    finally:
        await connection.close()


# -- what run.py runs and what the summary lists ----------------------------------------------------------------------


def test_a_result_is_published_with_its_verdicts_and_the_summary_lists_only_kept_measurements(
    bench: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    common = bench("common")
    run = bench("run")
    assert set(run.STEPS) == set(common.MEASUREMENTS)
    assert set(run.QUICK_SKIPS) <= set(common.MEASUREMENTS)
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(common, "RAW", tmp_path / "raw")
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "fixes.json").write_text(json.dumps({"meta": {}, "targets": [], "result": {}}))
    (tmp_path / "raw" / "scale.json").write_text(json.dumps({"meta": {"mode": "quick"}, "result": {}}))
    meta = {"postgres": "18", "database": "test", "load_before": "0.1", "versions": {}, "seconds": 1.0}
    found = [common.Target("a goal", "≤ 1", "2", False), common.Target("another", "none", "3", None)]
    written = common.publish("overhead", "# overhead", {"n": 1}, found, began=0.0, mode="quick", **meta)
    assert written == tmp_path / "overhead.md"
    assert written.read_text().startswith("# overhead\n")
    raw = json.loads((tmp_path / "raw" / "overhead.json").read_text())
    assert raw["result"] == {"n": 1}
    assert [common.Target(**t) for t in raw["targets"]] == found
    summary = (tmp_path / "README.md").read_text()
    assert "| a goal | ≤ 1 | 2 | **missed** | [overhead.md](overhead.md) (quick) |" in summary
    assert "| another | none | 3 | n/a | [overhead.md](overhead.md) (quick) |" in summary
    assert "| roundtrips |  | not measured yet: run.py --only roundtrips | n/a |  |" in summary
    assert "raw/scale.json was written by an older harness: re-run it" in summary
    assert "fixes" not in summary
    assert "compare.md" not in summary  # run on its own: listed once it has a result


def test_the_commit_tail_is_judged_as_now_against_before(bench: Any) -> None:
    """tail.py's verdict compares the whole tail as it is with the whole tail as it was, from the same rounds; every
    part is shown against the floor every statement pays."""
    tail = bench("tail")
    names = list(tail.parts_names())
    us = dict.fromkeys(names, 50.0)
    us |= {names[0]: 10.0, tail.BEFORE: 300.0, tail.NOW: 120.0}
    result = {"rounds": 9, "us": us, "spread": {name: (value, value) for name, value in us.items()}}
    markdown, (target,) = tail.render(result)
    assert (target.measured, target.verdict) == ("0.40x (120 against 300 µs)", "met")
    assert f"| {tail.NOW} | 120.0 | 120.0 … 120.0 | +110.0 |" in markdown
    result["us"] = us | {tail.NOW: 200.0}
    assert tail.render(result)[1][0].verdict == "**missed**"
