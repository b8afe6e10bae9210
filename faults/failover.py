"""Primary failover: the primary is killed under traffic, the standby is promoted, and the traffic keeps going.

The ledger app (transactional mode, every write in the request's transaction) is served in this process on a
:class:`~faults.replication.ReplicatedPostgres`, through a DSN that names both servers with
``target_session_attrs=read-write``. Client tasks run logical calls back to back through the retrying client, each
handler working ``delay`` seconds after its write so that some are in flight at the kill. Then:

1. the primary's postmaster and backends are SIGKILLed at once (a lost host);
   With ``standby_lag``, the standby's WAL receiver is stopped that long before the kill and killed with it (what
   it had not read is gone), so the standby is that far behind when the primary dies, as behind a slow link; on
   loopback it is otherwise a fraction of a millisecond behind;
2. ``detection`` seconds later the standby is promoted (``pg_ctl promote``), as an HA manager would once it has
   decided the primary is gone;
3. the clients go on until ``cooldown`` seconds after the promotion;
4. every call the client was told had succeeded is sent once more, as a client that lost its answer would.

What is counted, on the new primary: acknowledged calls whose effect is missing (lost with the primary), calls that
ran again on the resend (their record was lost, so the retry was a first request), duplicate effects, the 503s
answered between the kill and the first success, how long that took, and what the requests under way at the
kill were answered. With synchronous replication nothing acknowledged can be lost; with asynchronous replication
whatever the standby had not received at the kill is.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from dataclasses import dataclass

import httpx

from faults.ledger_app import create_app
from faults.replication import ReplicatedPostgres
from faults.report import PeakRss, Result, this_process
from faults.server import serve
from faults.timing import TimingTransport
from faults.workers import effects_per_key, violations
from idempotency_mw.client import AsyncIdempotentClient, RetriesExhausted, Retry


@dataclass
class FailoverFindings:
    synchronous: bool
    calls: int
    acknowledged: int  # calls the client was told had succeeded
    acknowledged_lost: int  # of those, calls whose effect is not on the new primary
    rerun_on_resend: int  # acknowledged calls that ran their handler again when sent once more
    duplicates: int  # extra effects, at the end
    gap_503s: int  # 503 answers between the kill and the first success after it
    gap_outcomes: Counter[str]  # every answer in that gap
    in_flight_at_kill: Counter[str]  # answers to the attempts under way at the kill
    conflicts_after_promotion: int  # 409s after the promotion: claims whose leases were held on the dead primary
    seconds_to_first_success: float  # from the kill to the first 2xx of an attempt started after it
    promotion_seconds: float  # pg_ctl promote, until it accepted writes
    unanswered: int  # calls that never got a final answer
    violations: list[str]
    timeline: list[tuple[float, float, int | str]]  # the first attempts after the kill: (start, seconds, outcome)


async def run_failover(
    *,
    synchronous: bool = True,
    clients: int = 8,
    delay: float = 0.2,
    warmup: float = 2.0,
    detection: float = 1.0,
    cooldown: float = 3.0,
    standby_lag: float = 0.0,
    lease: float = 2.0,
    store_timeout: float = 1.0,
    hard_deadline: float = 120.0,
) -> tuple[Result, FailoverFindings]:
    run = uuid.uuid4().hex[:12]
    with ReplicatedPostgres(synchronous=synchronous) as cluster:
        app = create_app(cluster.dsn, transactional=True, lease=lease, store_timeout=store_timeout)
        timing = TimingTransport()
        keys: list[str] = []
        acknowledged: list[str] = []
        unanswered = 0
        stop_at = float("inf")
        rss = PeakRss(this_process)
        async with serve(app) as url, rss.watching():
            retry = Retry(attempts=200, deadline=hard_deadline / 2, backoff=0.05, max_backoff=0.5)
            async with AsyncIdempotentClient(url, retry=retry, transport=timing, timeout=30.0) as client:

                async def worker(number: int) -> None:
                    nonlocal unanswered
                    index = 0
                    while time.monotonic() < stop_at:
                        key = f"failover-{run}-{number}-{index}"
                        index += 1
                        keys.append(key)
                        try:
                            reply = await client.post(f"/effects?delay={delay}", json={"key": key}, idempotency_key=key)
                        except RetriesExhausted:
                            unanswered += 1
                            continue
                        if reply.status_code == 201:
                            acknowledged.append(key)

                workers = asyncio.gather(*(worker(n) for n in range(clients)))
                await asyncio.sleep(max(warmup - standby_lag, 0.0))
                if standby_lag > 0:  # the standby stops receiving WAL this long before the kill
                    await asyncio.to_thread(cluster.pause_replication)
                    await asyncio.sleep(standby_lag)
                killed_at = time.monotonic()
                await asyncio.to_thread(cluster.kill_primary)
                await asyncio.to_thread(cluster.resume_replication, drop_unread=True)
                await asyncio.sleep(detection)
                promoting = time.monotonic()
                await asyncio.to_thread(cluster.promote)
                promoted_at = time.monotonic()
                stop_at = promoted_at + cooldown
                await asyncio.wait_for(workers, hard_deadline)

            before_resend = await effects_per_key(cluster.dsn, acknowledged)
            lost = sum(1 for key in acknowledged if before_resend.get(key, 0) == 0)
            # Every acknowledged call once more, as a client whose answer was lost would send it.
            rerun = 0
            async with httpx.AsyncClient(base_url=url, timeout=30.0) as plain:
                for key in acknowledged:
                    reply = await plain.post(
                        f"/effects?delay={delay}", json={"key": key}, headers={"Idempotency-Key": key}
                    )
                    if reply.status_code == 201 and reply.headers.get("idempotent-replayed") != "true":
                        rerun += 1
        counts = await effects_per_key(cluster.dsn, keys)
        found = await violations(cluster.dsn, keys)
    duplicates = sum(max(count - 1, 0) for count in counts.values())
    after_kill = sorted((a for a in timing.attempts if a.started >= killed_at), key=lambda a: a.started + a.seconds)
    first_success = next((a for a in after_kill if isinstance(a.outcome, int) and a.outcome < 300), None)
    recovered_at = first_success.started + first_success.seconds if first_success else float("inf")
    gap = [a for a in timing.attempts if killed_at <= a.started + a.seconds < recovered_at]
    gap_outcomes = Counter(str(a.outcome) for a in gap)
    in_flight = Counter(str(a.outcome) for a in timing.attempts if a.started < killed_at <= a.started + a.seconds)
    conflicts = sum(1 for a in timing.attempts if a.started >= promoted_at and a.outcome == 409)
    findings = FailoverFindings(
        synchronous=synchronous,
        calls=len(keys),
        acknowledged=len(acknowledged),
        acknowledged_lost=lost,
        rerun_on_resend=rerun,
        duplicates=duplicates,
        gap_503s=gap_outcomes.get("503", 0),
        gap_outcomes=gap_outcomes,
        in_flight_at_kill=in_flight,
        conflicts_after_promotion=conflicts,
        seconds_to_first_success=recovered_at - killed_at,
        timeline=[(round(a.started - killed_at, 2), round(a.seconds, 2), a.outcome) for a in after_kill][:60],
        promotion_seconds=promoted_at - promoting,
        unanswered=unanswered,
        violations=found,
    )
    mode = "synchronous" if synchronous else "asynchronous"
    result = Result(
        f"primary failover, {mode} replication",
        operations=len(keys),
        faults=f"primary SIGKILLed under traffic, standby promoted {detection:g} s later"
        + (f"; the standby {standby_lag:g} s behind at the kill" if standby_lag else ""),
        duplicates=duplicates,
        lost=lost + unanswered,
        peak_rss=rss.peak,
        notes=[_note(findings)],
        measures={
            "failovers": 1,
            "acknowledged": len(acknowledged),
            "acknowledged lost": lost,
            "rerun on resend": rerun,
            "gap 503s": findings.gap_503s,
            "in flight at kill": sum(in_flight.values()),
            "in flight 503": in_flight.get("503", 0),
            "conflicts after promotion": conflicts,
            "worst seconds to first success": findings.seconds_to_first_success,
            "worst promotion seconds": findings.promotion_seconds,
        },
    )
    return result, findings


def _note(findings: FailoverFindings) -> str:
    in_flight = ", ".join(f"{count} x {outcome}" for outcome, count in sorted(findings.in_flight_at_kill.items()))
    return (
        f"{findings.acknowledged_lost} of {findings.acknowledged} acknowledged calls lost, "
        f"{findings.rerun_on_resend} ran again when resent; {findings.gap_503s} x 503 until the first success "
        f"{findings.seconds_to_first_success:.1f} s after the kill (promotion took "
        f"{findings.promotion_seconds:.1f} s); in flight at the kill: {in_flight or 'none'}"
    )
