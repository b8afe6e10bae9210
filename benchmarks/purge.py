"""Measurement 5: garbage collection under traffic. Purge expired records in batches while requests keep coming.

Four rounds, each on 1,000,000 freshly bulk-loaded expired rows (both modes; the quick mode only shortens the
quiet runs), two on each shape of the schema: as this release's migrate leaves it (the foreign keys to the
records still there, for the previous release running beside it, each checked for every deleted record) and with
the contract step applied (``sql/contract/``, which the next release runs as a migration). In each, the purge loop
``idempotency-mw gc`` runs (``PostgresStore.purge_expired(batch_size=1000)`` until a batch comes back empty, one
connection, in this process), first back to back, then paced with a pause between batches (``gc --pause``). A
server with idempotency_mw takes fresh-key traffic throughout: quiet before, during the purge, quiet after. The
load run during the purge starts a moment before it (wrk must have its connections open) and is stopped as soon as
the purge ends; the share of that window the purge covered is reported. The purge rate is records per second of
the whole purge; the p99 during the purge is compared with the mean of the two quiet p99s around it. CPU time of
each part (server, PostgreSQL, the purge loop, wrk) is read around every run, to tell waiting on locks from
waiting for a core.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import asyncpg
import loadgen
from common import Context, Target, add_records, ratio, reset, table, target_table, wal_position
from endtoend import check
from servers import CpuMeter, Server

from idempotency_mw import PostgresStore
from idempotency_mw.postgres._sql import contract_statements

CONNECTIONS = 8
BATCH = 1000
PURGE_LIMIT_SECONDS = 900
RECORDS = 1_000_000
PAUSES = (0.0, 0.01)  # seconds between batches: back to back, then paced
SHAPES = ("as migrated", "contracted")  # the foreign keys still there; dropped by the contract step
LIMIT = 2.0  # the target: p99 during the purge at most twice the quiet p99
LEAD_IN = 0.2  # seconds between starting wrk and starting the purge
SETTLE = 3  # seconds of unmeasured traffic between the bulk load and the first quiet run


async def purge_all(url: str, pause: float) -> tuple[int, int, float]:
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
            if pause:
                await asyncio.sleep(pause)
        return records, batches, time.perf_counter() - started


def own_cpu() -> float:
    times = os.times()
    return times.user + times.system


async def foreign_keys(url: str) -> list[tuple[str, str, str]]:
    """(table, name, definition) of the foreign keys to the records, to put back after the contracted rounds."""
    connection = await asyncpg.connect(url)
    try:
        rows = await connection.fetch(
            "SELECT conrelid::regclass::text AS table_name, conname, pg_get_constraintdef(oid) AS definition "
            "FROM pg_constraint WHERE contype = 'f' AND confrelid = 'idempotency_records'::regclass"
        )
        return [(row["table_name"], row["conname"], row["definition"]) for row in rows]
    finally:
        await connection.close()


async def run_all(url: str, statements: list[str]) -> None:
    connection = await asyncpg.connect(url)
    try:
        for statement in statements:
            await connection.execute(statement)
    finally:
        await connection.close()


def measure_round(ctx: Context, server: Server, shape: str, pause: float, tag: str) -> dict[str, Any]:
    reset(ctx.db.url)
    load_seconds = asyncio.run(add_records(ctx.db.url, 0, RECORDS, prefix="expired", expired=True))
    meter = CpuMeter(server.pid, ctx.db.postmaster_pid)
    loads: dict[str, loadgen.Load] = {}
    cpu: dict[str, dict[str, float | None]] = {}
    wal_mib: dict[str, float] = {}

    def timed(name: str, run: Callable[[], loadgen.Load]) -> None:
        before, mine, wal = meter.read(), own_cpu(), wal_position(ctx.db.url)
        loads[name] = run()
        after = meter.read()
        seconds = loads[name].seconds
        wal_mib[name] = (wal_position(ctx.db.url) - wal) / 2**20 / seconds
        used = CpuMeter.per_request(before, after, 1)  # microseconds in all
        cpu[name] = {part: None if us is None else us / 1e6 / seconds for part, us in used.items()}
        cpu[name]["purge"] = (own_cpu() - mine) / seconds

    def quiet(prefix: str) -> loadgen.Load:
        return loadgen.run(server.url, mode="fresh", prefix=prefix, connections=CONNECTIONS, seconds=ctx.seconds)

    purge: tuple[int, int, float] = (0, 0, 0.0)

    def during() -> loadgen.Load:
        nonlocal purge
        background = loadgen.Background(
            server.url, mode="fresh", prefix=f"gc-{tag}", connections=CONNECTIONS, limit=PURGE_LIMIT_SECONDS + 60
        ).start()
        try:
            time.sleep(LEAD_IN)  # wrk has its connections open
            purge = asyncio.run(purge_all(ctx.db.url, pause))
        finally:
            load = background.stop()
        return load

    # Settle first: right after a bulk load (and its checkpoint) the first requests run slower than later ones
    # (seen as a "quiet before" p99 well above "quiet after"), which would flatter the ratio. Not measured.
    loadgen.run(server.url, mode="fresh", prefix=f"settle-{tag}", connections=CONNECTIONS, seconds=SETTLE)
    timed("quiet before", lambda: quiet(f"qb-{tag}"))
    timed("during purge", during)
    timed("quiet after", lambda: quiet(f"qa-{tag}"))
    purged, batches, seconds = purge
    return {
        "shape": shape,
        "pause": pause,
        "records": RECORDS,
        "load_seconds": load_seconds,
        "purged": purged,
        "batches": batches,
        "purge_seconds": seconds,
        "loads": {name: {**load.as_dict(), "invalid": check(load, replays=False)} for name, load in loads.items()},
        "cores": cpu,
        "wal_mib_per_s": wal_mib,
    }


def measure(ctx: Context) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:6]
    rounds = []
    reset(ctx.db.url)
    with Server(ctx.python, "ours", ctx.db.url, log_name="purge") as server:
        loadgen.run(server.url, mode="fresh", prefix=f"warm-{tag}", connections=CONNECTIONS, seconds=2)
        kept = asyncio.run(foreign_keys(ctx.db.url))
        try:
            for shape in SHAPES:
                if shape == "contracted":
                    asyncio.run(run_all(ctx.db.url, contract_statements()))
                for pause in PAUSES:
                    rounds.append(measure_round(ctx, server, shape, pause, f"{tag}-{len(rounds)}"))
        finally:  # the schema as migrate left it, for the measurements that follow (the tables are emptied first)
            reset(ctx.db.url)
            asyncio.run(run_all(ctx.db.url, [f"ALTER TABLE {t} DROP CONSTRAINT IF EXISTS {n}" for t, n, _ in kept]))
            asyncio.run(run_all(ctx.db.url, [f"ALTER TABLE {t} ADD CONSTRAINT {n} {d}" for t, n, d in kept]))
    return {"connections": CONNECTIONS, "seconds": ctx.seconds, "rounds": rounds}


def p99_ratio(round_: dict[str, Any]) -> float:
    loads = round_["loads"]
    quiet = (loads["quiet before"]["p99_ms"] + loads["quiet after"]["p99_ms"]) / 2
    return float(loads["during purge"]["p99_ms"] / quiet)


def describe(round_: dict[str, Any]) -> str:
    pace = "back to back" if not round_["pause"] else f"paced, {round_['pause'] * 1000:g} ms between batches"
    return f"{round_.get('shape', 'as migrated')}, {pace}"


def judged(round_: dict[str, Any]) -> bool:
    """Whether a round's p99 is a target: on the schema this release's migrate leaves (the contracted rounds show
    what the next release's migration brings, and are reported beside them)."""
    return bool(round_.get("shape", "as migrated") == "as migrated")


def targets(result: dict[str, Any]) -> list[Target]:
    found = []
    for round_ in filter(judged, result["rounds"]):
        rate = round_["purged"] / round_["purge_seconds"] if round_["purge_seconds"] else 0.0
        what = (
            f"5. p99 of live requests while purging {round_['records']:,} expired records, {describe(round_)} "
            f"({rate:,.0f} records/s)"
        )
        broken = [f"{name}: {load['invalid']}" for name, load in round_["loads"].items() if load["invalid"]]
        if broken:
            found.append(Target(what, f"≤ {LIMIT:g}x quiet", "n/a, runs did not count: " + "; ".join(broken), None))
        elif round_["purged"] < round_["records"]:
            note = f"n/a: purged only {round_['purged']:,} of {round_['records']:,} in {PURGE_LIMIT_SECONDS} s"
            found.append(Target(what, f"≤ {LIMIT:g}x quiet", note, None))
        else:
            r = p99_ratio(round_)
            found.append(Target(what, f"≤ {LIMIT:g}x quiet", f"{r:.2f}x", r <= LIMIT))
    return found


def render(result: dict[str, Any], ctx: Context) -> str:
    def cores(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    purges, rows = [], []
    for round_ in result["rounds"]:
        loads = round_["loads"]
        quiet_p99 = (loads["quiet before"]["p99_ms"] + loads["quiet after"]["p99_ms"]) / 2
        quiet_p50 = (loads["quiet before"]["p50_ms"] + loads["quiet after"]["p50_ms"]) / 2
        rate = round_["purged"] / round_["purge_seconds"] if round_["purge_seconds"] else 0.0
        window = loads["during purge"]["seconds"]
        purges.append(
            [
                describe(round_),
                f"{round_['purged']:,}",
                round_["batches"],
                f"{round_['purge_seconds']:.1f}",
                f"{rate:,.0f}",
                f"{round_['purge_seconds'] / window:.0%} of {window:.1f} s",
                f"{round_['load_seconds']:.0f} s",
            ]
        )
        for name, load in loads.items():
            c = round_["cores"][name]
            known = [c[part] for part in ("app", "postgres", "purge", "client")]
            rows.append(
                [
                    describe(round_),
                    name,
                    f"{load['rps']:.0f}",
                    f"{load['p50_ms']:.2f}",
                    ratio(load["p50_ms"], quiet_p50),
                    f"{load['p99_ms']:.2f}",
                    ratio(load["p99_ms"], quiet_p99),
                    f"{load['max_ms']:.1f}",
                    *(cores(x) for x in known),
                    cores(sum(x for x in known if x is not None)),
                    f"{round_['wal_mib_per_s'][name]:.1f}",
                    load["invalid"] or "ok",
                ]
            )
    return "\n\n".join(
        [
            "# Garbage collection under traffic",
            f"Each round: {RECORDS:,} expired records bulk-loaded, then `PostgresStore.purge_expired("
            f"batch_size={BATCH})` called on one connection until a batch came back empty (back to back, then with "
            f"a pause between batches, as `idempotency-mw gc --pause` does), on the schema as this release's "
            f"migrate leaves it (the foreign keys to the records still there, for the previous release running "
            f"beside it) and with the contract step applied (`sql/contract/`, a migration of the next release), "
            f"while wrk sent fresh-key requests "
            f"({result['connections']} connections) to a server with idempotency_mw. wrk starts {LEAD_IN} s before "
            f"the purge and stops when it ends; quiet runs of {result['seconds']:.0f} s before and after bracket it "
            f"(the one before follows {SETTLE} s of unmeasured traffic after the bulk load).",
            target_table(targets(result)),
            "After the contract step (not a target of this release: its migration ships with the next one): "
            + "; ".join(
                f"{describe(r)}, {r['purged'] / r['purge_seconds']:,.0f} records/s, p99 {p99_ratio(r):.2f}x quiet"
                for r in result["rounds"]
                if not judged(r) and r["purge_seconds"]
            )
            + ".",
            table(
                ["purge", "purged", "batches", "seconds", "records/s", "purge's share of the load window", "loaded in"],
                purges,
            ),
            table(
                [
                    "purge",
                    "traffic",
                    "requests/s",
                    "p50 ms",
                    "p50 vs quiet",
                    "p99 ms",
                    "p99 vs quiet",
                    "max ms",
                    "cores: server",
                    "postgres",
                    "purge loop",
                    "wrk",
                    "total",
                    "WAL MiB/s",
                    "answers",
                ],
                rows,
            ),
            "Cores: CPU seconds each part used per second of the run (this machine has "
            f"{os.cpu_count()}, shared with other work); the purge loop is the Python side only, its statements "
            "run in PostgreSQL. WAL MiB/s: write-ahead log the server generated per second of the run (every "
            "request's commit waits for the WAL to be flushed up to its own record).",
        ]
    )
