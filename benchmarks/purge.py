"""Measurement 5: garbage collection under traffic. Purge expired records in batches while requests keep coming.

The table gets ``records`` expired rows (1,000,000 in full mode). A server with idempotency_mw takes fresh-key
traffic three times: quiet (before), while ``PostgresStore.purge_expired(batch_size=1000)`` runs back to back until
nothing is left (in this process, one connection), and quiet again (after). The purge rate is records per second
of the whole purge; the p99 during the purge is compared with the mean of the two quiet p99s.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import bulk
import loadgen
from common import Context, ratio, reset, table, verdict
from endtoend import check
from servers import Server

from idempotency_mw import PostgresStore

CONNECTIONS = 8
BATCH = 1000
PURGE_LIMIT_SECONDS = 900


async def purge_all(url: str) -> tuple[int, int, float]:
    """(records, batches, seconds) for purging until a batch comes back empty."""
    records = batches = 0
    async with PostgresStore(url, min_size=1, max_size=1, timeout=60) as store:
        started = time.perf_counter()
        while time.perf_counter() - started < PURGE_LIMIT_SECONDS:
            purged = await store.purge_expired(batch_size=BATCH)
            batches += 1
            records += purged
            if purged == 0:
                break
        return records, batches, time.perf_counter() - started


def measure(ctx: Context) -> dict[str, Any]:
    records = 200_000 if ctx.quick else 1_000_000
    reset(ctx.db.url)
    load_seconds = asyncio.run(bulk.add_records(ctx.db.url, 0, records, prefix="expired", expired=True))
    tag = uuid.uuid4().hex[:6]
    loads: dict[str, loadgen.Load] = {}
    with Server(ctx.python, "ours", ctx.db.url, log_name="purge") as server:
        loadgen.run(server.url, mode="fresh", prefix=f"warm-{tag}", connections=CONNECTIONS, seconds=2)
        loads["quiet before"] = loadgen.run(
            server.url, mode="fresh", prefix=f"qb-{tag}", connections=CONNECTIONS, seconds=ctx.seconds
        )
        background = loadgen.Background(
            server.url, mode="fresh", prefix=f"gc-{tag}", connections=CONNECTIONS, limit=PURGE_LIMIT_SECONDS + 60
        ).start()
        try:
            time.sleep(0.5)  # wrk has its connections open
            purged, batches, seconds = asyncio.run(purge_all(ctx.db.url))
        finally:
            loads["during purge"] = background.stop()
        loads["quiet after"] = loadgen.run(
            server.url, mode="fresh", prefix=f"qa-{tag}", connections=CONNECTIONS, seconds=ctx.seconds
        )
    return {
        "records": records,
        "load_seconds": load_seconds,
        "purged": purged,
        "batches": batches,
        "purge_seconds": seconds,
        "connections": CONNECTIONS,
        "loads": {name: {**load.as_dict(), "invalid": check(load, replays=False)} for name, load in loads.items()},
    }


def p99_ratio(result: dict[str, Any]) -> float:
    loads = result["loads"]
    quiet = (loads["quiet before"]["p99_ms"] + loads["quiet after"]["p99_ms"]) / 2
    return float(loads["during purge"]["p99_ms"] / quiet)


def render(result: dict[str, Any], ctx: Context) -> str:
    loads = result["loads"]
    quiet_p99 = (loads["quiet before"]["p99_ms"] + loads["quiet after"]["p99_ms"]) / 2
    quiet_p50 = (loads["quiet before"]["p50_ms"] + loads["quiet after"]["p50_ms"]) / 2
    rows = [
        [
            name,
            f"{load['seconds']:.1f}",
            f"{load['rps']:.0f}",
            f"{load['p50_ms']:.2f}",
            ratio(load["p50_ms"], quiet_p50),
            f"{load['p99_ms']:.2f}",
            ratio(load["p99_ms"], quiet_p99),
            load["invalid"] or "ok",
        ]
        for name, load in loads.items()
    ]
    r = p99_ratio(result)
    rate = result["purged"] / result["purge_seconds"] if result["purge_seconds"] else 0.0
    size = "Quick mode: 200,000 expired records (the full mode purges 1,000,000)." if ctx.quick else ""
    return "\n\n".join(
        [
            "# Garbage collection under traffic",
            f"{size} {result['records']:,} expired records bulk-loaded (in {result['load_seconds']:.0f} s), then "
            f"`PostgresStore.purge_expired(batch_size={BATCH})` called back to back on one connection until a batch "
            f"came back empty, while wrk sent fresh-key requests ({result['connections']} connections) to a server "
            "with idempotency_mw. Quiet runs before and after bracket it.",
            table(
                ["target", "measured", "verdict"],
                [["p99 during the purge ≤ 2x the quiet p99", f"{r:.2f}x", verdict(r <= 2)]],
            ),
            table(
                ["purged", "batches", "seconds", "records/s"],
                [[f"{result['purged']:,}", result["batches"], f"{result['purge_seconds']:.1f}", f"{rate:,.0f}"]],
            ),
            table(
                ["traffic", "seconds", "requests/s", "p50 ms", "p50 vs quiet", "p99 ms", "p99 vs quiet", "answers"],
                rows,
            ),
        ]
    )
