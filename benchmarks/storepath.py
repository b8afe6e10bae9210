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
fence a claim draws (63 bits of ``os.urandom``), the headers' JSON, turning a row into a ``Claim``.

``replays`` (issue 14, target 4): WAL bytes per replay of a completed key, from the server's WAL position before
and after a batch of replays through ``PostgresStore.claim``, side by side with the same batch through
``claim_locked`` (the ``INSERT … ON CONFLICT DO UPDATE`` the claim was before, which writes the row on every
replay). ``races``: how often a claim finds no row to answer from and needs ``claim_locked``, with every task
claiming the same keys at the same moment (the worst case; with distinct keys it never happens).
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
from common import Target, table, target_table

from idempotency_mw import PostgresStore
from idempotency_mw.rows import claim_from_row, completion, encode_headers, new_fence
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
                row = await claim.fetchrow(TENANT, key, [FINGERPRINT], LEASE, TTL, new_fence(), None)
                headers = encode_headers(RESPONSE.headers)
                await complete.fetch(TENANT, key, row["fence"], 201, headers, BODY, len(BODY), None, None)

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
        "new_fence() (63 bits of os.urandom)": each(new_fence),
        "for comparison: a counter's next value": each(iter(range(10**9)).__next__),
        "headers to JSON (encode_headers)": each(lambda: encode_headers(HEADER_LIST)),
        "completion() arguments": each(lambda: completion(TENANT, "k", 1, RESPONSE)),
        "claim_from_row (a fresh claim)": each(lambda: claim_from_row(row, TENANT, "k")),  # type: ignore[arg-type]
    }


async def wal_position(connection: asyncpg.Connection) -> int:
    return int(await connection.fetchval("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint"))


async def replays(dsn: str, keys: int, rounds: int, run: str) -> dict[str, Any]:
    """WAL bytes per replay: the claim as it is, and the statement that writes on every replay, interleaved, each on
    keys of its own (a write of one variant's rows would leave the other's reads pages to prune)."""
    store = PostgresStore(dsn, min_size=1, max_size=2)
    await store.open()
    observer = await asyncpg.connect(dsn)
    raw = await asyncpg.connect(dsn)
    try:
        names = {variant: [f"{run}-{variant}-{i}" for i in range(keys)] for variant in ("claim", "claim_locked")}
        for name in names["claim"] + names["claim_locked"]:
            claim = await store.claim(TENANT, name, FINGERPRINT, lease=LEASE, ttl=TTL)
            await store.complete(TENANT, name, claim.fence, RESPONSE)
        locked = await raw.prepare(queries("public")["claim_locked"])

        async def replay_all(variant: str) -> None:
            for name in names[variant]:
                if variant == "claim":
                    replay = await store.claim(TENANT, name, FINGERPRINT, lease=LEASE, ttl=TTL)
                    assert replay.response is not None
                else:
                    row = await locked.fetchrow(TENANT, name, [FINGERPRINT], LEASE, TTL, new_fence(), None)
                    assert row["completed"]

        for variant in names:  # the first read after a write tidies the page (hint bits, pruning): not a replay's
            await replay_all(variant)
        per: dict[str, list[float]] = {variant: [] for variant in names}
        for r in range(rounds):
            for variant in list(names) if r % 2 == 0 else list(names)[::-1]:
                before = await wal_position(observer)
                await replay_all(variant)
                per[variant].append((await wal_position(observer) - before) / keys)
        return {
            "keys": keys,
            "rounds": rounds,
            "wal_bytes_per_replay": {v: statistics.median(x) for v, x in per.items()},
            "each_round": per,
        }
    finally:
        await observer.close()
        await raw.close()
        await store.close()


