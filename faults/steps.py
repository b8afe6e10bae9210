"""Steps under fire: the payments example's payouts (a handler in steps, the payout provider between two local steps)
crashed between every pair of steps, under a retry storm, through a lossy network, against a provider that fails.

The payout provider (``examples/payments/provider.py``) runs in a process of its own, which no kill touches, and
answers 503 before or after it transfers now and then. The payments worker waits ``pause`` seconds after each step
(``PAYMENTS_PAUSE_BETWEEN_STEPS``), with a short lease. Every payout is sent as ``copies`` concurrent calls of the
retrying client with one key, through the demo's lossy proxy. While they run the worker is killed (SIGKILL) ``kills``
times, each time once handlers wait in every gap between two steps (or ``patience`` seconds have passed), and
restarted on the same port; the clients' retries take the dead claims over when their leases lapse and resume them.
A gap that none of those kills caught (handlers moved on between the look and the kill, on a loaded machine) gets
up to ``kills`` more, while operations are still in flight.

At each kill, the payouts the dead worker held are sorted by where they stopped, from the database and the provider's
books: before the first step committed, between the payout row and the transfer, between the transfer and its record
(the transfer made, the request not yet at its next recovery point), and between the last step and the completion.

Afterwards every operation must have exactly one payout row, paid, exactly one provider transfer for it, the one the
row names, and every copy that got a final answer must have got the answer that names that row and that transfer.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import httpx

from faults.proxy import LossyProxy
from faults.report import PeakRss, Result
from faults.server import ServerProcess
from idempotency_mw.client import AsyncIdempotentClient, RetriesExhausted, Retry

GAPS = (
    "before the first step committed",
    "between create_payout and provider_transfer",
    "between provider_transfer and record_payout",
    "between record_payout and the completion",
)
BETWEEN_STEPS = GAPS[1:]  # the gaps a kill must land in, each at least once, for the round to prove anything

_IN_FLIGHT = """
SELECT r.key, o.id AS payout,
       (SELECT p.step FROM idempotency_recovery_points AS p
         WHERE p.tenant = r.tenant AND p.key = r.key AND p.life = r.created_at ORDER BY p.position DESC LIMIT 1)
           AS last_step
FROM idempotency_records AS r
LEFT JOIN payments.payouts AS o ON o.idempotency_key = r.key
WHERE r.key = ANY($1::text[])
  AND NOT EXISTS (SELECT FROM idempotency_responses AS s WHERE s.tenant = r.tenant AND s.key = r.key)
