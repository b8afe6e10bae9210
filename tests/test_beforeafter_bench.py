"""The before/after benchmark's own logic (``benchmarks/beforeafter.py``): the ratios it takes round by round, its
verdict against the now/now noise, its orders and its tables. Nothing here times anything."""

from __future__ import annotations

import importlib
import itertools
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def beforeafter(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("beforeafter")


def slice_(rps: float, invalid: str | None = None) -> dict[str, Any]:
    return {"requests": int(rps), "seconds": 1.0, "rps": rps, "p50_ms": 10.0, "p99_ms": 30.0, "invalid": invalid}


def result(after: list[float], again: list[float], before: list[float]) -> dict[str, Any]:
    """A raw result with these fresh-key requests/s per round (replays: ten times as many)."""
    rounds = []
    for number, (a, b, c) in enumerate(zip(after, again, before, strict=True)):
        entry: dict[str, Any] = {"order": ["after", "after-again", "before"], "modes": ["fresh", "replay"]}
        for mode, scale in (("fresh", 1), ("replay", 10)):
            entry[mode] = {"after": slice_(a * scale), "after-again": slice_(b * scale), "before": slice_(c * scale)}
        entry["order"] = list(itertools.permutations(entry["order"]))[number % 6]
        rounds.append(entry)
    return {
        "settings": {"rounds": len(rounds), "slice_seconds": 1.0, "connections": 32, "pool": 1000, "before": "x"},
        "library": {
            "before": {"ref": "43f0f80", "commit": "4" * 40, "path": "/copy", "digest": "d" * 64},
            "after": {"commit": "5" * 40, "dirty": True, "path": "/repo", "digest": "e" * 64},
            "identical": False,
        },
        "servers": {
            name: {"database": f"db_{name}", "migrations": ["0001_initial.sql"], "tables": ["idempotency_records"]}
            for name in ("after", "after-again", "before")
        },
        "server": {"version": "18.1"},
        "rounds": rounds,
    }


NOISY = [1000.0, 1040.0, 960.0, 1020.0, 980.0, 1010.0, 990.0, 1030.0, 970.0, 1000.0, 1050.0, 950.0]


def test_the_ratios_are_round_by_round_and_leave_out_slices_that_do_not_count(beforeafter: ModuleType) -> None:
    raw = result([1000.0] * 6, [1100.0] * 6, [800.0] * 6)
    assert beforeafter.round_ratios(raw, "fresh", "after", "before") == [1.25] * 6
    assert beforeafter.round_ratios(raw, "replay", "after-again", "after") == pytest.approx([1.1] * 6)
    raw["rounds"][2]["fresh"]["before"] = slice_(800.0, invalid="statuses {'201': 9, '409': 1}")
    assert len(beforeafter.round_ratios(raw, "fresh", "after", "before")) == 5
    assert len(beforeafter.round_ratios(raw, "fresh", "after-again", "after")) == 6  # its own pair counts
    assert "Slices that do not count: round 3, fresh, before: statuses" in beforeafter.render(raw)


def test_the_noise_band_is_the_now_now_interval_stretched_to_one(beforeafter: ModuleType) -> None:
    assert beforeafter.noise_band([0.97, 0.98, 0.99, 1.01, 1.02, 1.03]) == (0.97, 1.03)
    assert beforeafter.noise_band([0.90, 0.91, 0.92, 0.93, 0.94, 0.95]) == (0.90, 1.0)
    assert beforeafter.noise_band([0.9, 1.1, 1.0, 1.0, 1.0]) is None  # 5 rounds give no 95% interval


def test_the_verdict_reads_the_change_against_the_noise(beforeafter: ModuleType) -> None:
    noise = [0.97, 0.98, 0.99, 1.0, 1.01, 1.02]
    assert beforeafter.judge([0.99, 1.0, 1.01, 1.02, 1.03, 1.04], noise) is True  # holds 1.0
    assert beforeafter.judge([0.90, 0.92, 0.93, 0.94, 0.95, 0.97], noise) is True  # touches the band at 0.97
    assert beforeafter.judge([0.90, 0.92, 0.93, 0.94, 0.95, 0.96], noise) is False  # below it
    assert beforeafter.judge([1.03, 1.04, 1.05, 1.06, 1.07, 1.08], noise) is False  # above it: faster is a move too
    assert beforeafter.judge([0.99, 1.0, 1.01, 1.02, 1.03], noise) is None  # too few rounds
    assert beforeafter.judge([0.99, 1.0, 1.01, 1.02, 1.03, 1.04], noise[:5]) is None


def test_targets_and_tables_from_a_run_within_the_noise(beforeafter: ModuleType) -> None:
    """1% slower than before, and after-again 1% slower than after: the change is the size of the noise."""
    raw = result(NOISY, [r * 0.99 for r in NOISY], [r * 1.01 for r in NOISY])
    found = beforeafter.targets(raw)
    assert [t.what for t in found] == [
        "before/after: fresh keys, requests/s after / before (4444444), paired slices",
        "before/after: replays, requests/s after / before (4444444), paired slices",
    ]
    assert [t.verdict for t in found] == ["met", "met"]
    assert found[0].measured == (
        "0.990x (95% interval 0.99 to 0.99x, 12 rounds); now/now 0.990x (95% interval 0.99 to 0.99x, 12 rounds)"
    )
    markdown = beforeafter.render(raw)
    assert "| fresh keys | after / before | 0.990x" in markdown
    assert "within the noise (band 0.99 to 1.00x)" in markdown
    assert "with changes not committed" in markdown
    assert "| 1 | after after-again before | 1000 | 990 | 1010 | 0.990 | 0.990 |" in markdown
    assert "| 2 | after before after-again |" in markdown


def test_a_move_outside_the_noise_is_missed(beforeafter: ModuleType) -> None:
    raw = result(NOISY, NOISY, [r * 1.10 for r in NOISY])
    assert [t.verdict for t in beforeafter.targets(raw)] == ["**missed**", "**missed**"]
    assert "**outside the noise** (band 1.00 to 1.00x)" in beforeafter.render(raw)
    few = result(NOISY[:4], NOISY[:4], NOISY[:4])
    assert [t.ok for t in beforeafter.targets(few)] == [None, None]
    assert "too few for a 95% interval, 4 rounds" in beforeafter.targets(few)[0].measured


def test_every_server_precedes_every_other_equally_often_over_six_rounds(beforeafter: ModuleType) -> None:
    orders = [beforeafter.ORDERS[number % len(beforeafter.ORDERS)] for number in range(6)]
    for first, second in itertools.permutations(beforeafter.NAMES, 2):
        assert sum(order.index(first) < order.index(second) for order in orders) == 3
    for name in beforeafter.NAMES:
        assert sorted(order.index(name) for order in orders) == [0, 0, 1, 1, 2, 2]


def test_run_lengths_and_database_urls(beforeafter: ModuleType) -> None:
    quick, full = beforeafter.settings_for(True), beforeafter.settings_for(False)
    assert (quick.rounds, quick.slice_seconds, full.rounds, full.slice_seconds) == (12, 1.0, 18, 2.0)
    assert beforeafter.settings_for(False, 15.0).slice_seconds == 2.0  # run.py's load runs never lengthen a slice
    assert beforeafter.settings_for(False, 1.0).slice_seconds == 1.0
    assert (
        beforeafter.database_url("postgresql://postgres:@/postgres?host=/tmp/x", "beforeafter_before")
        == "postgresql://postgres:@/beforeafter_before?host=/tmp/x"
    )
    assert beforeafter.database_url("postgresql://u:p@db:5433/app", "b") == "postgresql://u:p@db:5433/b"
    assert len(set(beforeafter.DATABASES.values())) == len(beforeafter.NAMES)


def test_run_py_runs_it_on_request_and_judges_it_in_the_summary(
    beforeafter: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Wired like durability: a step, targets for the summary, left out of the quick run unless asked for."""
    run = importlib.import_module("run")
    assert set(run.MEASUREMENTS) == set(run.STEPS) == set(run.TARGETS) == set(run.ISSUE_ORDER)
    assert run.STEPS["beforeafter"] == (beforeafter.measure, beforeafter.render)
    assert "beforeafter" in run.QUICK_SKIPS
    monkeypatch.setattr(run, "RAW", tmp_path)
    meta = {"started": "2026-11-26 23:00", "mode": "full", "minutes": 4.0}
    (tmp_path / "beforeafter.json").write_text(json.dumps({"meta": meta, "result": result(NOISY, NOISY, NOISY)}))
    summary = run.summary()
    assert "| before/after: replays, requests/s after / before (4444444), paired slices | within the now/now" in summary
    assert "[beforeafter.md](beforeafter.md) (full)" in summary
