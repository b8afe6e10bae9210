"""Duplicates that wait for a running original (``on_conflict="wait"``) against clients that retry on 409.

    .venv/bin/python benchmarks/waiting.py --dsn postgresql://…   # prints JSON (run.py: --only waiting)

One key, one original whose handler runs for ``--hold`` seconds, and ``--duplicates`` requests with the same key and
body that arrive spread over its first second (a client that timed out and retried, a double click, a queue that
redelivered). The app is called in process (httpx's ``ASGITransport``), its store a ``PostgresStore`` with a small
pool (``--pool``), each store's connections named by ``application_name``. Three variants, each for ``--rounds``
rounds, in alternating order:

- ``wait, one process``: the route waits (``on_conflict="wait"``, ``wait=5``); original and duplicates share the
  store, whose own completion wakes the waiters.
- ``wait, two processes``: the original runs on one store and app, the duplicates on another (two stores stand for
  two processes), woken by the database's notification (LISTEN/NOTIFY on a connection of the second store's).
- ``409, retry after 1 s``: the route answers 409 with ``Retry-After: 1`` (the default), and each duplicate's client
  sleeps what Retry-After says and sends again, until it gets the replay.

Measured: (a) the server connections of each store, open and busy (``pg_stat_activity`` by ``application_name``;
busy: not idle), sampled every 50 ms while the duplicates wait; (b) how long after the original's answer (its
client holding the response) each duplicate got its own, p50, p99 and max over every duplicate of every round;
(c) the requests the duplicates sent in all. Every duplicate must get a 201 replay with the original's bytes, and
the handler must run once per round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import uuid
from typing import Any

import asyncpg
import httpx
from common import Target, table, target_table
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idempotency_mw import IdempotencyMiddleware, PostgresStore
from idempotency_mw.tenants import AuthorizationTenant

VARIANTS = ("wait, one process", "wait, two processes", "409, retry after 1 s")
AUTH = {"Authorization": "Bearer sk_bench_waiting"}
SECRET = "benchmark-tenant-secret-0123456789abcdef"


class Original:
    """The handler: the first run holds until ``go``; it must run once per key."""

    def __init__(self) -> None:
        self.runs = 0
        self.entered = asyncio.Event()
        self.go = asyncio.Event()

    async def handle(self, request: Request) -> Response:
        self.runs += 1
        self.entered.set()
        await self.go.wait()
        return JSONResponse({"id": f"pi_{uuid.uuid4().hex[:12]}", "amount": 1250}, status_code=201)


def app_for(store: PostgresStore, original: Original, on_conflict: str) -> Starlette:
    app = Starlette(routes=[Route("/pay", original.handle, methods=["POST"])])
    options: dict[str, Any] = {"on_conflict": on_conflict}
    if on_conflict == "wait":
        options["wait"] = 5.0
    app.add_middleware(IdempotencyMiddleware, store=store, tenant=AuthorizationTenant(SECRET), **options)
    return app


def named(dsn: str, name: str) -> str:
    return f"{dsn}{'&' if '?' in dsn else '?'}application_name={name}"


async def connections(admin: asyncpg.Connection, names: list[str]) -> tuple[int, int]:
    """(open, busy) server connections of the stores named ``names``."""
    row = await admin.fetchrow(
        "SELECT count(*) AS open, count(*) FILTER (WHERE state <> 'idle') AS busy "
        "FROM pg_stat_activity WHERE application_name = ANY($1::text[])",
        names,
    )
    assert row is not None
    return int(row["open"]), int(row["busy"])


async def one_round(dsn: str, variant: str, duplicates: int, pool: int, hold: float, seed: int) -> dict[str, Any]:
    run = uuid.uuid4().hex[:8]
    names = [f"imw-wait-{run}-a", f"imw-wait-{run}-b"]
    two = variant == "wait, two processes"
    on_conflict = "reject" if variant.startswith("409") else "wait"
    here = PostgresStore(named(dsn, names[0]), min_size=1, max_size=pool)
    there = PostgresStore(named(dsn, names[1]), min_size=1, max_size=pool) if two else here
    admin = await asyncpg.connect(dsn)
    original = Original()
    try:
        await here.open()
        if two:
            await there.open()
        first_app = app_for(here, original, on_conflict)
        duplicate_app = app_for(there, original, on_conflict) if two else first_app
        transport = httpx.ASGITransport(app=first_app)
        other = httpx.ASGITransport(app=duplicate_app)
        key = f"order-{run}"
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://app", headers=AUTH, timeout=30) as client,
            httpx.AsyncClient(transport=other, base_url="http://app", headers=AUTH, timeout=30) as dup,
        ):
            first = asyncio.create_task(client.post("/pay", json={"amount": 1250}, headers={"Idempotency-Key": key}))
            await asyncio.wait_for(original.entered.wait(), 10)
            began = time.perf_counter()  # the original runs from here, for ``hold`` seconds
            draw = random.Random(seed)
            offsets = sorted(draw.uniform(0, 1.0) for _ in range(duplicates))
            sent = [0]

            async def duplicate(offset: float) -> tuple[float, httpx.Response]:
                await asyncio.sleep(max(0.0, began + offset - time.perf_counter()))
                while True:
                    sent[0] += 1
                    answer = await dup.post("/pay", json={"amount": 1250}, headers={"Idempotency-Key": key})
                    if answer.status_code != 409:
                        return time.perf_counter(), answer
                    await asyncio.sleep(float(answer.headers["retry-after"]))

            tasks = [asyncio.create_task(duplicate(offset)) for offset in offsets]
            await asyncio.sleep(max(0.0, began + 1.2 - time.perf_counter()))  # every duplicate has arrived
            # Sampled once every duplicate waits (the waiters the store counts), so the tail of their arrivals'
            # claims is not counted; the 409 variant has no waiters, and its clients send all along.
            samples: list[tuple[int, int]] = []
            first_sample = 0.0
            while time.perf_counter() < began + hold - 0.05:
                if on_conflict != "wait" or waiting_now(there) == duplicates:
                    first_sample = first_sample or time.perf_counter()
                    samples.append(await connections(admin, names))
                await asyncio.sleep(0.05)
            if not samples:
                raise SystemExit(f"{variant}: the {duplicates} duplicates were never all waiting")
            original.go.set()
            live = await first
            answered = time.perf_counter()
            done = await asyncio.gather(*tasks)
        delays = [(at - answered) * 1000 for at, _ in done]
        wrong = [a.status_code for _, a in done if a.status_code != 201 or a.content != live.content]
        if wrong or original.runs != 1 or live.status_code != 201:
            raise SystemExit(f"{variant}: {original.runs} runs, original {live.status_code}, wrong answers {wrong[:5]}")
        return {
            "delays_ms": delays,
            "requests": sent[0],
            "all_waiting_after_ms": (first_sample - began) * 1000 if first_sample else None,
            "open_max": max(s[0] for s in samples),
            "busy_max": max(s[1] for s in samples),
            "open_median": statistics.median(s[0] for s in samples),
            "busy_median": statistics.median(s[1] for s in samples),
            "samples": len(samples),
        }
    finally:
        original.go.set()
        await admin.close()
        await here.close(grace=0)
        if two:
            await there.close(grace=0)


def waiting_now(store: PostgresStore) -> int:
    """Requests waiting in ``store`` for a claim to settle (its ``Waiters``, read from outside)."""
    return sum(count for _, count in store._waiters._events.values())


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure(dsn: str, duplicates: int, pool: int, hold: float, rounds: int) -> dict[str, Any]:
    per: dict[str, list[dict[str, Any]]] = {variant: [] for variant in VARIANTS}
    for r in range(rounds):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            per[variant].append(await one_round(dsn, variant, duplicates, pool, hold, seed=r))
    out: dict[str, Any] = {}
    for variant, found in per.items():
        delays = [d for one in found for d in one["delays_ms"]]
        out[variant] = {
            "p50_ms": percentile(delays, 0.5),
            "p99_ms": percentile(delays, 0.99),
            "max_ms": max(delays),
            "requests_per_duplicate": sum(one["requests"] for one in found) / (duplicates * len(found)),
            "open_max": max(one["open_max"] for one in found),
            "busy_max": max(one["busy_max"] for one in found),
            "open_median": statistics.median(one["open_median"] for one in found),
            "all_waiting_after_ms": [one["all_waiting_after_ms"] for one in found],
            "busy_median": statistics.median(one["busy_median"] for one in found),
            "rounds_p50_ms": [percentile(one["delays_ms"], 0.5) for one in found],
            "rounds_p99_ms": [percentile(one["delays_ms"], 0.99) for one in found],
        }
    return {
        "duplicates": duplicates,
        "pool_max_size": pool,
        "hold_seconds": hold,
        "rounds": rounds,
        "python": sys.version.split()[0],
        "variants": out,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--duplicates", type=int, default=500)
    parser.add_argument("--pool", type=int, default=6, help="each store's max_size")
    parser.add_argument("--hold", type=float, default=3.0, help="seconds the original's handler runs")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    json.dump(asyncio.run(measure(args.dsn, args.duplicates, args.pool, args.hold, args.rounds)), sys.stdout)


# -- rendering (run.py) -----------------------------------------------------------------------------------------


def targets(result: dict[str, Any]) -> list[Target]:
    v = result["variants"]
    pool = result["pool_max_size"]
    one, two, retry = v["wait, one process"], v["wait, two processes"], v["409, retry after 1 s"]
    return [
        Target(
            f"wait: server connections while {result['duplicates']} duplicates wait (pool of {pool}, per store)",
            f"≤ {pool} + 1 listener",
            f"one process: {one['open_max']} open, {one['busy_max']} busy; two: {two['open_max']} open "
            f"(both stores), {two['busy_max']} busy",
            one["open_max"] <= pool + 1 and two["open_max"] <= 2 * (pool + 1),
        ),
        Target(
            "wait: a waiter's answer after the original's (p99)",
            "< 1 s, the 409 client's retry interval",
            f"one process {one['p99_ms']:.0f} ms, two {two['p99_ms']:.0f} ms; retrying on 409 {retry['p99_ms']:.0f} ms",
            max(one["p99_ms"], two["p99_ms"]) < 1000,
        ),
    ]


def render(result: dict[str, Any]) -> str:
    v = result["variants"]
    rows = [
        [
            name,
            f"{e['p50_ms']:.0f}",
            f"{e['p99_ms']:.0f}",
            f"{e['max_ms']:.0f}",
            f"{e['requests_per_duplicate']:.2f}",
            f"{e['open_median']:.0f} / {e['open_max']}",
            f"{e['busy_median']:.0f} / {e['busy_max']}",
        ]
        for name, e in v.items()
    ]
    rounds = [
        [name, ", ".join(f"{x:.0f}" for x in e["rounds_p50_ms"]), ", ".join(f"{x:.0f}" for x in e["rounds_p99_ms"])]
        for name, e in v.items()
    ]
    return "\n\n".join(
        [
            "# Waiting for a running original instead of 409",
            f"Python {result['python']}, in process (httpx's ASGITransport), `PostgresStore` with `max_size="
            f"{result['pool_max_size']}` per store. One key; its original's handler runs for "
            f"{result['hold_seconds']:g} s; {result['duplicates']} duplicates (same key, same body) arrive spread "
            f"over its first second. {result['rounds']} rounds per variant, in alternating order. *wait*: the route "
            'has `on_conflict="wait"` (`wait=5`), with the original and the duplicates on one store ("one '
            'process"), or on two stores of the same database ("two processes": the waiters are woken by the '
            "database's notification). *409*: the route answers 409 with `Retry-After: 1`, and each duplicate's "
            "client sleeps that long and sends again until it gets the replay. Delay: from the moment the "
            "original's client has its answer to the moment a duplicate's client has its own, over every "
            "duplicate of every round. Connections: the stores' server connections in `pg_stat_activity` (by "
            "`application_name`), median / max of samples every 50 ms until the original answers: for *wait* "
            "from the moment every duplicate waits (the store's count of its waiters), for *409* from 1.2 s on, "
            "after the last arrival; busy is any state but idle (a waiter that held a connection would show here).",
            target_table(targets(result)),
            table(
                [
                    "variant",
                    "p50 ms",
                    "p99 ms",
                    "max ms",
                    "requests per duplicate",
                    "open connections",
                    "busy connections",
                ],
                rows,
            ),
            "The first sample at which every duplicate was waiting (its claim answered, in the store's count of "
            "waiters), in ms after the original began, by round (sampling starts at 1.2 s, after the last arrival): "
            + "; ".join(
                f"{name}: {', '.join(f'{ms:.0f}' for ms in e['all_waiting_after_ms'])}"
                for name, e in v.items()
                if name.startswith("wait")
            )
            + ".",
            "Per round, p50 and p99 in ms:",
            table(["variant", "p50 by round", "p99 by round"], rounds),
        ]
    )
