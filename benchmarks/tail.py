"""What a transactional request's COMMIT carries after it, priced on the server: the lent connection's reset and the
waiters' notice, statement by statement.

A transactional request gives its connection back clean (``sql/reset_session.sql``) and tells other processes'
waiters that it committed (``notify_waiters``), in the COMMIT's own message (``_lending.py``): no round trip of
their own, but server time on every request, which the hand-written app does not spend. This prices each part, and
the whole tail as it was and as it is, on one connection of the store's kind (READ COMMITTED pinned, the tables
migrated). Each part is sent 50 times in one simple query, so the round trip is shared and what is timed is the
server's work (and the protocol's per statement); 10 messages a round, the parts interleaved, the median of the
rounds. ``SELECT 1`` is the floor every statement pays.

    .venv/bin/python benchmarks/tail.py [--rounds 9] [--no-write]

It starts the embedded PostgreSQL (``pgserver.py``; ``DATABASE_URL`` wins) and writes ``results/tail.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import Target, load_average, publish, table, target_table
from pgserver import database, server_version

from idempotency_mw import PostgresStore
from idempotency_mw.postgres._records import Records
from idempotency_mw.postgres._sql import reset_session, session

COPIES, MESSAGES = 50, 10
TENANT, KEY, FENCE = "tenant-tail", "key-tail", 4242  # no such record: the notice reads the primary key and finds none


FLOOR = "SELECT 1 (the floor)"
BEFORE = "the tail before (reset, deallocation, notice written in)"
NOW = "the tail now (reset, notice by name)"


def parts_names() -> tuple[str, ...]:
    """The parts :func:`parts` prices, in its order."""
    return (
        FLOOR,
        "the reset, without the deallocation",
        "the deallocation of SQL-level prepared statements",
        "the waiters' notice, its values written in",
        "the waiters' notice, prepared and run by name",
        BEFORE,
        NOW,
    )


def parts(records: Records, prepared: str) -> dict[str, str]:
    """Each statement (or group) of the tail, as the COMMIT's message carries it."""
    reset = reset_session()
    written_in, by_name = records.notice(TENANT, KEY, FENCE), records.notice(TENANT, KEY, FENCE, prepared)
    sql = (
        "SELECT 1;",
        reset["reset"],
        reset["deallocate"],
        written_in,
        by_name,
        "\n".join((reset["reset"], reset["deallocate"], written_in)),
        "\n".join((reset["reset"], by_name)),
    )
    return dict(zip(parts_names(), sql, strict=True))


async def measure(url: str, rounds: int) -> dict[str, Any]:
    store = PostgresStore(url)
    await store.migrate()
    async with store:
        records: Records = store._records
    connection = await asyncpg.connect(url)
    try:
        await connection.fetchval(session()["pin_read_committed"])
        statement = await connection.prepare(records.sql["notify_waiters"])
        await statement.fetchrow("", "", 0)
        found = parts(records, statement.get_name())
        times: dict[str, list[float]] = {name: [] for name in found}
        for sql in found.values():  # warm-up: plans, catalog caches
            await connection.execute("\n".join([sql] * COPIES))
        for _ in range(rounds):
            for name, sql in found.items():
                message = "\n".join([sql] * COPIES)
                started = time.perf_counter()
                for _ in range(MESSAGES):
                    await connection.execute(message)
                times[name].append((time.perf_counter() - started) / (COPIES * MESSAGES) * 1e6)
        version = await server_version(connection)
    finally:
        await connection.close()
    us = {name: statistics.median(values) for name, values in times.items()}
    return {"rounds": rounds, "us": us, "spread": {n: (min(v), max(v)) for n, v in times.items()}, "postgres": version}


def render(result: dict[str, Any]) -> tuple[str, list[Target]]:
    us = result["us"]
    floor, before, now = us[FLOOR], us[BEFORE], us[NOW]
    targets = [
        Target(
            "server time of a transactional COMMIT's tail, now / before (reset and waiters' notice)",
            "≤ 0.5x",
            f"{now / before:.2f}x ({now:.0f} against {before:.0f} µs)",
            now / before <= 0.5,
        )
    ]
    rows = []
    for name, value in us.items():
        low, high = result["spread"][name]
        rows.append(
            [name, f"{value:.1f}", f"{low:.1f} … {high:.1f}", "" if value == floor else f"+{value - floor:.1f}"]
        )
    markdown = "\n\n".join(
        [
            "# The tail of a transactional COMMIT, on the server",
            __doc__.split("\n\n")[1].replace("\n", " "),
            target_table(targets),
            table(["part", "µs", "rounds' range", "over SELECT 1"], rows),
            f"{result['rounds']} rounds of {MESSAGES} messages of {COPIES} copies each; µs per copy, the median of "
            "the rounds. The deallocation runs only after a loan whose SQL said PREPARE (or one the store cannot "
            "see, SQLAlchemy's); the notice is prepared on the store's own connections (elsewhere it is written "
            "in).",
        ]
    )
    return markdown, targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    began, load_before = time.time(), load_average()
    with database() as db:
        result = asyncio.run(measure(db.url, args.rounds))
    markdown, targets = render(result)
    if args.no_write:
        print(markdown)
        return
    path = publish(
        "tail",
        markdown,
        result,
        targets,
        began=began,
        mode="full",
        postgres=result["postgres"],
        database="embedded, shared_buffers=1GB, pg_stat_statements" if db.embedded else "DATABASE_URL",
        load_before=load_before,
        versions={},
        seconds=0.0,
    )
    print(f"written to {path}")


if __name__ == "__main__":
    main()
