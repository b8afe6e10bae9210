"""Waiting copies across worker processes (faults/waiting.py), small: on an app's pool and under REPEATABLE READ."""

from __future__ import annotations

import pytest

from faults.waiting import run_waiting

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("level", "app_pool"), [("read committed", 6), ("repeatable read", 0), ("repeatable read", 6)])
async def test_waiting_copies_get_the_replay_promptly_and_nothing_runs_twice(
    level: str, app_pool: int, isolation_urls: dict[str, str]
) -> None:
    result, findings = await run_waiting(isolation_urls[level], operations=30, copies=4, app_pool=app_pool)
    assert (result.duplicates, result.lost) == (0, 0)
    assert findings.originals == 30
    assert findings.slept == 0, f"waiters slept out their wait (worst lag {findings.worst_lag:.2f} s)"
    assert not findings.other
    assert findings.replays == 30 * 3
