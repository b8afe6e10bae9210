"""Crash: ``kill -9`` a worker while handlers are mid-flight, restart it, and let the clients retry everything.

Every operation is one logical call of the retrying client (:class:`~idempotency_mw.client.AsyncIdempotentClient`,
one key per call) against the ledger app, whose handler writes its effect and then works for ``delay`` seconds.
Once enough handlers are inside that window, the worker is killed with SIGKILL and started again on the same
port (connections wait in the listening socket's backlog meanwhile); the clients' retries meet the dead worker's
claims (409 until their lease lapses), take them over and finish.

- Transactional mode: the dead handlers' effects were never committed, so every operation takes effect exactly
  once, and no claim outlives the lease it was last renewed for.
- Plain mode: an effect committed before the kill has no completed record, so its retry runs it again: the
  seen-set window. The result counts those duplicates instead of hiding them.

``sqlalchemy=True`` runs the same round against the SQLAlchemy variant of the ledger (transactional: the effect is
an ORM object written through the request's ``AsyncSession``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import asyncpg

from faults.report import PeakRss, Result
from faults.workers import effects_per_key, isolation_label, ledger_worker, tally, violations
from idempotency_mw.client import AsyncIdempotentClient, RetriesExhausted, Retry


@dataclass
class CrashFindings:
    mid_flight_at_kill: int  # claims the dead worker held (in_progress records): handlers it was running
    effects_committed_at_kill: int  # effects visible in the database right after the kill
    worst_lease_overhang: float  # how far (s) past the kill the longest lease of a dead claim reached
    violations: list[str]
    unanswered: int  # calls that ended without a final answer


async def run_crash(
    dsn: str,
    *,
    transactional: bool,
    operations: int = 40,
    delay: float = 1.5,
    lease: float = 2.0,
    kill_after: float = 10.0,
    sqlalchemy: bool = False,
    on_conflict: str = "reject",
) -> tuple[Result, CrashFindings]:
    """One crash round. The worker is killed once most handlers are mid-flight, or ``kill_after`` seconds in."""
    run = uuid.uuid4().hex[:12]
    keys = [f"crash-{run}-{i}" for i in range(operations)]
    worker = ledger_worker(
        dsn, transactional=transactional, lease=lease, sqlalchemy=sqlalchemy, on_conflict=on_conflict
    )
    rss = PeakRss(lambda: [worker.process.pid] if worker.process is not None else [])
    connection = await asyncpg.connect(dsn)
    unanswered = 0
    try:
        async with worker, rss.watching():
            retry = Retry(attempts=40, deadline=60.0, backoff=0.05, max_backoff=1.0)
            async with AsyncIdempotentClient(worker.base_url, retry=retry, timeout=30.0) as client:

                async def call(key: str) -> bool:
                    try:
                        await client.post(f"/effects?delay={delay}", json={"key": key}, idempotency_key=key)
                    except RetriesExhausted:
                        return False
                    return True

                calls = [asyncio.create_task(call(key)) for key in keys]
                await _wait_for_entries(connection, keys, want=max(1, operations * 3 // 4), patience=kill_after)
                worker.kill()
                assert worker.process is not None
                await worker.process.wait()
                db_now = await connection.fetchval("SELECT extract(epoch FROM now())::float8")
                committed = await connection.fetchval(
                    "SELECT count(*) FROM faults_effects WHERE key = ANY($1::text[])", keys
                )
                leases = await connection.fetch(
                    "SELECT extract(epoch FROM lease_expires_at)::float8 AS until FROM idempotency_records AS r "
                    "WHERE key = ANY($1::text[]) AND NOT EXISTS "
                    "(SELECT FROM idempotency_responses AS s WHERE s.tenant = r.tenant AND s.key = r.key)",
                    keys,
                )
                await worker.start()
                outcomes = await asyncio.wait_for(asyncio.gather(*calls), timeout=120)
                unanswered = sum(1 for ok in outcomes if not ok)
    finally:
        await connection.close()
    counts = await effects_per_key(dsn, keys)
    duplicates, lost = tally(counts, keys)
    overhang = max((row["until"] - db_now for row in leases), default=0.0)
    mid_flight = len(leases)  # claims the dead worker still held: its handlers were running
    findings = CrashFindings(
        mid_flight_at_kill=mid_flight,
        effects_committed_at_kill=int(committed),
        worst_lease_overhang=overhang,
        violations=await violations(dsn, keys),
        unanswered=unanswered,
    )
    mode = ("transactional" if transactional else "plain") + (", SQLAlchemy" if sqlalchemy else "")
    mode += (", duplicates waiting" if on_conflict == "wait" else "") + await isolation_label(dsn)
    result = Result(
        f"crash (kill -9), {mode}",
        operations=operations,
        faults=f"1 SIGKILL with {mid_flight} handlers mid-flight, then restart",
        duplicates=duplicates,
        lost=lost + unanswered,
        peak_rss=rss.peak,
        notes=[f"lease {lease:g} s; dead claims expired at most {max(overhang, 0):.1f} s after the kill"],
        measures={"kills": 1, "mid-flight at kill": mid_flight, "committed at kill": int(committed)},
    )
    return result, findings


async def _wait_for_entries(connection: asyncpg.Connection, keys: list[str], *, want: int, patience: float) -> int:
    """Wait (at most ``patience`` s) until ``want`` handlers have entered; return how many have."""
    deadline = time.monotonic() + patience
    entered = 0
    while time.monotonic() < deadline:
        entered = int(
            await connection.fetchval(
                "SELECT count(DISTINCT key) FROM faults_entries WHERE key = ANY($1::text[])", keys
            )
        )
        if entered >= want:
            break
        await asyncio.sleep(0.05)
    return entered