async def races(dsn: str, tasks: int, keys: int, run: str) -> dict[str, Any]:
    """Every task claims the same key at the same moment, key after key: how many claims needed claim_locked."""
    store = PostgresStore(dsn, min_size=tasks, max_size=tasks + 1)
    await store.open()
    try:
        claims = 0
        for i in range(keys):
            found = await asyncio.gather(
                *(store.claim(TENANT, f"{run}-race-{i}", FINGERPRINT, lease=LEASE, ttl=TTL) for _ in range(tasks))
            )
            claims += len(found)
            owners = [c for c in found if c.fence]
            assert len(owners) == 1, found
            await store.release(TENANT, f"{run}-race-{i}", owners[0].fence)
        return {"claims": claims, "tasks": tasks, "keys": keys, "needed_claim_locked": store.claim_races}
    finally:
        await store.close()


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
        "replays": await replays(dsn, 500, 5, run),
        "races": await races(dsn, tasks, 200, run),
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


# -- rendering (run.py) -----------------------------------------------------------------------------------------

LIMIT = 1.2  # issue 14: the store's client CPU at most 20% above raw prepared asyncpg
WAL_LIMIT = 8.0  # bytes per replay: "about zero" (a write of the row costs a hundred bytes and more)


def targets(result: dict[str, Any]) -> list[Target]:
    wal = result["replays"]["wal_bytes_per_replay"]
    return [
        Target(
            "14.2 client CPU of PostgresStore.claim + complete vs raw prepared asyncpg (in process)",
            f"≤ {LIMIT:.1f}x",
            f"{result['ratio']:.2f}x ({result['us_per_pair']['store']:.0f} vs {result['us_per_pair']['raw']:.0f} µs; "
            f"rounds {result['ratio_min']:.2f}-{result['ratio_max']:.2f}x)",
            result["ratio"] <= LIMIT,
        ),
        Target(
            "14.4 WAL bytes per replay (in process; the previous claim statement side by side)",
            "≈ 0",
            f"{wal['claim']:.1f} (was {wal['claim_locked']:.0f})",
            wal["claim"] <= WAL_LIMIT,
        ),
    ]


def render(result: dict[str, Any]) -> str:
    us = result["us_per_pair"]
    rows = [[v, f"{us[v]:.1f}", f"{us[v] / us['raw']:.2f}x"] for v in VARIANTS]
    rounds = ", ".join(f"{r['store'] / r['raw']:.2f}" for r in result["each_round_us"])
    wal = result["replays"]
    race = result["races"]
    return "\n\n".join(
        [
            "# The store path: PostgresStore against raw asyncpg, in process",
            f"Client CPU (this process's user + system time) per claim+complete pair of a fresh key, "
            f"{result['tasks']} concurrent tasks, uvloop, {result['rounds']} interleaved rounds of "
            f"{result['pairs_per_round']:,} pairs per variant; medians. *raw*: asyncpg with the two statements "
            "prepared once per connection, one connection per task, no deadline; *raw-deadline*: the same with "
            "`command_timeout` (asyncpg's per-statement timer); *store*: `PostgresStore.claim` + `complete` "
            "(its own connections, its deadlines, its error mapping). Both draw a fence and encode the headers.",
            target_table(targets(result)),
            table(["variant", "µs per pair", "vs raw"], rows),
            f"Store / raw per round: {rounds}.",
            "Pieces of the store path, each timed alone (µs per call):",
            table(["piece", "µs"], [[name, f"{v:.2f}"] for name, v in result["components"].items()]),
            f"Replays: {wal['keys']} completed keys per variant, each replayed once per round, {wal['rounds']} "
            "interleaved rounds, after one pass that is not counted (the first read of a page after a write sets "
            "hint bits and prunes dead row versions, which PostgreSQL logs when checksums are on: page upkeep, "
            "once, not a write per replay); WAL bytes per replay from the server's WAL position (everything the "
            "server wrote meanwhile, autovacuum included): the claim as it is "
            f"{wal['wal_bytes_per_replay']['claim']:.1f}, the previous statement (`claim_locked`, which writes the "
            f"row) {wal['wal_bytes_per_replay']['claim_locked']:.0f}.",
            f"Races: {race['tasks']} tasks claiming each of {race['keys']} keys at the same moment "
            f"({race['claims']:,} claims): {race['needed_claim_locked']} needed the second statement "
            f"({race['needed_claim_locked'] / race['claims']:.1%}). With distinct keys (the pairs above) none did.",
        ]
    )
