"""The benchmarks that stand in for a part of the middleware still fit it.

``fixes.py`` and ``instructions.py`` replace internals of the middleware by name (the settlement, the tasks, the
fingerprint) to measure what those parts cost. A reshaped internal breaks them only when someone runs a benchmark,
which is how ``fixes.py`` went stale once; so each runs here, at a tiny size, against the test database.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


async def test_fixes_py_settles_every_request_in_each_of_its_variants(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import fixes

    from idempotency_mw.middleware import IdempotentRequest

    shipped = IdempotentRequest._settle, IdempotentRequest._send_recorded
    result = await fixes.settle_cost(migrated_url, rounds=1, requests=20)  # asserts 20 answers of 201
    assert (IdempotentRequest._settle, IdempotentRequest._send_recorded) == shipped  # both put back
    for store in ("MemoryStore", "PostgresStore"):
        assert {fixes.SHIPPED, fixes.FROM_THE_START, fixes.DIRECT} <= set(result[store])
        assert all(result[store][name] > 0 for name in (fixes.SHIPPED, fixes.FROM_THE_START, fixes.DIRECT))


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
