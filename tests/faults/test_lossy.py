"""Lossy network (issue 4): the demo's proxy resets, drops and cuts at random; the ledger stays exact."""

from __future__ import annotations

import pytest

from faults.lossy import run_lossy

pytestmark = pytest.mark.slow


async def test_every_payment_is_charged_once_through_a_lossy_network(idempotency_database_url: str) -> None:
    result, final = await run_lossy(
        idempotency_database_url, payments=60, drop_rate=0.2, reset_rate=0.1, cut_rate=0.1, seed=4
    )
    assert result.measures["dropped"] + result.measures["cut"] > 0, "no answer was lost: the scenario proved nothing"
    assert result.duplicates == 0
    assert result.lost == 0
    assert final["gave up"] == 0
    assert set(final) <= {"200", "replayed"}, final