"""
_PAYOUTS = """
SELECT metadata->>'demo_op' AS name, id, status, transfer FROM payments.payouts
WHERE metadata->>'demo_op' = ANY($1::text[])
"""


@dataclass
class StepsFindings:
    gaps: Counter[str] = field(default_factory=Counter)  # handlers the kills caught, by where they stopped
    kills: int = 0
    unanswered: int = 0  # operations none of whose copies got a final answer
    mismatched: list[str] = field(default_factory=list)  # final answers that do not name the operation's effect
    provider: dict[str, int] = field(default_factory=dict)  # the provider's own counts


async def run_steps(
    dsn: str,
    *,
    operations: int = 40,
    copies: int = 3,
    kills: int = 3,
    pause: float = 0.3,
    lease: float = 2.0,
    patience: float = 8.0,
    drop_rate: float = 0.1,
    reset_rate: float = 0.05,
    cut_rate: float = 0.05,
    provider_fail_rate: float = 0.1,
    provider_lose_rate: float = 0.1,
) -> tuple[Result, StepsFindings]:
    """One round: ``operations`` payouts, ``copies`` at once each, ``kills`` SIGKILLs of the worker between steps
    (up to twice as many, while a gap is not caught yet)."""
    run = uuid.uuid4().hex[:12]
    names = [f"steps-{run}-{i}" for i in range(operations)]
    keys = [f"steps-{run}-key-{i}" for i in range(operations)]
    auth = {"Authorization": f"Bearer sk_test_steps_{run}"}
    findings = StepsFindings()
    bank_env = {"PROVIDER_FAIL_RATE": str(provider_fail_rate), "PROVIDER_LOSE_RATE": str(provider_lose_rate)}
    async with ServerProcess("examples.payments.provider:app", env=bank_env) as bank:
        worker = ServerProcess(
            "examples.payments.app:app",
            env={
                "DATABASE_URL": dsn,
                "PAYMENTS_POOL_SIZE": "20",
                "PAYMENTS_MIGRATE": "1",
                "PAYMENTS_PROVIDER_URL": bank.base_url,
                "PAYMENTS_PAUSE_BETWEEN_STEPS": str(pause),
                "IDEMPOTENCY_LEASE": str(lease),
            },
        )
        rss = PeakRss(lambda: [worker.process.pid] if worker.process is not None else [])
        connection = await asyncpg.connect(dsn)
        try:
            async with (
                worker,
                rss.watching(),
                httpx.AsyncClient(base_url=bank.base_url, timeout=10.0) as books,
                LossyProxy(worker.port, drop_rate=drop_rate, reset_rate=reset_rate, cut_rate=cut_rate) as proxy,
            ):
                retry = Retry(attempts=60, deadline=90.0, backoff=0.05, max_backoff=1.0)
                async with AsyncIdempotentClient(proxy.url, retry=retry, headers=auth, timeout=10.0) as client:

                    async def copy(index: int) -> dict[str, Any] | None:
                        data = {"amount": str(100 + index), "currency": "eur", "metadata[demo_op]": names[index]}
                        try:
                            answer = await client.post("/v1/payouts", data=data, idempotency_key=keys[index])
                        except RetriesExhausted:
                            return None
                        body: dict[str, Any] = answer.json()
                        return {"http_status": answer.status_code, **body}

                    async def operation(index: int) -> list[dict[str, Any] | None]:
                        return list(await asyncio.gather(*(copy(index) for _ in range(copies))))

                    running = asyncio.gather(*(operation(i) for i in range(operations)))
                    try:
                        while findings.kills < kills or (
                            findings.kills < 2 * kills
                            and not all(findings.gaps[gap] for gap in BETWEEN_STEPS)
                            and not running.done()
                        ):
                            await _wait_between_steps(connection, books, keys, patience)
                            worker.kill()
                            assert worker.process is not None
                            await worker.process.wait()
                            findings.kills += 1
                            findings.gaps.update(await _where(connection, books, keys))  # as the kill left them
                            await worker.start()
                        answers = await asyncio.wait_for(running, timeout=180)
                    except BaseException:
                        running.cancel()
                        await asyncio.gather(running, return_exceptions=True)
                        raise
                findings.provider = (await books.get("/v1/stats")).json()
                transfers: dict[str, list[str]] = {}
                for made in (await books.get("/v1/transfers")).json():
                    transfers.setdefault(made["reference"], []).append(made["id"])
                stats = proxy.stats
        finally:
            rows = await connection.fetch(_PAYOUTS, names)
            await connection.close()
    per_name: dict[str, list[Any]] = {}
    for row in rows:
        per_name.setdefault(row["name"], []).append(row)
    ours = {row["id"] for row in rows}
    duplicates = sum(len(found) - 1 for found in per_name.values())  # payout rows beyond one per operation
    duplicates += sum(len(made) - (reference in ours) for reference, made in transfers.items() if reference in ours)
    lost = 0
    for index, name in enumerate(names):
        found = per_name.get(name, [])
        final = [each for each in answers[index] if each is not None]
        if not final:
            findings.unanswered += 1
        if len(found) != 1 or found[0]["status"] != "paid" or transfers.get(found[0]["id"]) != [found[0]["transfer"]]:
            lost += 1
            continue
        effect = (200, found[0]["id"], "paid", found[0]["transfer"])
        for each in final:
            if (each["http_status"], each.get("id"), each.get("status"), each.get("transfer")) != effect:
                findings.mismatched.append(f"{name}: answered {each}, the effect is {effect}")
    caught = sum(findings.gaps[gap] for gap in BETWEEN_STEPS)
    result = Result(
        "steps: kill -9 between every pair of steps, retry storm, lossy network",
        operations=operations,
        faults=f"{findings.kills} SIGKILLs with {caught} payouts between two steps, restarts; {copies} copies of "
        f"each; {stats.resets + stats.dropped + stats.cut} network faults; "
        f"{findings.provider.get('failed', 0) + findings.provider.get('lost', 0)} provider 503s",
        duplicates=duplicates,
        lost=lost + findings.unanswered + len(findings.mismatched),
        peak_rss=rss.peak,
        notes=[
            "caught at the kills: " + ", ".join(f"{findings.gaps[gap]} {gap}" for gap in GAPS),
            f"{sum(map(len, transfers.values()))} provider transfers in {findings.provider.get('calls', 0)} calls",
        ],
        measures={
            "kills": findings.kills,
            **{f"caught {gap}": findings.gaps[gap] for gap in GAPS},
            "provider calls": findings.provider.get("calls", 0),
            "provider transfers": sum(map(len, transfers.values())),
            "provider 503s": findings.provider.get("failed", 0) + findings.provider.get("lost", 0),
            "network faults": stats.resets + stats.dropped + stats.cut,
            "mismatched answers": len(findings.mismatched),
        },
    )
    return result, findings


async def _where(connection: asyncpg.Connection, books: httpx.AsyncClient, keys: list[str]) -> Counter[str]:
    """The payouts in flight (claimed, not completed), by the gap they are in."""
    rows = await connection.fetch(_IN_FLIGHT, keys)
    if not rows:
        return Counter()
    transferred = {made["reference"] for made in (await books.get("/v1/transfers")).json()}
    gaps: Counter[str] = Counter()
    for row in rows:
        if row["last_step"] is None:
            gaps[GAPS[0]] += 1
        elif row["last_step"] == "create_payout":
            gaps[GAPS[2] if row["payout"] in transferred else GAPS[1]] += 1
        else:
            gaps[GAPS[3]] += 1
    return gaps


async def _wait_between_steps(
    connection: asyncpg.Connection, books: httpx.AsyncClient, keys: list[str], patience: float
) -> None:
    """Wait (at most ``patience`` s) until handlers wait in every gap between two steps."""
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        gaps = await _where(connection, books, keys)
        if all(gaps[gap] for gap in BETWEEN_STEPS):
            return
        await asyncio.sleep(0.02)
