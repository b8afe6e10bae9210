"""Steps under fire (faults/steps.py): payouts, a handler in steps with the payout provider between two local steps,
killed between every pair of steps under a retry storm and a lossy network, against a provider that fails."""

from __future__ import annotations

import pytest

from faults.steps import BETWEEN_STEPS, run_steps

pytestmark = pytest.mark.slow


async def test_every_payout_takes_effect_once_locally_and_at_the_provider(idempotency_database_url: str) -> None:
    result, findings = await run_steps(idempotency_database_url, operations=30, copies=3, kills=3)
    assert 3 <= findings.kills <= 6  # more only for a gap the first three missed
    for gap in BETWEEN_STEPS:  # otherwise the round proved nothing about that gap
        assert findings.gaps[gap] > 0, (gap, findings.gaps)
    assert result.duplicates == 0  # one payout row per operation, one provider transfer per payout
    assert findings.unanswered == 0
    assert findings.mismatched == []  # every final answer names the operation's row and its transfer
    assert result.lost == 0
    assert findings.provider["transfers"] == 30
