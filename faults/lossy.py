"""Lossy network: the demo's proxy drops answers, resets connections and cuts clients off, at random.

The payments example runs in a worker process; the demo's :class:`~faults.proxy.LossyProxy` sits
between it and the retrying client. Every payment is one logical call with one key, retried through the losses;
afterwards the ledger must hold exactly one charge per payment: none lost (every call got its answer in the end)
and none doubled (an answer lost after the charge committed was replayed, not charged again).
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

from faults.proxy import LossyProxy
from faults.report import PeakRss, Result
from faults.workers import charges_per_key, payments_worker, tally
from idempotency_mw.client import AsyncIdempotentClient, RetriesExhausted, Retry


async def run_lossy(
    dsn: str,
    *,
    payments: int = 100,
    concurrency: int = 10,
    drop_rate: float = 0.2,
    reset_rate: float = 0.1,
    cut_rate: float = 0.1,
    seed: int | None = None,
) -> tuple[Result, Counter[str]]:
    run = uuid.uuid4().hex[:12]
    keys = [f"lossy-{run}-{i}" for i in range(payments)]
    auth = {"Authorization": f"Bearer sk_test_lossy_{run}"}
    final: Counter[str] = Counter()
    worker = payments_worker(dsn)
    rss = PeakRss(lambda: [worker.process.pid] if worker.process is not None else [])
    async with worker, rss.watching():
        proxy = LossyProxy(worker.port, drop_rate=drop_rate, reset_rate=reset_rate, cut_rate=cut_rate, seed=seed)
        async with proxy:
            retry = Retry(attempts=30, deadline=60.0, backoff=0.05, max_backoff=1.0)
            async with AsyncIdempotentClient(proxy.url, retry=retry, headers=auth, timeout=10.0) as client:
                gate = asyncio.Semaphore(concurrency)

                async def pay(index: int) -> None:
                    async with gate:
                        try:
                            answer = await client.post(
                                "/v1/payment_intents",
                                data={"amount": str(500 + index), "currency": "usd", "confirm": "true"},
                                idempotency_key=keys[index],
                            )
                        except RetriesExhausted:
                            final["gave up"] += 1
                            return
                    final["replayed" if answer.replayed else str(answer.status_code)] += 1

                await asyncio.wait_for(asyncio.gather(*(pay(i) for i in range(payments))), 300)
        stats = proxy.stats
    counts = await charges_per_key(dsn, keys)
    duplicates, lost = tally(counts, keys)
    injected = stats.resets + stats.dropped + stats.cut
    result = Result(
        "lossy network",
        operations=payments,
        faults=f"{injected} ({stats.resets} resets, {stats.dropped} answers dropped, {stats.cut} clients cut off)",
        duplicates=duplicates,
        lost=lost + final["gave up"],
        peak_rss=rss.peak,
        notes=[f"{final['replayed']} calls ended with a replay of an answer the network had lost"],
        measures={
            "resets": stats.resets,
            "dropped": stats.dropped,
            "cut": stats.cut,
            "requests forwarded": stats.requests,
        },
    )
    return result, final
