"""The benchmarks that stand in for a part of the middleware still fit it.

``fixes.py`` and ``instructions.py`` replace internals of the middleware by name (the settlement, the tasks, the
fingerprint) to measure what those parts cost. A reshaped internal breaks them only when someone runs a benchmark,
which is how ``fixes.py`` went stale once; so each runs here, at a tiny size, against the test database.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


async def test_fixes_py_settles_every_request_in_each_of_its_variants(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import fixes

    from idempotency_mw.recording import PlainRun

    shipped = PlainRun._settle
    result = await fixes.settle_cost(migrated_url, rounds=1, requests=20)  # asserts 20 answers of 201
    assert PlainRun._settle == shipped  # put back
    for store in ("MemoryStore", "PostgresStore"):
        assert {fixes.SHIPPED, fixes.FROM_THE_START, fixes.DIRECT} <= set(result[store])
        assert all(result[store][name] > 0 for name in (fixes.SHIPPED, fixes.FROM_THE_START, fixes.DIRECT))


async def test_storepath_py_replays_through_both_claim_statements(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """storepath.py reads the claim statements' rows itself: a reshaped row fails here, not in a benchmark run."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import storepath

    result = await storepath.replays(migrated_url, 3, 1, "test-storepath")
    assert set(result["wal_bytes_per_replay"]) == {"claim", "claim_locked"}


async def test_bulk_loads_records_and_puts_every_constraint_back(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bulk.py drops the tables' constraints for the load and restores them, the responses' foreign key included."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import asyncpg
    import bulk

    query = "SELECT conrelid::regclass::text, contype::text FROM pg_constraint WHERE conrelid = ANY($1::regclass[])"
    connection = await asyncpg.connect(migrated_url)
    try:
        constraints = sorted(map(tuple, await connection.fetch(query, list(bulk.TABLES))))
        await bulk.add_records(migrated_url, 0, 10, prefix="test-bulk")
        assert sorted(map(tuple, await connection.fetch(query, list(bulk.TABLES)))) == constraints
        assert ("idempotency_responses", "f") in constraints
        assert await connection.fetchval("SELECT count(*) FROM idempotency_responses") == 10
    finally:
        await connection.close()


async def test_fixes_py_runs_each_variant_of_the_0_2_0_fixes(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lent connection's guard, the two table layouts' statements, the store on a REPEATABLE READ database
    (through an app's pool with and without its explicit transactions and its share, and its own pool pinned or
    not), the pool-state restore, and the pieces on the library before (``fixpieces.py`` in a process of its own):
    each asserts its own answers (claims owned, completions landed, replays found, the restored search_path)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import fixes

    found = {
        "guard": await fixes.guard_cost(migrated_url, rounds=1, statements=5),
        "responses": await fixes.responses_cost(migrated_url, False, rounds=1, n=3),
        "isolation": await fixes.isolation_cost(migrated_url, rounds=1, n=3),
        "restore": await fixes.restore_cost(migrated_url, False, rounds=1, n=3),
        "pieces": fixes.pieces_compared(rounds=1, n=10),
        "new_pieces": fixes.new_pieces(10),
    }
    assert set(found["responses"]["phases"]) == {
        fixes.FRESH_CLAIM,
        fixes.COMPLETION,
        fixes.REPLAY,
        fixes.IN_TRANSACTION,
    }
    assert found["responses"]["phases"][fixes.COMPLETION]["wal_bytes"]["shipped"] > 0
    assert set(found["isolation"]["compared"]) == {
        fixes.APP_COMPARED,
        fixes.SHARE_COMPARED,
        fixes.CHECKOUT_COMPARED,
        fixes.OWN_COMPARED,
    }
    assert set(found["restore"]["compared"]) == {fixes.OWN_RESTORE, fixes.APP_RESTORE}
    assert set(found["pieces"]["pieces"]) >= {fixes.FORM_ESCAPED_PIECE, fixes.RECORDER_PIECE, fixes.LEASE_PIECE}
    markdown = "\n\n".join(fixes.render_exactly_once(found, 1))
    assert "| completion (plain mode) |" in markdown
    assert [t.ok for t in fixes.exactly_once_targets(found)] == [None] * 5


def test_the_function_reset_variant_keeps_the_pool_state_after_the_do_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """The variant that deallocates in a function replaces only the DO block: the shipped reset's restore of the
    pool's session state (here the store's READ COMMITTED pin) still follows, so the two differ by the block alone."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import fixes

    from idempotency_mw.connectors import PIN_RESTORE
    from idempotency_mw.sql import reset_session

    variant = fixes.deallocation_in_a_function(reset_session() + "\n" + PIN_RESTORE)
    assert "DO $$" not in variant
    assert variant.endswith(PIN_RESTORE)
    assert variant.count("bench_deallocate_sql_statements()") == 1


@pytest.mark.parametrize(
    ("kind", "variant", "count"),
    [
        *(("requests", name, "20") for name in ("bare", "handwritten", "ours", "tasks", "fingerprint", "tenant")),
        ("requests", "events", "20"),
        ("pairs", "raw", "32"),
        ("pairs", "store", "32"),
    ],
)
def test_instructions_py_drives_each_variant(migrated_url: str, kind: str, variant: str, count: str) -> None:
    """The driver valgrind counts, run without valgrind: every request answered 201 and, for the ablations, the
    part taken out really was (the ``tasks`` ablation checks that it replaced a task)."""
    done = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "instructions.py"),
            "--dsn",
            migrated_url,
            "--drive",
            kind,
            variant,
            count,
            "--collector-off",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_paired_median_comes_with_an_order_statistic_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    """Target 14.1's interval: the 6th smallest and 6th largest of 20 rounds (P(fewer than 6 of 20 below the median)
    is 21,700 / 2^20, about 2.1%, at most the 2.5% a tail may have; 7 would be 5.8%), and none for 5 rounds, which
    cannot give 95% (the extremes hold the median with probability 1 - 2/32)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from common import median_interval

    rounds = [float(n) for n in range(20, 0, -1)]  # unordered on purpose
    assert median_interval(rounds) == (6.0, 15.0)
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]) == (1.0, 6.0)
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None


