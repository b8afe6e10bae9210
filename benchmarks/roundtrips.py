"""Measurement 1: statements and round trips per request, counted by the server (``pg_stat_statements``).

Run by ``run.py`` once per variant, in the benchmark venv (where the peers are installed):
``python roundtrips.py --dsn URL --variant ours``. It drives the app in process (httpx's ASGI transport, no
sockets), one request at a time, and prints JSON. Each scenario resets the server's statement statistics, sends
``n`` requests, and reads the statistics back, so the counts are what the server executed for those requests.

Round trips are counted from the statements: every statement is one client-server exchange, except that asyncpg's
pool sends its connection reset (``SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL``) as one
simple-query message, so those four count as one round trip. ``pg_stat_statements`` only records statements that
completed, so failed ones (a unique violation a peer catches) are counted from the ``ERROR:`` lines of the server's
log when its path is given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import httpx
from benchapp import build
from common import Target, table, target_table
from pgserver import Database, ErrorLog, has_statement_stats, statement_counts

# The tail of asyncpg's pool reset message: sent together with SELECT pg_advisory_unlock_all(), one round trip.
SAME_MESSAGE_AS_RESET = ("CLOSE ALL", "UNLISTEN *", "RESET ALL")
BODY = {"amount": 1250, "currency": "eur", "customer": "cus_42"}
OTHER_BODY = {"amount": 9999, "currency": "eur", "customer": "cus_42"}
REPLAY_HEADERS = ("idempotent-replayed", "x-idempotent-replayed")
HEADERS = {"authorization": "Bearer bench-token"}


def summarise(counts: dict[str, int], failed: int | None, n: int, statuses: list[str]) -> dict[str, Any]:
    total = sum(counts.values()) + (failed or 0)
    batched = sum(calls for query, calls in counts.items() if query in SAME_MESSAGE_AS_RESET)
    return {
        "statements": total / n,
        "round_trips": (total - batched) / n,
        "failed": None if failed is None else failed / n,
        "pool_resets": counts.get("SELECT pg_advisory_unlock_all()", 0) / n,
        "by_statement": {query: calls / n for query, calls in sorted(counts.items(), key=lambda kv: -kv[1])},
        "answers": sorted(set(statuses)),
    }


async def main(dsn: str, variant: str, n: int, log_path: str | None) -> dict[str, Any]:
    db = Database(dsn, embedded=False, settings={})
    gate = asyncio.Event()
    app, startup, shutdown = build(variant, db, gate)
    await startup()
    admin = await asyncpg.connect(dsn)
    if not await has_statement_stats(admin):
        raise SystemExit("pg_stat_statements is not loaded on this server (shared_preload_libraries)")
    results: dict[str, Any] = {}
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://bench", timeout=30) as client:

            async def post(path: str, key: str, body: dict[str, Any] = BODY) -> str:
                response = await client.post(path, json=body, headers={**HEADERS, "idempotency-key": key})
                replayed = any(response.headers.get(name) == "true" for name in REPLAY_HEADERS)
                return f"{response.status_code}{' replayed' if replayed else ''}"

            async def measured(name: str, scenario: Callable[[], Awaitable[list[str]]]) -> None:
                await admin.execute("SELECT pg_stat_statements_reset()")
                errors = ErrorLog(log_path)
                statuses = await scenario()
                await asyncio.sleep(0.2)  # let the server's log writes land
                results[name] = summarise(await statement_counts(admin), errors.count(), n, statuses)

            # Warm-up: every statement prepared on every pooled connection, first-request work (schema scans,
            # a peer's periodic cleanup) done before anything is counted.
            warm = [f"warm-{uuid.uuid4()}" for _ in range(6)]
            for key in warm:
                await post("/orders", key)
            for key in warm:
                await post("/orders", key)
                await post("/orders", key, OTHER_BODY)
            await conflicts(post, 2, gate)

            keys = [f"key-{uuid.uuid4()}" for _ in range(n)]

            async def fresh() -> list[str]:
                return [await post("/orders", key) for key in keys]

            async def replay() -> list[str]:
                return [await post("/orders", key) for key in keys]

            async def mismatch() -> list[str]:
                return [await post("/orders", key, OTHER_BODY) for key in keys]

            await measured("fresh", fresh)
            await measured("replay", replay)
            await measured("mismatch", mismatch)
            held, first = await hold(post, gate)
            await measured("conflict", lambda: duplicates(post, first, n))
            gate.set()
            await held
    finally:
        await admin.close()
        await shutdown()
    return results


async def hold(post: Callable[..., Awaitable[str]], gate: asyncio.Event) -> tuple[asyncio.Task[str], str]:
    """Start a request on ``/slow`` that stays in its handler until ``gate`` is set."""
    gate.clear()
    key = f"held-{uuid.uuid4()}"
    task = asyncio.ensure_future(post("/slow", key))
    await asyncio.sleep(0.3)  # in process, it reaches the handler within a few milliseconds
    return task, key


async def duplicates(post: Callable[..., Awaitable[str]], key: str, n: int) -> list[str]:
    return [await post("/slow", key) for _ in range(n)]


async def conflicts(post: Callable[..., Awaitable[str]], n: int, gate: asyncio.Event) -> list[str]:
    task, key = await hold(post, gate)
    statuses = await duplicates(post, key, n)
    gate.set()
    await task
    return statuses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--variant", required=True)
    parser.add_argument("--log", help="the server's log file, to count failed statements")
    parser.add_argument("-n", type=int, default=20)
    args = parser.parse_args()
    json.dump(asyncio.run(main(args.dsn, args.variant, args.n, args.log)), sys.stdout)


# -- rendering (run.py) -----------------------------------------------------------------------------------------

SCENARIOS = {
    "fresh": "fresh key",
    "replay": "replay",
    "conflict": "in-progress conflict (409)",
    "mismatch": "key reused with another body (422)",
}
TARGET = {"fresh": 2, "replay": 1, "conflict": 1, "mismatch": 1}
LABELS = {
    "ours": "idempotency_mw (defaults)",
    "fastidempotent": "fastidempotent",
    "fastapi-idempotency": "fastapi-idempotency",
}


def targets(results: dict[str, Any], problems: dict[str, str]) -> list[Target]:
    what = "1. round trips per request: fresh / replay / conflict / mismatch (counted by the server)"
    goal = " / ".join(str(t) for t in TARGET.values())
    ours = results.get("ours")
    if not ours:
        return [Target(what, goal, f"n/a: {problems.get('ours', 'not measured')}", None)]
    trips = [ours[scenario]["round_trips"] for scenario in TARGET]
    return [
        Target(
            what,
            goal,
            " / ".join(f"{t:g}" for t in trips),
            all(t == want for t, want in zip(trips, TARGET.values(), strict=True)),
        )
    ]


def _short(query: str) -> str:
    text = " ".join(query.split())
    return text if len(text) <= 70 else text[:67] + "…"


def render(results: dict[str, Any], problems: dict[str, str], n: int) -> str:
    variants = [v for v in LABELS if v in results or v in problems]
    rows = []
    for scenario, label in SCENARIOS.items():
        row = [label, str(TARGET[scenario])]
        for variant in variants:
            if variant in problems:
                row.append("could not run")
                continue
            entry = results[variant][scenario]
            failed = f", {entry['failed']:g} failed" if entry.get("failed") else ""
            row.append(f"**{entry['round_trips']:g}** ({entry['statements']:g} statements{failed})")
        rows.append(row)
    details = []
    for variant in variants:
        if variant in problems:
            details.append(f"- **{LABELS[variant]}** could not run: {problems[variant]}")
            continue
        for scenario in ("fresh", "replay"):
            entry = results[variant][scenario]
            listed = "; ".join(f"{calls:g}x `{_short(q)}`" for q, calls in entry["by_statement"].items())
            failed = f"; {entry['failed']:g}x a statement that failed (server log)" if entry.get("failed") else ""
            details.append(f"- **{LABELS[variant]}**, {scenario} (answered {entry['answers']}): {listed}{failed}")
    return "\n\n".join(
        [
            "# Round trips per request, counted by the server",
            f"Each scenario: `pg_stat_statements` reset, {n} requests sent one at a time through the app in "
            "process (httpx ASGI transport), statistics read back, divided by the number of requests. Round "
            "trips = statements, except that asyncpg's pool reset on releasing a connection (`SELECT "
            "pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL`) is one message and counts once. "
            "Statements that failed (fastapi-idempotency's INSERT on an existing key) are not in "
            "`pg_stat_statements`; they are counted from the server log's `ERROR:` lines.",
            target_table(targets(results, problems)),
            table(["scenario", "target", *(LABELS[v] for v in variants)], rows),
            "What each request ran (per request):",
            "\n".join(details),
        ]
    )
