"""Issue 14, target 2: the client CPU of ``PostgresStore.claim`` + ``complete`` against raw asyncpg, in process.

    benchmarks/.work/venv/bin/python benchmarks/storepath.py --dsn postgresql://…   # prints JSON

What a fresh request spends in the app process on its two statements, with no HTTP and no middleware. Variants,
each running the same two statements of ``sql/queries.sql`` (``claim`` for a new key, then ``complete`` with a
small stored response) from ``--tasks`` concurrent tasks, under uvloop like the servers:

- ``raw``: what an expert writes by hand: one asyncpg connection per task, the statements prepared once per
  connection (``connection.prepare``), no deadline, no pool.
- ``raw-deadline``: the same with a deadline on every statement (``command_timeout``, what the store sets), for
  what a deadline costs.
- ``store``: ``PostgresStore.claim`` then ``PostgresStore.complete`` (its own connections, ``max_size`` 20, its
  deadlines, its error mapping, the claim's bookkeeping).

The variants run interleaved, round after round, each on connections opened before the round (and closed after
it); a round's cost is this process's CPU time (user + system, ``time.process_time``) divided by the pairs it
completed. Other processes on a shared machine do not count, the database's CPU included: this measures the
client. The ratio is store over raw, per round, and the result is the median over rounds with the spread.

``components`` times pieces of the store path alone (µs per call), to show where a difference comes from: the
fence a claim draws (``secrets.randbits``), the headers' JSON, turning a row into a ``Claim``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

from idempotency_mw import PostgresStore
from idempotency_mw.capture import encode_headers
from idempotency_mw.postgres import claim_from_row, completion, new_fence
from idempotency_mw.sql import queries
from idempotency_mw.store import StoredResponse

TENANT = "storepath-tenant"
FINGERPRINT = bytes(range(32))
BODY = b'{"id":1,"status":"accepted","amount":1250,"currency":"eur","customer":"cus_42"}'
HEADER_LIST = [(b"content-length", str(len(BODY)).encode()), (b"content-type", b"application/json")]
RESPONSE = StoredResponse(201, HEADER_LIST, BODY, len(BODY))
LEASE, TTL = 30.0, 86400.0
VARIANTS = ("raw", "raw-deadline", "store")


async def run_raw(dsn: str, tasks: int, pairs: int, run: str, deadline: float | None = None) -> float:
    """CPU seconds per pair, raw prepared asyncpg, one connection per task; ``deadline``: its ``command_timeout``."""
    sql = queries("public")
    connections = await asyncio.gather(*(asyncpg.connect(dsn, command_timeout=deadline) for _ in range(tasks)))
    try:
        prepared = [(await c.prepare(sql["claim"]), await c.prepare(sql["complete"])) for c in connections]

        async def worker(n: int) -> None:
            claim, complete = prepared[n]
            for i in range(pairs // tasks):
                key = f"{run}-{n}-{i}"
                row = await claim.fetchrow(TENANT, key, FINGERPRINT, LEASE, TTL, new_fence())
                headers = encode_headers(RESPONSE.headers)
                await complete.fetch(TENANT, key, row["fence"], 201, headers, BODY, len(BODY))

        started = time.process_time()
        await asyncio.gather(*(worker(n) for n in range(tasks)))
        return (time.process_time() - started) / (pairs // tasks * tasks)
    finally:
        await asyncio.gather(*(c.close() for c in connections))


async def run_store(dsn: str, tasks: int, pairs: int, run: str) -> float:
    """CPU seconds per pair through ``PostgresStore``."""
    store = PostgresStore(dsn, min_size=tasks, max_size=max(20, tasks + 1))
    await store.open()
    try:

        async def worker(n: int) -> None:
            for i in range(pairs // tasks):
                key = f"{run}-{n}-{i}"
                claim = await store.claim(TENANT, key, FINGERPRINT, lease=LEASE, ttl=TTL)
                assert claim.fence is not None
                await store.complete(TENANT, key, claim.fence, RESPONSE)

        await asyncio.gather(*(worker(n) for n in range(tasks)))  # the first pairs prepare the statements
        started = time.process_time()
        await asyncio.gather(*(worker(n) for n in range(tasks)))
        return (time.process_time() - started) / (pairs // tasks * tasks)
    finally:
        await store.close()


async def run_raw_deadline(dsn: str, tasks: int, pairs: int, run: str) -> float:
    return await run_raw(dsn, tasks, pairs, run, deadline=5.0)


RUNNERS: dict[str, Callable[[str, int, int, str], Awaitable[float]]] = {
    "raw": run_raw,
    "raw-deadline": run_raw_deadline,
    "store": run_store,
}


def components(n: int = 100_000) -> dict[str, float]:
    """µs per call of pieces of the store path, each timed alone."""

    def each(function: Callable[[], object]) -> float:
        started = time.perf_counter()
        for _ in range(n):
            function()
        return (time.perf_counter() - started) / n * 1e6

    row = {
        "owned": True,
        "fence": 12345,
        "state": "in_progress",
        "same_request": True,
        "attempts": 0,
        "status": None,
        "headers": None,
        "body": None,
        "body_size": None,
    }
    return {
        "new_fence() (secrets.randbits(63))": each(new_fence),
        "for comparison: a counter's next value": each(iter(range(10**9)).__next__),
        "headers to JSON (encode_headers)": each(lambda: encode_headers(HEADER_LIST)),
        "completion() arguments": each(lambda: completion(TENANT, "k", 1, RESPONSE)),
        "claim_from_row (a fresh claim)": each(lambda: claim_from_row(row)),  # type: ignore[arg-type]
    }


async def main(dsn: str, tasks: int, pairs: int, rounds: int) -> dict[str, Any]:
    run = uuid.uuid4().hex[:8]
    await run_raw(dsn, tasks, min(pairs, 2000), f"{run}-warm")  # the server's caches, the client's imports
    per_round: list[dict[str, float]] = []
    for r in range(rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        seconds: dict[str, float] = {}
        for variant in order:
            seconds[variant] = await RUNNERS[variant](dsn, tasks, pairs, f"{run}-{r}-{variant}")
        per_round.append(seconds)
    ratios = [r["store"] / r["raw"] for r in per_round]
    return {
        "tasks": tasks,
        "pairs_per_round": pairs,
        "rounds": rounds,
        "us_per_pair": {v: statistics.median(r[v] for r in per_round) * 1e6 for v in VARIANTS},
        "each_round_us": [{v: round(r[v] * 1e6, 1) for v in VARIANTS} for r in per_round],
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "components": components(),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--pairs", type=int, default=8000, help="claim+complete pairs per variant per round")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    try:
        from uvloop import run as run_loop
    except ImportError:
        run_loop = asyncio.run  # type: ignore[assignment]
    json.dump(run_loop(main(args.dsn, args.tasks, args.pairs, args.rounds)), sys.stdout)
