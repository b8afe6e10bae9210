"""Crash (issue 4): kill -9 a worker with handlers mid-flight, restart it, retry everything through the client."""

from __future__ import annotations

import pytest

from faults.crash import run_crash

pytestmark = pytest.mark.slow

LEASE = 2.0


@pytest.fixture(params=["read committed", "repeatable read"])
def crash_url(request: pytest.FixtureRequest, idempotency_database_url: str) -> str:
    """The suite's database, and one whose sessions default to REPEATABLE READ."""
    if request.param == "read committed":
        return idempotency_database_url
    urls: dict[str, str] = request.getfixturevalue("isolation_urls")
    return urls[request.param]


async def test_transactional_mode_takes_every_operation_once(crash_url: str) -> None:
    result, findings = await run_crash(crash_url, transactional=True, operations=30, lease=LEASE)
    assert findings.mid_flight_at_kill > 0, "the kill found no handler mid-flight: the scenario proved nothing"
    assert findings.unanswered == 0
    assert result.duplicates == 0
    assert result.lost == 0
    assert findings.violations == []
    # No claim of the dead worker was renewed past one lease from its last heartbeat (+1 s for clock reads).
    assert findings.worst_lease_overhang <= LEASE + 1.0
    # And its running handlers did keep their leases up to the kill, although they held every connection but the
    # one the pool keeps for renewals (a lapsed lease would let a retry run a live handler a second time).
    assert findings.worst_lease_overhang > 0


async def test_sqlalchemy_handlers_take_every_operation_once(crash_url: str) -> None:
    """The same crash, with handlers that write an ORM object through the request's AsyncSession."""
    result, findings = await run_crash(crash_url, transactional=True, sqlalchemy=True, operations=20, lease=LEASE)
    assert findings.mid_flight_at_kill > 0, "the kill found no handler mid-flight: the scenario proved nothing"
    assert findings.unanswered == 0
    assert result.duplicates == 0
    assert result.lost == 0
    assert findings.violations == []
    assert 0 < findings.worst_lease_overhang <= LEASE + 1.0


async def test_plain_mode_can_only_repeat_effects_committed_before_the_crash(idempotency_database_url: str) -> None:
    """The seen-set window (docs/design.md §6): measured and bounded, not hidden. docs/faults.md has the figures."""
    result, findings = await run_crash(idempotency_database_url, transactional=False, operations=30, lease=LEASE)
    assert findings.mid_flight_at_kill > 0
    assert findings.unanswered == 0
    assert result.lost == 0
    assert findings.violations == []
    assert result.duplicates <= findings.effects_committed_at_kill
    assert findings.worst_lease_overhang <= LEASE + 1.0


async def test_transactional_mode_with_waiting_duplicates_takes_every_operation_once(
    idempotency_database_url: str,
) -> None:
    """The crash with on_conflict="wait": retries that meet a claim of the dead worker wait (woken when its lease
    is taken over, or at their bound) rather than answer 409, and still nothing runs twice or is lost."""
    result, findings = await run_crash(
        idempotency_database_url, transactional=True, operations=30, lease=LEASE, on_conflict="wait"
    )
    assert findings.mid_flight_at_kill > 0, "the kill found no handler mid-flight: the scenario proved nothing"
    assert findings.unanswered == 0
    assert result.duplicates == 0
    assert result.lost == 0
    assert findings.violations == []
