"""What a step costs (docs/design.md §10): round trips, commits and WAL per request, counted by the server.

``python benchmarks/steps.py [-n 200]`` starts the embedded PostgreSQL with ``pg_stat_statements`` (``pgserver.py``;
``DATABASE_URL`` wins if set, and then round trips are counted only if it preloads the extension), drives an app in
process (httpx's ASGI transport), one request at a time, and prints a markdown table. Each scenario sends ``n``
requests with fresh keys after a warm-up and reads back what the server counted:

- round trips: the statements ``pg_stat_statements`` recorded (utility ones included: BEGIN, COMMIT), with the reset
  of a connection coming back from its loan counted once (it is one message);
- commits: ``pg_stat_database.xact_commit`` of the database: every transaction, read-only ones and the reset's
  implicit one included (the claim's commit does not wait for its WAL flush in transactional mode);
- WAL: ``pg_current_wal_lsn()`` before and after, in bytes.

Scenarios: a transactional request whose handler inserts one row (the baseline); the same with one local step;
two local steps around an outside step (the provider is an in-process function); and the same with the outside step
declared ``repeatable=False``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pgserver import database, has_statement_stats, statement_counts
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idempotency_mw import IdempotencyMiddleware, PostgresStore, idempotency_context

os.environ.setdefault("IDEMPOTENCY_TENANT_SECRET", "benchmark-tenant-secret-0123456789abcdef")
# A lent connection's reset (sql/reset_session.sql, its pool's state again, and the waiters' notice) rides in the
# round trip of the transaction's COMMIT, in one simple-query message: every statement of it is in that round trip.
RESET_TAIL = ("SET SESSION AUTHORIZATION DEFAULT", "RESET ALL", "CLOSE ALL", "UNLISTEN *",
              "SELECT pg_advisory_unlock_all()", "DISCARD", "DO $$", "SELECT set_config($1, $2, $3)",
              "SELECT pg_catalog.pg_notify(", "EXECUTE")  # fmt: skip
Handler = Callable[[Request], Awaitable[Response]]


def handlers() -> dict[str, Handler]:
    async def insert(request: Request, note: str) -> int:
        context = idempotency_context(request)
        assert context is not None
        assert context.connection is not None
        value: int = await context.connection.fetchval("INSERT INTO bench_steps (note) VALUES ($1) RETURNING id", note)
        return value

    async def provider(downstream_key: str) -> dict[str, Any]:
        return {"id": "ch_" + downstream_key[:8]}

    async def one_row(request: Request) -> Response:
        return JSONResponse({"id": await insert(request, "one")}, status_code=201)

    async def one_step(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None

        async def create() -> dict[str, Any]:
            return {"id": await insert(request, "one")}

        return JSONResponse(await context.steps.local("create", create), status_code=201)

    def around_outside(repeatable: bool) -> Handler:
        async def handler(request: Request) -> Response:
            context = idempotency_context(request)
            assert context is not None
            steps = context.steps

            async def create() -> dict[str, Any]:
                return {"id": await insert(request, "created")}

            async def record() -> dict[str, Any]:
                return {"recorded": await insert(request, "recorded")}

            created = await steps.local("create", create)
            paid = await steps.outside("provider", provider, repeatable=repeatable)
            recorded = await steps.local("record", record)
            return JSONResponse({**created, **paid, **recorded}, status_code=201)

        return handler

    return {
        "transactional, one INSERT (baseline)": one_row,
        "one local step (the same INSERT)": one_step,
        "local, outside, local": around_outside(True),
        "local, outside (repeatable=False), local": around_outside(False),
    }


async def measure(url: str, n: int) -> list[tuple[str, float | None, float, float]]:
    admin = await asyncpg.connect(url)
    counting = await has_statement_stats(admin)
    await admin.execute("CREATE TABLE IF NOT EXISTS bench_steps (id bigserial PRIMARY KEY, note text)")
    store = PostgresStore(url, max_size=4)
    await store.migrate()
    await store.open()
    found = []
    try:
        for name, handler in handlers().items():
            app = Starlette(routes=[Route("/r", handler, methods=["POST"])])
            app.add_middleware(IdempotencyMiddleware, store=store, transactional=True)
            transport = httpx.ASGITransport(app=app)
            headers = {"authorization": "Bearer bench-token"}
            async with httpx.AsyncClient(transport=transport, base_url="http://bench", headers=headers) as client:

                async def send(count: int, client: httpx.AsyncClient = client) -> None:
                    for _ in range(count):
                        answer = await client.post("/r", headers={"idempotency-key": str(uuid.uuid4())})
                        assert answer.status_code == 201, answer.text

                await send(20)  # every statement prepared on every pooled connection
                await store.close()  # the backends' statistics are flushed as they exit
                await store.open()
                await send(4)
                if counting:
                    await admin.execute("SELECT pg_stat_statements_reset()")
                commits_before, lsn_before = await _commits_and_lsn(admin)
                await send(n)
                await store.close()
                await store.open()
                commits_after, lsn_after = await _commits_and_lsn(admin)
                trips = None
                if counting:
                    counts = await statement_counts(admin)
                    total = sum(calls for query, calls in counts.items() if "pg_stat_database" not in query)
                    total -= sum(calls for query, calls in counts.items() if query.startswith(RESET_TAIL))
                    trips = total / n
                # the admin connection's own two reads are transactions too
                found.append((name, trips, (commits_after - commits_before - 2) / n, (lsn_after - lsn_before) / n))
    finally:
        await store.close()
        await admin.close()
    return found


async def _commits_and_lsn(admin: asyncpg.Connection) -> tuple[int, int]:
    await admin.execute("SELECT pg_stat_clear_snapshot()")
    commits = await admin.fetchval("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
    lsn = await admin.fetchval("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")
    return int(commits), int(lsn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=200, help="requests per scenario (default: 200)")
    args = parser.parse_args()
    with database() as db:
        rows = asyncio.run(measure(db.url, args.n))
    print(f"| scenario ({args.n} requests each) | round trips | commits | WAL bytes |")
    print("|---|---|---|---|")
    for name, trips, commits, wal in rows:
        print(f"| {name} | {'-' if trips is None else f'{trips:.1f}'} | {commits:.2f} | {wal:,.0f} |")


if __name__ == "__main__":
    main()
