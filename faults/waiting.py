"""Waiting across processes: copies of each request wait for the one that runs (``on_conflict="wait"``).

Two worker processes serve the ledger app in transactional mode, on the store's own pool or on an asyncpg pool of
the app's (made in its lifespan), on a database whose sessions default to any isolation level. Each operation is
sent ``copies`` times at once with one key, alternating between the workers: one copy runs (its handler writes its
effect and holds for ``delay`` seconds), and every other must wait for it and get its replay. What is counted:

- duplicates and lost operations (the ledger holds exactly one effect per key);
- copies that slept out their wait after the original settled: answered more than ``slack`` seconds after the
  original's answer, or not a replay at all (a 409 once the wait ran out). Each is a settlement that did not
  reach a waiter (a notification missed, a listener that took the connection a renewal needed). Such a copy
  sleeps until its wait ends, about ``wait - delay`` seconds after the original's answer; the default slack, half
  the wait, tells it from a replay that a loaded machine only delayed (up to 1.7 s, seen with four test workers on
  two cores, where a slack of 1 s counted those as missed).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import httpx

from faults.report import PeakRss, Result
from faults.server import CLIENT_KEEP_ALIVE
from faults.workers import effects_per_key, isolation_label, ledger_worker, tally


@dataclass
class WaitingFindings:
    originals: int = 0
    replays: int = 0
    slept: int = 0  # copies answered long after their original settled, or never replayed
    other: Counter[str] = field(default_factory=Counter)
    worst_lag: float = 0.0  # seconds between an original's answer and the last of its copies'


async def run_waiting(
    dsn: str,
    *,
    operations: int = 60,
    copies: int = 4,
    in_flight: int = 6,
    delay: float = 0.3,
    wait: float = 5.0,
    app_pool: int = 0,
    slack: float | None = None,
) -> tuple[Result, WaitingFindings]:
    """One round; ``app_pool``: the store of each worker on an asyncpg pool of the app's, of that many connections
    (0: its own); ``slack``: by default half the wait."""
    if slack is None:
        slack = wait / 2
    run = uuid.uuid4().hex[:12]
    keys = [f"wait-{run}-{i}" for i in range(operations)]
    findings = WaitingFindings()
    workers = [
        ledger_worker(dsn, transactional=True, on_conflict="wait", wait=wait, app_pool=app_pool, lease=2.0)
        for _ in range(2)
    ]
    rss = PeakRss(lambda: [w.process.pid for w in workers if w.process is not None])
    async with contextlib.AsyncExitStack() as stack:
        for worker in workers:  # one after the other: the first applies migrations and schema
            await stack.enter_async_context(worker)
        limits = httpx.Limits(
            max_connections=in_flight * copies,
            max_keepalive_connections=in_flight * copies,
            keepalive_expiry=CLIENT_KEEP_ALIVE,
        )
        http = await stack.enter_async_context(httpx.AsyncClient(timeout=wait * 4, limits=limits))
        await stack.enter_async_context(rss.watching())
        gate = asyncio.Semaphore(in_flight)

        async def copy(index: int, number: int) -> tuple[httpx.Response, float]:
            url = workers[number % 2].base_url + f"/effects?delay={delay}"
            reply = await http.post(url, json={"key": keys[index]}, headers={"Idempotency-Key": keys[index]})
            return reply, time.monotonic()

        async def operation(index: int) -> None:
            async with gate:
                replies = await asyncio.gather(*(copy(index, number) for number in range(copies)))
            originals = [
                at for reply, at in replies if reply.status_code == 201 and "idempotent-replayed" not in reply.headers
            ]
            findings.originals += len(originals)
            settled = min(originals, default=None)
            for reply, at in replies:
                if reply.headers.get("idempotent-replayed") == "true":
                    findings.replays += 1
                    if settled is not None:
                        findings.worst_lag = max(findings.worst_lag, at - settled)
                        if at - settled > slack:
                            findings.slept += 1
                elif reply.status_code == 409:
                    findings.slept += 1  # its wait ran out
                elif reply.status_code != 201:
                    findings.other[str(reply.status_code)] += 1

        try:
            await asyncio.gather(*(operation(i) for i in range(operations)))
        except httpx.TransportError as error:  # a copy got no answer at all: show what the workers logged
            for number, worker in enumerate(workers):
                worker.note_log(error, f"worker {number}")
            raise
    counts = await effects_per_key(dsn, keys)
    duplicates, lost = tally(counts, keys)
    pool = f"an app's pool of {app_pool}" if app_pool else "the store's own pool"
    result = Result(
        f"waiting copies across processes, transactional, {pool}" + await isolation_label(dsn),
        operations=operations,
        faults=f"{copies} concurrent copies of each request over 2 worker processes, waiting for the original",
        duplicates=duplicates,
        lost=lost,
        peak_rss=rss.peak,
        notes=[
            f"copies that slept out their wait after the original settled: {findings.slept}; the slowest replay "
            f"came {findings.worst_lag:.2f} s after its original's answer"
        ],
        measures={
            "originals": findings.originals,
            "replays": findings.replays,
            "slept out their wait": findings.slept,
            "other answers": sum(findings.other.values()),
            "worst replay lag, s": round(findings.worst_lag, 3),
        },
    )
    return result, findings
