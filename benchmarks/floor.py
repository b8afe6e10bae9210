"""The database's own floor: what PostgreSQL and asyncpg can do for idempotent requests with no HTTP at all.

Each worker owns one connection (no pool, so no pool bookkeeping) and loops over the two statements a fresh request
needs, taken from the store's own ``sql/queries.sql``: ``claim`` (a new key) then ``complete`` (a small stored
response), each committed on its own. ``--connections`` workers run for ``--seconds``. Runs under uvloop, like the
servers. Prints JSON: pairs per second, p50/p99 of one claim+complete pair, and the context switches of its
server processes (they end with its connections, before the caller could count them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid

import asyncpg
import psutil

from idempotency_mw.postgres._records import new_fence
from idempotency_mw.postgres._sql import queries
from idempotency_mw.store import encode_headers

TENANT = "floor-tenant"
FINGERPRINT = bytes(32)  # the claim takes a list of these: the request's fingerprint under each key
BODY = b'{"id":1,"status":"accepted","amount":1250,"currency":"eur","customer":"cus_42"}'
HEADERS = encode_headers([(b"content-length", str(len(BODY)).encode()), (b"content-type", b"application/json")])


def switches(pid: int) -> int:
    """Context switches of one server process so far (the server runs on this machine)."""
    return sum(psutil.Process(pid).num_ctx_switches())


async def worker(dsn: str, run: str, deadline: float, latencies: list[float], switched: list[int]) -> None:
    sql = queries("public")
    connection = await asyncpg.connect(dsn)
    try:
        claim, complete = await connection.prepare(sql["claim"]), await connection.prepare(sql["complete"])
        unused = (None,) * (len(claim.get_parameters()) - 7)  # the claim's later parameters: none stored (NULL)
        backend = connection.get_server_pid()
        first = switches(backend)
        i = 0
        while time.perf_counter() < deadline:
            i += 1
            started = time.perf_counter()
            row = await claim.fetchrow(TENANT, f"{run}-{i}", [FINGERPRINT], 60.0, 86400.0, new_fence(), None, *unused)
            assert row is not None
            assert row["owned"]  # a new key: inserted, ours
            await complete.fetch(TENANT, f"{run}-{i}", row["fence"], 201, HEADERS, BODY, len(BODY), None, None)
            latencies.append(time.perf_counter() - started)
        switched.append(switches(backend) - first)  # before the process ends with the connection
    finally:
        await connection.close()


async def main(dsn: str, connections: int, seconds: float) -> dict[str, float]:
    latencies: list[float] = []
    switched: list[int] = []
    run = uuid.uuid4().hex[:8]
    started = time.perf_counter()
    deadline = started + seconds
    await asyncio.gather(*(worker(dsn, f"{run}-{n}", deadline, latencies, switched) for n in range(connections)))
    elapsed = time.perf_counter() - started
    cuts = statistics.quantiles(latencies, n=100)
    return {
        "requests": len(latencies),
        "seconds": elapsed,
        "rps": len(latencies) / elapsed,
        "p50_ms": cuts[49] * 1000,
        "p99_ms": cuts[98] * 1000,
        "connections": connections,
        "backend_switches": sum(switched),  # context switches of its own server processes, which end with it
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--connections", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=10)
    args = parser.parse_args()
    try:
        from uvloop import run as run_loop
    except ImportError:
        run_loop = asyncio.run
    json.dump(run_loop(main(args.dsn, args.connections, args.seconds)), sys.stdout)
