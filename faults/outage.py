"""Database outage: PostgreSQL goes away mid-run and comes back; the middleware fails closed, then recovers alone.

The ledger app (transactional, store timeout ``store_timeout``) is served by uvicorn in this process on a
PostgreSQL of its own (:class:`faults.pg.DisposablePostgres`). Client tasks run logical calls back to back through
the retrying client. Mid-run the database is taken away for ``downtime`` seconds, in one of two ways:

- ``stop``: a clean shutdown (``pg_ctl stop -m fast``): connections are closed, new ones refused;
- ``freeze``: SIGSTOP on the server and its backends: connections stay open and nothing answers (a hung host);
- ``kill``: SIGKILL on the server and its backends, ``kills`` times, each while handlers are between their claim
  and their commit (``delay`` seconds after their write), then a restart that recovers from the data directory.
  The claims of transactional requests commit without waiting for their WAL flush, so a kill can lose a claim
  whose handler had not committed: its retry must then run afresh, and no effect may survive without its record.

Meanwhile the middleware must answer 503 (within about its timeout, never hanging), run no handler without a
claim, and after the restart serve again without being told: the asyncpg pool reconnects on its own. The clients
retry their 503s with the same key, so in the end every call took effect exactly once, and every effect has its
completed record.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter
from dataclasses import dataclass

from faults.ledger_app import create_app
from faults.pg import DisposablePostgres
from faults.report import PeakRss, Result, this_process
from faults.server import serve
from faults.timing import TimingTransport
from faults.workers import effects_per_key, effects_without_a_record, reruns, tally, violations
from idempotency_mw.client import AsyncIdempotentClient, RetriesExhausted, Retry


@dataclass
class OutageFindings:
    mode: str
    calls: int
    during: Counter[str]  # outcomes of the attempts under way while the database was away
    worst_503_seconds: float  # slowest 503 answer
    worst_attempt_seconds: float  # slowest attempt of any kind while the database was away
    unanswered: int  # calls that never got a final answer
    violations: list[str]
    recovered_calls: int  # calls completed after the restart
    unrecorded: int  # effects whose completed record is missing (counted as lost operations)
    reruns: int  # handlers that ran again after a run of theirs was cut short (by a kill: mid-flight)


async def run_outage(
    *,
    mode: str = "stop",
    clients: int = 8,
    downtime: float = 3.0,
    kills: int = 3,
    delay: float = 0.05,
    warmup: float = 1.0,
    cooldown_calls: int = 5,
    store_timeout: float = 1.0,
    hard_deadline: float = 120.0,
    pg: DisposablePostgres | None = None,
) -> tuple[Result, OutageFindings]:
    """One outage (``kills`` of them for ``kill``). Each client task calls until the database is back and it has made
    ``cooldown_calls`` more."""
    if mode not in ("stop", "freeze", "kill"):
        raise ValueError("mode is 'stop', 'freeze' or 'kill'")
    run = uuid.uuid4().hex[:12]
    with contextlib.ExitStack() as owned:
        database = pg or owned.enter_context(DisposablePostgres())
        app = create_app(database.dsn, transactional=True, lease=2.0, store_timeout=store_timeout)
        timing = TimingTransport()
        keys: list[str] = []
        unanswered = 0
        back_at = float("inf")
        recovered = 0
        rss = PeakRss(this_process)
        async with serve(app) as url, rss.watching():
            retry = Retry(attempts=200, deadline=hard_deadline / 2, backoff=0.05, max_backoff=0.5)
            async with AsyncIdempotentClient(url, retry=retry, transport=timing, timeout=30.0) as client:

                async def worker(number: int) -> None:
                    nonlocal unanswered, recovered
                    made_after = 0
                    index = 0
                    while made_after < cooldown_calls:
                        key = f"outage-{run}-{number}-{index}"
                        index += 1
                        keys.append(key)
                        path = f"/effects?delay={delay}" if mode == "kill" else "/effects"
                        try:
                            await client.post(path, json={"key": key}, idempotency_key=key)
                        except RetriesExhausted:
                            unanswered += 1
                        if time.monotonic() > back_at:
                            made_after += 1
                            recovered += 1

                workers = asyncio.gather(*(worker(n) for n in range(clients)))
                await asyncio.sleep(warmup)
                went_away = time.monotonic()
                # pg_ctl blocks: run it off the event loop, which serves the app meanwhile.
                if mode == "kill":
                    for kill in range(kills):
                        if kill:
                            await asyncio.sleep(warmup)  # traffic again, handlers in flight again
                        await asyncio.to_thread(database.kill)
                        await asyncio.sleep(downtime)
                        await asyncio.to_thread(database.start)
                else:
                    await asyncio.to_thread(database.stop if mode == "stop" else database.freeze)
                    await asyncio.sleep(downtime)
                    await asyncio.to_thread(database.start if mode == "stop" else database.thaw)
                back_at = time.monotonic()
                await asyncio.wait_for(workers, hard_deadline)
        during = timing.overlapping(went_away, back_at)
        counts = await effects_per_key(database.dsn, keys)
        found = await violations(database.dsn, keys)
        unrecorded = await effects_without_a_record(database.dsn, keys)
        ran_again = await reruns(database.dsn, keys)
    duplicates, lost = tally(counts, keys)
    outcomes = Counter(str(a.outcome) for a in during)
    findings = OutageFindings(
        mode=mode,
        calls=len(keys),
        during=outcomes,
        worst_503_seconds=max((a.seconds for a in during if a.outcome == 503), default=0.0),
        worst_attempt_seconds=max((a.seconds for a in during), default=0.0),
        unanswered=unanswered,
        violations=found,
        recovered_calls=recovered,
        unrecorded=unrecorded,
        reruns=ran_again,
    )
    how = {
        "stop": "stopped (pg_ctl stop -m fast)",
        "freeze": "frozen (SIGSTOP)",
        "kill": f"killed (SIGKILL, {kills} times, handlers mid-flight)",
    }[mode]
    result = Result(
        f"database outage ({mode})",
        operations=len(keys),
        faults=f"PostgreSQL {how} for {downtime:g} s, then back on the same data directory",
        duplicates=duplicates,
        lost=lost + unanswered + unrecorded,
        peak_rss=rss.peak,
        notes=[
            f"{outcomes.get('503', 0)} x 503 while down, slowest {findings.worst_503_seconds:.2f} s "
            f"(store timeout {store_timeout:g} s)"
        ],
        measures={
            "503s": outcomes.get("503", 0),
            "worst 503 seconds": findings.worst_503_seconds,
            "worst attempt seconds": findings.worst_attempt_seconds,
        },
    )
    return result, findings
