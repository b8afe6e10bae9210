"""Zombie worker (issue 4): a handler frozen past its lease wakes after a second worker took its key over."""

from __future__ import annotations

import json

import pytest

from faults.zombie import run_zombie

pytestmark = pytest.mark.slow


async def test_transactional_zombie_is_fenced_out_and_its_writes_roll_back(idempotency_database_url: str) -> None:
    result, findings = await run_zombie(idempotency_database_url, transactional=True)
    zombie, successor = findings.worker_pids
    assert findings.retry_status == 201
    assert not findings.retry_replayed, "the successor must have run the handler itself"
    assert findings.effects == 1
    assert findings.effect_pids == [successor], "the zombie's effect survived"
    assert zombie not in findings.effect_pids
    assert findings.zombie_status == 409
    assert json.loads(findings.zombie_body)["code"] == "idempotency_request_in_progress"
    assert findings.record_body == findings.retry_body
    assert findings.violations == []
    assert result.duplicates == 0


async def test_plain_zombie_cannot_overwrite_the_new_record(idempotency_database_url: str) -> None:
    """Without a shared transaction the fence guards the record only: the zombie's committed write remains."""
    _, findings = await run_zombie(idempotency_database_url, transactional=False)
    _, successor = findings.worker_pids
    assert findings.retry_status == 201
    assert findings.record_body == findings.retry_body
    assert successor in findings.effect_pids
    assert findings.effects <= 2
    assert findings.violations == []
