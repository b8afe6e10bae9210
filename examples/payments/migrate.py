"""``python -m examples.payments.migrate``: create or upgrade the example's tables on ``$DATABASE_URL``, then exit.

Two steps, each safe to repeat and to run from several processes at once: the library's idempotency table
(``PostgresStore.migrate``), then the payments schema (``schema.sql``). docker-compose.yml runs this once, as the
role that owns the schema, before the app starts as a role that may only read and write rows. ``create_app``
runs the same steps at startup unless told not to (``migrate=False``, or ``PAYMENTS_MIGRATE=0``).
"""

from __future__ import annotations

import asyncio
import os
import sys

import asyncpg

from examples.payments import ledger
from idempotency_mw import PostgresStore
from idempotency_mw.postgres import postgres_url


async def apply_migrations(store: PostgresStore, pool: asyncpg.Pool) -> list[str]:
    """The idempotency migrations this database lacks (their names are returned), then the payments schema."""
    applied = await store.migrate()
    await ledger.apply_schema(pool)
    return applied


STATEMENT_TIMEOUT = 30.0  # seconds for connecting and for each statement; DDL may wait for a lock a while


async def migrate(dsn: str) -> list[str]:
    dsn = postgres_url(dsn)  # asyncpg's pool takes no postgresql+asyncpg://
    store = PostgresStore(dsn, min_size=1, max_size=1, timeout=STATEMENT_TIMEOUT)  # not opened: open() wants tables
    try:
        async with asyncpg.create_pool(dsn, min_size=1, max_size=1, timeout=STATEMENT_TIMEOUT) as pool:
            return await apply_migrations(store, pool)
    finally:
        await store.close()


def main() -> int:
    dsn = os.environ.get("DATABASE_URL")
    if not dsn:
        print(
            "migrate: set DATABASE_URL to the PostgreSQL to migrate (as the role that owns the schema)", file=sys.stderr
        )
        return 2
    applied = asyncio.run(migrate(dsn))
    print(f"idempotency tables: {'applied ' + ', '.join(applied) if applied else 'up to date'}")
    print("payments schema: up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
