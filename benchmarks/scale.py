"""Measurement 4: does a request get slower as the table grows? 10⁴, 10⁶ and 10⁷ stored records.

Each size gets its own database on the same server (``bench_scale_<size>``), bulk-loaded with completed records, 24 h
to live (``common.add_records``), and served by its own uvicorn process with idempotency_mw. Then the sizes are
measured interleaved, like the end-to-end variants: each repetition runs every size in turn (odd repetitions in
reverse order), so the drift of a shared machine does not favour the smallest or the largest table. Each turn is a
fresh-key run (new random keys go into the big primary-key index) and a replay run on keys picked uniformly at
random among the stored ones of the load generator's tenant (so the larger the table, the larger and colder the set
of rows a replay may touch). Few connections, so latency is not mostly queueing.

For each run the server's own accounting (``pg_stat_statements``, exact at any moment) gives the database side per
request: execution time, pages read from outside shared_buffers, WAL full-page images.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import asyncpg
import loadgen
from common import (
    REPLAYABLE_EVERY,
    Context,
    Target,
    add_records,
    database_url,
    median,
    per_request,
    ratio,
    server_counters,
    table,
    table_size,
    target_table,
)
from endtoend import check
from servers import Server

from idempotency_mw import PostgresStore

CONNECTIONS = 8
LEVELS = {"quick": [10**4, 10**6, 10**7], "full": [10**4, 10**6, 10**7]}
# Many short runs rather than a few long ones: a level's p50 and p99 are the medians of its runs' own p50s and p99s,
# so a spike of the shared machine in one run (or two, in full mode) moves a level's figure by one rank, not to
# the spike itself.
REPETITIONS = {"quick": 5, "full": 11}
SECONDS = {"quick": 2.5, "full": 8.0}  # per load run
LIMIT = 1.25  # the target: the largest table's p50 and p99 at most 25% above the smallest's
DB_FIELDS = ("exec_ms", "blks_read", "wal_fpi", "wal_bytes")


def database_name(level: int) -> str:
    return f"bench_scale_{level}"


async def _create(url: str, names: list[str]) -> None:
    connection = await asyncpg.connect(url)
    try:
        for name in names:
            await connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            await connection.execute(f'CREATE DATABASE "{name}"')
    finally:
        await connection.close()
    for name in names:
        store = PostgresStore(database_url(url, name), min_size=1, max_size=1)  # open() refuses it unmigrated
        try:
            await store.migrate()
        finally:
            await store.close()


async def _newest_expiry(url: str) -> Any:
    connection = await asyncpg.connect(url)
    try:
        return await connection.fetchval("SELECT max(expires_at) FROM idempotency_records")
    finally:
        await connection.close()


async def _ran_again(url: str, loaded_until: Any) -> list[str]:
    """Stored keys whose record was written anew after the load: a replay that ran the handler instead."""
    connection = await asyncpg.connect(url)
    try:
        rows = await connection.fetch(
            "SELECT key FROM idempotency_records WHERE expires_at > $1 AND key LIKE 'bulk-%' LIMIT 20", loaded_until
        )
        return [row["key"] for row in rows]
    finally:
        await connection.close()


async def _drop(url: str, names: list[str]) -> None:
    connection = await asyncpg.connect(url)
    try:
        for name in names:
            await connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await connection.close()


@contextlib.contextmanager
def databases(url: str, levels: list[int]) -> Iterator[dict[int, str]]:
    """One empty, migrated database per size, dropped afterwards (10⁷ records take 4 GB)."""
    names = [database_name(level) for level in levels]
    asyncio.run(_create(url, names))
    try:
        yield {level: database_url(url, database_name(level)) for level in levels}
    finally:
        asyncio.run(_drop(url, names))


def measure(ctx: Context) -> dict[str, Any]:
    mode = "quick" if ctx.quick else "full"
    levels, repetitions = LEVELS[mode], REPETITIONS[mode]
    seconds = min(ctx.seconds, SECONDS[mode])  # --seconds shortens the runs, never lengthens them
    out: dict[str, Any] = {
        "levels": [],
        "connections": CONNECTIONS,
        "repetitions": repetitions,
        "seconds": seconds,
        "sizes": LEVELS,
        "pooling": "median of the per-run p50s and p99s over the interleaved runs of each level",
    }
    loads: dict[int, dict[str, list[loadgen.Load]]] = {level: {"fresh": [], "replay": []} for level in levels}
    db: dict[int, dict[str, list[dict[str, float]]]] = {level: {"fresh": [], "replay": []} for level in levels}
    invalid: dict[int, list[str]] = {level: [] for level in levels}
    loaded: dict[int, dict[str, float]] = {}
    newest: dict[int, Any] = {}
    tag = uuid.uuid4().hex[:6]
    with databases(ctx.db.url, levels) as urls, contextlib.ExitStack() as stack:
        servers: dict[int, Server] = {}
        for level in levels:
            took = asyncio.run(add_records(urls[level], 0, level, prefix="bulk"))
            rows, size = asyncio.run(table_size(urls[level]))
            loaded[level] = {"rows": rows, "bytes": size, "load_seconds": took}
            newest[level] = asyncio.run(_newest_expiry(urls[level]))
        for level in levels:
            server = servers[level] = stack.enter_context(
                Server(ctx.python, "ours", urls[level], log_name=f"scale-{level}")
            )
            loadgen.run(server.url, mode="fresh", prefix=f"warm-{tag}", connections=CONNECTIONS, seconds=2)
            sample(server, level, 1)
        for rep in range(repetitions):
            for level in levels if rep % 2 == 0 else levels[::-1]:
                server, name = servers[level], database_name(level)
                before = server_counters(ctx.db.url, name)
                fresh = loadgen.run(
                    server.url, mode="fresh", prefix=f"s{rep}-{tag}", connections=CONNECTIONS, seconds=seconds
                )
                middle = server_counters(ctx.db.url, name)
                replay = sample(server, level, seconds)
                after = server_counters(ctx.db.url, name)
                for mode, load, replays, counts in (
                    ("fresh", fresh, False, per_request(before, middle, fresh.requests)),
                    ("replay", replay, True, per_request(middle, after, replay.requests)),
                ):
                    problem = check(load, replays=replays)
                    if problem:
                        invalid[level].append(f"{mode}: {problem}")
                        continue
                    loads[level][mode].append(load)
                    if counts:
                        db[level][mode].append(counts)
        ran_again = {level: asyncio.run(_ran_again(urls[level], newest[level])) for level in levels}
    for level in levels:
        level_out: dict[str, Any] = {
            "records": level,
            **loaded[level],
            "invalid": invalid[level],
            "ran_again": ran_again[level],
        }
        for mode, runs in loads[level].items():
            counted = db[level][mode]
            level_out[mode] = {
                "rps": median(x.rps for x in runs) if runs else None,
                "p50_ms": median(x.p50_ms for x in runs) if runs else None,
                "p99_ms": median(x.p99_ms for x in runs) if runs else None,
                "each_p99_ms": [round(x.p99_ms, 2) for x in runs],
                "each_p50_ms": [round(x.p50_ms, 2) for x in runs],
                "db": {k: median(c[k] for c in counted) for k in counted[0]} if counted else None,
            }
        out["levels"].append(level_out)
    return out


def sample(server: Server, level: int, seconds: float) -> loadgen.Load:
    """Replays of stored keys picked uniformly at random (every ``REPLAYABLE_EVERY``-th record is replayable)."""
    return loadgen.run(
        server.url,
        mode="sample",
        prefix="bulk",
        pool=level // REPLAYABLE_EVERY,
        stride=REPLAYABLE_EVERY,
        connections=CONNECTIONS,
        seconds=seconds,
    )


def worst(result: dict[str, Any]) -> tuple[float, str] | None:
    """The largest latency ratio (p50 or p99, fresh or replay) of any size against the smallest size, and where."""
    base = result["levels"][0]
    found: list[tuple[float, str]] = []
    for level in result["levels"][1:]:
        for mode in ("fresh", "replay"):
            for q in ("p50_ms", "p99_ms"):
                if level[mode][q] and base[mode][q]:
                    found.append((level[mode][q] / base[mode][q], f"{mode} {q[:3]} at {level['records']:,}"))
    return max(found) if found else None


def sizes_note(result: dict[str, Any], mode: str) -> str:
    measured = ", ".join(f"{level['records']:,}" for level in result["levels"])
    sizes = result.get("sizes", LEVELS)
    modes = "; ".join(f"{name} mode: {', '.join(f'{n:,}' for n in levels)}" for name, levels in sizes.items())
    return f"Sizes measured in this ({mode}) run: {measured} records ({modes})."


def targets(result: dict[str, Any]) -> list[Target]:
    w = worst(result)
    sizes = " / ".join(f"{level['records']:.0e}".replace("e+0", "e") for level in result["levels"])
    broken = sum(len(level["invalid"]) for level in result["levels"])
    what = f"4. p50 and p99 flat from the smallest to the largest table ({sizes} records)"
    if w is None:
        return [Target(what, f"≤ {LIMIT:.2f}x", "n/a (no valid runs)", None)]
    note = f", {broken} run(s) did not count" if broken else ""
    return [Target(what, f"≤ {LIMIT:.2f}x", f"worst {w[0]:.2f}x ({w[1]}){note}", w[0] <= LIMIT)]


def render(result: dict[str, Any], ctx: Context) -> str:
    base = result["levels"][0]
    rows = []
    for level in result["levels"]:
        for mode in ("fresh", "replay"):
            entry = level[mode]
            if entry["rps"] is None:
                rows.append([f"{level['records']:,}", mode, "invalid", *[""] * 10])
                continue
            d = entry.get("db") or {}
            rows.append(
                [
                    f"{level['records']:,}",
                    mode,
                    f"{entry['rps']:.0f}",
                    f"{entry['p50_ms']:.2f}",
                    ratio(entry["p50_ms"], base[mode]["p50_ms"]),
                    f"{entry['p99_ms']:.2f}",
                    ratio(entry["p99_ms"], base[mode]["p99_ms"]),
                    ", ".join(f"{x:.2f}" for x in entry["each_p99_ms"]),
                    f"{d['exec_ms'] * 1000:.0f}" if d else "-",
                    f"{d['blks_read']:.2f}" if d else "-",
                    f"{d['wal_fpi']:.2f}" if d else "-",
                    f"{d['wal_bytes']:.0f}" if d and "wal_bytes" in d else "-",
                    f"{level['bytes'] / 2**20:,.0f} MiB, loaded in {level['load_seconds']:.0f} s",
                ]
            )
    problems = [f"- {level['records']:,}: {p}" for level in result["levels"] for p in level["invalid"]]
    problems += [
        f"- {level['records']:,}: stored keys whose record was written anew (the handler ran instead of a replay): "
        + ", ".join(level["ran_again"])
        for level in result["levels"]
        if level.get("ran_again")
    ]
    return "\n\n".join(
        [
            "# Scale: latency against the number of stored records",
            f"{sizes_note(result, 'quick' if ctx.quick else 'full')} Each size in its own database on the same "
            f"server, with its own uvicorn process (idempotency_mw, PostgresStore); wrk with {result['connections']} "
            f"connections, {result['seconds']:g} s per run, {result['repetitions']} repetitions, each running "
            "every size in turn (odd ones in reverse order), a fresh-key run then a replay run per turn. A size's "
            "p50 and p99 are the medians of its runs' own p50s and p99s (wrk's percentiles of each run): one run "
            "with a spike of the shared machine moves them by one rank, not to the spike. "
            "Replays pick a stored key of the load generator's tenant uniformly at random (1 in 100 stored "
            "records), fresh requests insert new random keys.",
            target_table(targets(result)),
            table(
                [
                    "stored records",
                    "traffic",
                    "requests/s",
                    "p50 ms",
                    "p50 vs smallest",
                    "p99 ms",
                    "p99 vs smallest",
                    "each run's p99",
                    "db µs/req",
                    "pages read/req",
                    "WAL full pages/req",
                    "WAL bytes/req",
                    "table + indexes",
                ],
                rows,
            ),
            "Database columns, per request, from `pg_stat_statements` for that size's database: statement execution "
            "time, shared-buffer misses (pages read from the OS), pages written whole to the WAL (the first "
            "change of a page after a checkpoint), and WAL bytes (a replay writes none).",
            *(["Runs that did not count, and stored keys that did not replay:", *problems] if problems else []),
        ]
    )
