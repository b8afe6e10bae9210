"""Primary failover (issue 13): a primary and a streaming standby, the primary SIGKILLed, the standby promoted.

Each test starts its own pair of servers from the embedded PostgreSQL's binaries (loopback TCP), never the suite's.
docs/faults-results.md has the figures of longer runs (``python -m faults.soak --only failover``).
"""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from faults.failover import run_failover
from faults.replication import ReplicatedPostgres
from idempotency_mw import PostgresStore
from idempotency_mw.store import ClaimOutcome, StoredResponse, StoreUnavailable

pytestmark = pytest.mark.slow


async def test_synchronous_failover_loses_nothing_and_runs_nothing_twice() -> None:
    result, findings = await run_failover(
        synchronous=True, clients=6, warmup=1.5, detection=0.5, cooldown=1.5, standby_lag=0.3
    )
    assert findings.acknowledged > 0
    assert findings.acknowledged_lost == 0
    assert findings.rerun_on_resend == 0
    assert result.duplicates == 0
    assert findings.unanswered == 0
    assert findings.violations == []
    assert sum(findings.in_flight_at_kill.values()) > 0, "nothing was in flight at the kill: it proved nothing"
    # A handler under way on the dead primary ends in a 503 (its transaction died with the server) or, if it had
    # committed just before the kill, its 201; never a 500 or a hang.
    assert set(findings.in_flight_at_kill) <= {"503", "201"}, findings.in_flight_at_kill
    assert findings.gap_503s > 0
    # In the gap: 503s, the 201s of commits that made it before the kill, and 409s from claims replicated before
    # it whose lease has not lapsed yet. Never a 500.
    assert set(findings.gap_outcomes) <= {"503", "201", "409"}, findings.gap_outcomes
    assert findings.seconds_to_first_success < 30, "traffic did not resume on the promoted standby"


async def test_asynchronous_failover_loses_records_whole_never_half() -> None:
    """The standby is behind at the kill: acknowledged calls can be lost. In transactional mode a record and its
    effect commit together, so each lost one is lost whole: its resend runs once more, and nothing runs twice."""
    result, findings = await run_failover(
        synchronous=False, clients=6, warmup=1.5, detection=0.5, cooldown=1.5, standby_lag=0.3
    )
    assert findings.acknowledged > 0
    assert findings.rerun_on_resend == findings.acknowledged_lost
    assert result.duplicates == 0
    assert findings.unanswered == 0
    assert findings.violations == []
    assert set(findings.in_flight_at_kill) <= {"503", "201"}, findings.in_flight_at_kill


async def test_a_stale_workers_writes_after_a_synchronous_failover_are_refused() -> None:
    """A worker whose claim was made on the old primary (and replicated) outlives it. After the promotion its lease
    lapses, a retry takes the key over with a fence of its own: the stale worker's renewal, completion and release
    all name a fence that no longer owns the key."""
    with ReplicatedPostgres(synchronous=True) as cluster:
        stale_store = PostgresStore(cluster.dsn, timeout=2.0, min_size=1)
        await stale_store.migrate()
        async with stale_store:
            stale = await stale_store.claim("tenant", "key", b"f" * 32, lease=0.5, ttl=60)
            assert stale.outcome is ClaimOutcome.OWNED
            await asyncio.to_thread(cluster.kill_primary)
            await asyncio.to_thread(cluster.promote)
            await cluster.wait_writable()
            await asyncio.sleep(0.6)  # the stale claim's lease lapses
            async with PostgresStore(cluster.dsn, timeout=2.0) as store:
                fresh = await store.claim("tenant", "key", b"f" * 32, lease=30, ttl=60)
                assert fresh.outcome is ClaimOutcome.OWNED
                assert fresh.fence is not None
                assert stale.fence is not None
                assert fresh.fence != stale.fence
                response = StoredResponse(200, [], b"stale", 5)
                refused = False
                for _ in range(3):  # a pooled connection to the dead primary may answer first: StoreUnavailable
                    try:
                        refused = not await stale_store.renew("tenant", "key", stale.fence, lease=30)
                        break
                    except StoreUnavailable:
                        await asyncio.sleep(0.1)
                assert refused
                assert not await stale_store.complete("tenant", "key", stale.fence, response)
                assert not await stale_store.release("tenant", "key", stale.fence)
                assert await store.complete("tenant", "key", fresh.fence, StoredResponse(201, [], b"fresh", 5))
                record = await store.inspect("tenant", "key")
                assert record is not None
                assert record.response is not None
                assert record.response.body == b"fresh"


async def test_a_stale_workers_writes_after_an_asynchronous_failover_are_refused() -> None:
    """The case a fence sequence got wrong: the standby stopped receiving, a claim was made (and its sequence value
    drawn) on the primary alone, the primary died and the standby was promoted. The stale claim is lost with the
    primary, so a retry claims the key afresh on the promoted server. A sequence could draw the very same fence
    again there (reproduced: fence 34 twice), and the stale worker's completion would then land on the newer
    claim. A random token per claim cannot repeat: the stale worker is refused."""
    with ReplicatedPostgres(synchronous=False) as cluster:
        stale_store = PostgresStore(cluster.dsn, timeout=2.0, min_size=1)
        await stale_store.migrate()
        standby = await asyncpg.connect(cluster.standby.dsn)
        try:
            for _ in range(300):  # the migration reaches the standby before it is cut off
                if await standby.fetchval("SELECT to_regclass('public.idempotency_records') IS NOT NULL"):
                    break
                await asyncio.sleep(0.05)
        finally:
            await standby.close()
        async with stale_store:
            await asyncio.to_thread(cluster.pause_replication)
            stale = await stale_store.claim("tenant", "key", b"f" * 32, lease=30, ttl=60)
            assert stale.outcome is ClaimOutcome.OWNED
            await asyncio.to_thread(cluster.kill_primary)
            await asyncio.to_thread(cluster.resume_replication, drop_unread=True)
            await asyncio.to_thread(cluster.promote)
            await cluster.wait_writable()
            async with PostgresStore(cluster.dsn, timeout=2.0) as store:
                fresh = await store.claim("tenant", "key", b"f" * 32, lease=30, ttl=60)
                assert fresh.outcome is ClaimOutcome.OWNED  # the stale claim did not survive the failover
                assert fresh.fence != stale.fence
                response = StoredResponse(200, [], b"stale", 5)
                refused = False
                for _ in range(3):  # a pooled connection to the dead primary may answer first: StoreUnavailable
                    try:
                        refused = not await stale_store.complete("tenant", "key", stale.fence, response)
                        break
                    except StoreUnavailable:
                        await asyncio.sleep(0.1)
                assert refused
                assert not await stale_store.renew("tenant", "key", stale.fence, lease=30)
                assert await store.complete("tenant", "key", fresh.fence, StoredResponse(201, [], b"fresh", 5))
                record = await store.inspect("tenant", "key")
                assert record is not None
                assert record.response is not None
                assert record.response.body == b"fresh"