def test_the_paired_verdict_is_shown_to_the_digit_it_is_judged_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """A median of 0.8988 misses 0.90: shown as "0.90x" it read as a pass beside "missed"."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import endtoend

    ratios = [0.85, 0.86, 0.87, 0.88, 0.89, 0.8976, 0.9, 0.91, 0.92, 0.93, 0.95, 0.97]
    paired = {"rounds": 12, "slice_seconds": 2.0, "ratios": ratios, "median_ratio": 0.8988, "invalid": []}
    target = endtoend.targets({"summary": {}, "paired": paired})[1]
    assert target.measured == "0.899x hand-written (95% interval 0.87 to 0.93x, 12 rounds)"
    assert target.verdict == "**missed**"


def test_target_14_1_is_judged_again_on_the_eager_interpreter_when_one_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Python 3.12+ pair is a row of its own beside the main verdict, never in its place; a run without one says
    why instead of leaving the row out."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import endtoend

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
    section = "\n".join(endtoend.paired_section(paired))
    assert "ours / hand-written, Python 3.12.1" in section
    assert "| 7 | 1000 | 910 | 0.91x | 1000 | 1000 | 1.00x |" in section

    del paired["eager"]  # a result from before the Python 3.12 pair renders as it did
    assert len(endtoend.targets({"summary": {}, "paired": paired})) == 4
    assert "3.12" not in "\n".join(endtoend.paired_section(paired))

    paired["eager"] = {"missing": "no Python 3.12 or later found"}
    found = endtoend.targets({"summary": {}, "paired": paired})
    assert found[2].measured == "not measured: no Python 3.12 or later found"
    assert found[2].ok is None
    assert "Python 3.12 or later was not measured: no Python 3.12 or later found." in endtoend.paired_section(paired)


def _fake_python(directory: Path, version: str, venv_error: str = "") -> str:
    """A stand-in interpreter: prints ``version`` (after a line of noise, as a sitecustomize might) when asked for it,
    and fails to make a venv with ``venv_error``."""
    script = directory / f"python-{version.replace(' ', '.')}"
    script.write_text(
        f'#!/bin/sh\nif [ "$1" = "-c" ]; then echo "noise"; echo "{version}"; exit 0; fi\n'
        f'echo "{venv_error}" >&2; exit 1\n'
    )
    script.chmod(0o755)
    return str(script)


def test_the_eager_interpreter_is_3_12_or_later_and_a_failed_venv_is_a_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What ``$BENCH_EAGER_PYTHON`` names is checked for its version, and a venv that cannot be made (a Debian
    Python without ensurepip) ends in a reason, not in an exception that stops the whole benchmark."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import peers

    monkeypatch.setattr(peers, "EAGER_VENV", tmp_path / "venv-eager")
    monkeypatch.setenv(peers.EAGER_VARIABLE, _fake_python(tmp_path, "3 11 9"))
    eager = peers.ensure_eager({})
    assert eager.python is None
    assert eager.missing.endswith("is not a Python 3.12 or later that runs")

    monkeypatch.setenv(peers.EAGER_VARIABLE, _fake_python(tmp_path, "3 13 2", "Error: ensurepip is not available"))
    eager = peers.ensure_eager({})
    assert eager.python is None
    assert eager.missing.startswith("could not make a venv with ")
    assert eager.missing.endswith("(Python 3.13.2): Error: ensurepip is not available")

    monkeypatch.setenv(peers.EAGER_VARIABLE, str(tmp_path / "absent"))
    assert peers.ensure_eager({}).missing.endswith("is not a Python 3.12 or later that runs")


def test_the_eager_search_takes_pyenv_default_builds_newest_patch_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import peers

    for build in ("3.12.2", "3.12.10", "3.13.0t", "3.13.1", "3.14.0", "3.11.7"):
        (tmp_path / "versions" / build / "bin").mkdir(parents=True)
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert peers._eager_candidates() == [
        str(tmp_path / "versions" / build / "bin" / "python3") for build in ("3.12.10", "3.12.2", "3.13.1")
    ]


def test_a_measurement_run_on_its_own_is_published_as_run_py_would(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """durability.py and beforeafter.py publish through run.publish: the raw result with its meta, the markdown
    with its header, and the summary, which judges the result again from the file."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import run

    published = json.loads((BENCHMARKS / "results" / "raw" / "beforeafter.json").read_text())
    monkeypatch.setattr(run, "RESULTS", tmp_path)
    monkeypatch.setattr(run, "RAW", tmp_path / "raw")
    meta = {"postgres": "18", "database": "test", "load_before": "0.1", "versions": {}, "seconds": 1.0}
    written = run.publish("beforeafter", "# pair", published["result"], began=0.0, mode="quick", **meta)
    assert written == tmp_path / "beforeafter.md"
    assert written.read_text().startswith("# pair\n")
    assert json.loads((tmp_path / "raw" / "beforeafter.json").read_text())["result"] == published["result"]
    assert "before/after: fresh keys" in (tmp_path / "README.md").read_text()


