"""Storm across processes (issue 4): 200 payments, each sent 5 times at once over two worker processes."""

from __future__ import annotations

import pytest

from faults.storm import run_storm

# Untraced by coverage (pytest-cov's no_cover): the library runs in the two worker processes, which coverage does
# not measure, and in this process the HTTP clients of a thousand copies make many Python calls, each of which its
# C tracer sees: traced, the first storm took 30 s of CPU, untraced 17 s. The few library lines this process
# reaches (the retrying client's) are reached by tests/test_client.py too.
pytestmark = [pytest.mark.slow, pytest.mark.no_cover]


async def test_every_payment_takes_effect_once_and_every_copy_is_a_conflict_or_a_replay(
    idempotency_database_url: str,
) -> None:
    result, answers = await run_storm(idempotency_database_url, payments=200, copies=5)
    assert result.duplicates == 0
    assert result.lost == 0
    assert not answers.other, f"copies answered with something else than 409 or a replay: {answers.other}"
    assert answers.mismatched_replays == 0
    # Exactly one copy ran per payment (a payment whose copies all met a live claim was settled afterwards).
    assert answers.originals == 200 - answers.payments_without_original
    assert answers.originals + answers.replays + answers.conflicts == 200 * 5


async def test_a_storm_on_a_repeatable_read_database_takes_effect_once(isolation_urls: dict[str, str]) -> None:
    """The same storm where the database's sessions default to REPEATABLE READ: the store's bookkeeping of one
    record (the claim, 409s that count their attempt, renewals, the completion) must not fail on itself."""
    result, answers = await run_storm(isolation_urls["repeatable read"], payments=100, copies=5)
    assert result.scenario == "storm across processes, repeatable read"
    assert result.duplicates == 0
    assert result.lost == 0
    assert not answers.other, f"copies answered with something else than 409 or a replay: {answers.other}"
    assert answers.originals + answers.replays + answers.conflicts == 100 * 5


async def test_a_storm_whose_copies_wait_takes_effect_once(idempotency_database_url: str) -> None:
    """The same storm with on_conflict="wait": the copies wait for the one that runs, in its process or the other
    (woken by the database), and are answered with its replay instead of 409."""
    result, answers = await run_storm(idempotency_database_url, payments=100, copies=5, on_conflict="wait")
    assert result.scenario == "storm across processes, copies waiting"
    assert result.duplicates == 0
    assert result.lost == 0
    assert not answers.other, f"copies answered with something else than 409 or a replay: {answers.other}"
    assert answers.replays > answers.conflicts, (answers.replays, answers.conflicts)
    assert answers.originals + answers.replays + answers.conflicts == 100 * 5
