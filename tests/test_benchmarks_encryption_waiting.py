"""The encryption and waiting benchmarks still fit the library: each runs here at a tiny size against the test
database, checks every answer as it does in a real run, and renders its table. Nothing is timed or judged."""

from __future__ import annotations

from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


async def test_encryption_py_answers_and_renders(migrated_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import encryption

    result = await encryption.measure(migrated_url, 5, 1)  # raises on a wrong status or a missing replay
    assert {(r["store"], r["size"], r["what"]) for r in result["rows"]} == {
        (store, size, what) for store in encryption.STORES for size in encryption.SIZES for what in ("fresh", "replay")
    }
    assert result["stored"]["small"]["sealed"] > result["stored"]["small"]["plain"]
    assert "| PostgresStore | 64 KiB | replay |" in encryption.render(result)
    assert [t.ok for t in encryption.targets(result)] == [None, None]


async def test_waiting_py_answers_every_duplicate_once_and_renders(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import waiting

    result = await waiting.measure(migrated_url, duplicates=20, pool=3, hold=1.5, rounds=1)  # raises on a wrong answer
    assert set(result["variants"]) == set(waiting.VARIANTS)
    for name, variant in result["variants"].items():
        expected = 1.0 if name.startswith("wait") else 1.5
        assert variant["requests_per_duplicate"] >= expected  # a 409 client sends again at least once
    assert "| wait, two processes |" in waiting.render(result)
