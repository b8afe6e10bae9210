"""Storm across processes: every payment sent several times at once, spread over two worker processes.

Two uvicorn processes serve the payments example on one database. Each logical payment is sent ``copies`` times
concurrently with one Idempotency-Key, alternating between the workers, so the copies race for the claim in two
processes at once. Exactly one copy may run; every other must be answered 409 (still in progress) or with a
replay of the winner's answer. The ledger then holds exactly one charge per payment.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import Counter
from dataclasses import dataclass, field

import httpx

from faults.report import PeakRss, Result
from faults.server import CLIENT_KEEP_ALIVE
from faults.workers import charges_per_key, isolation_label, payments_worker, tally
from idempotency_mw.client import AsyncIdempotentClient, Retry


@dataclass
class StormAnswers:
    originals: int = 0  # copies that ran the payment
    replays: int = 0
    conflicts: int = 0  # 409 in progress
    other: Counter[str] = field(default_factory=Counter)  # anything else: a failure of the scenario
    mismatched_replays: int = 0  # replays whose body differs from the original's
    payments_without_original: int = 0  # no copy ran (settled afterwards by a retrying client)


def _form(index: int) -> dict[str, str]:
    return {"amount": str(1000 + index), "currency": "eur", "confirm": "true"}


async def run_storm(
    dsn: str,
    *,
    payments: int = 200,
    copies: int = 5,
    in_flight: int = 20,
    pgbouncer: str | None = None,
    on_conflict: str = "reject",
) -> tuple[Result, StormAnswers]:
    """``on_conflict="wait"``: copies wait for the one that runs instead of answering 409.
    ``pgbouncer``: the DSN of a transaction-pooling PgBouncer in front of ``dsn``, which the workers then use
    (without prepared statements); the ledger is counted on ``dsn`` itself."""
    run = uuid.uuid4().hex[:12]
    auth = {"Authorization": f"Bearer sk_test_storm_{run}"}
    keys = [f"storm-{run}-{i}" for i in range(payments)]
    answers = StormAnswers()
    app_dsn = pgbouncer or dsn
    prepared = pgbouncer is None
    first = payments_worker(app_dsn, prepared_statements=prepared, on_conflict=on_conflict)
    second = payments_worker(app_dsn, prepared_statements=prepared, on_conflict=on_conflict)
    rss = PeakRss(lambda: [p.process.pid for p in (first, second) if p.process is not None])
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(first)  # one after the other: the first applies migrations and schema
        await stack.enter_async_context(second)
        # A client per copy, each with a pool of ``in_flight`` connections: httpcore's pool looks at every one of
        # its connections for every request it places, and one pool of in_flight x copies connections spent 13 of
        # a 100-payment round's 18 s doing that, in this process, while the workers waited for requests.
        limits = httpx.Limits(
            max_connections=in_flight, max_keepalive_connections=in_flight, keepalive_expiry=CLIENT_KEEP_ALIVE
        )
        clients = [
            await stack.enter_async_context(httpx.AsyncClient(timeout=30, limits=limits, headers=auth))
            for _ in range(copies)
        ]
        http = clients[0]
        await stack.enter_async_context(rss.watching())
        # The account exists before the storm (the example creates it with its first write, in that request's
        # transaction): the storm is about copies of one payment, not about first writes of one account at once,
        # which fail to serialize under REPEATABLE READ as the app's own conflict.
        opened = await http.post(
            first.base_url + "/v1/customers",
            data={"name": "storm"},
            headers={"Idempotency-Key": f"storm-{run}-account"},
        )
        opened.raise_for_status()
        gate = asyncio.Semaphore(in_flight)
        urls = [first.base_url, second.base_url]
        unsettled: list[int] = []

        async def payment(index: int) -> None:
            async with gate:
                replies = await asyncio.gather(
                    *(
                        clients[copy].post(
                            urls[copy % 2] + "/v1/payment_intents",
                            data=_form(index),
                            headers={"Idempotency-Key": keys[index]},
                        )
                        for copy in range(copies)
                    )
                )
            originals = [r for r in replies if r.status_code == 200 and "idempotent-replayed" not in r.headers]
            answers.originals += len(originals)
            for reply in replies:
                if reply.headers.get("idempotent-replayed") == "true":
                    answers.replays += 1
                    if originals and reply.content != originals[0].content:
                        answers.mismatched_replays += 1
                elif reply.status_code == 409:
                    answers.conflicts += 1
                elif reply.status_code != 200:
                    answers.other[str(reply.status_code)] += 1
            if not originals:
                answers.payments_without_original += 1
                unsettled.append(index)

        try:
            await asyncio.gather(*(payment(i) for i in range(payments)))
        except httpx.TransportError as error:  # a copy got no answer at all: show what the workers logged
            first.note_log(error, "first worker")
            second.note_log(error, "second worker")
            raise
        # A payment whose copies all met another copy in progress, or failed, is finished by a retrying client.
        async with AsyncIdempotentClient(retry=Retry(attempts=20, deadline=60), headers=auth) as client:
            for index in unsettled:
                await client.post(
                    first.base_url + "/v1/payment_intents", data=_form(index), idempotency_key=keys[index]
                )
    counts = await charges_per_key(dsn, keys)
    duplicates, lost = tally(counts, keys)
    result = Result(
        "storm across processes"
        + (" through PgBouncer" if pgbouncer else "")
        + (", copies waiting" if on_conflict == "wait" else "")
        + await isolation_label(dsn),
        operations=payments,
        faults=f"{copies} concurrent copies of each payment over 2 worker processes"
        + (" via PgBouncer (transaction pooling)" if pgbouncer else ""),
        duplicates=duplicates,
        lost=lost,
        peak_rss=rss.peak,
        notes=[f"duplicate copies answered: {answers.conflicts} x 409, {answers.replays} replays"],
        measures={
            "originals": answers.originals,
            "replays": answers.replays,
            "conflicts": answers.conflicts,
            "other answers": sum(answers.other.values()),
        },
    )
    return result, answers