async def test_opcodes_py_counts_a_library_the_same_twice(migrated_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """opcodes.py drives the middleware as benchapp builds it (asserting every answer) and its counts are exact: two
    counts of one library agree to the opcode, which is what lets it compare revisions without noise."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import opcodes

    first: dict[str, Any] = await opcodes._drive(migrated_url, 5)
    second: dict[str, Any] = await opcodes._drive(migrated_url, 5)
    for mode in opcodes.MODES:
        assert first[mode] == second[mode]
        assert first[mode]["idempotency_mw/middleware.py"] > 0
        assert opcodes.library_total(first[mode]) > 0
    assert opcodes.library_total(first["fresh"]) > opcodes.library_total(first["replay"])


def test_opcodes_py_groups_code_and_renders_each_change(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import opcodes

    assert opcodes.group("/r/benchmarks/.work/library/abc/idempotency_mw/sql/__init__.py") == (
        "idempotency_mw/sql/__init__.py"
    )
    assert opcodes.group("/v/lib/python3.11/site-packages/asyncpg/pool.py") == "asyncpg"
    assert opcodes.group("/p/lib/python3.11/asyncio/tasks.py") == "asyncio"
    assert opcodes.group("/p/lib/python3.11/hmac.py") == "standard library"
    assert opcodes.group("/r/benchmarks/benchapp.py") == "benchmark driver"

    def revision(name: str, fresh: float, replay: float) -> dict[str, object]:
        return {
            "revision": name,
            "commit": "0123456789abcdef" if name != opcodes.WORKTREE else "fedcba9876543210",
            "subject": f"change {name}",
            "digest": "d",
            "fresh": {"idempotency_mw/middleware.py": fresh, "asyncio": 100.0},
            "replay": {"idempotency_mw/middleware.py": replay, "asyncio": 50.0},
        }

    markdown = opcodes.render(
        {"requests": 5, "revisions": [revision("base", 1000, 400), revision(opcodes.WORKTREE, 1120, 390)]}
    )
    assert "| `0123456` | change base | 1000 |  | 1100 | 400 |  | 450 |" in markdown
    assert "| working tree | change worktree | 1120 | +120 | 1220 | 390 | -10 | 440 |" in markdown
    assert "| `idempotency_mw/middleware.py` | 1000 | 1120 | +120 | 400 | 390 | -10 |" in markdown
