"""Worker processes for the scenarios: the payments example and the ledger app, each a uvicorn child process.

Both run through :class:`~faults.server.ServerProcess` (kill, restart on the same port);
this module only knows which app, with which settings, and how to count what they wrote.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import asyncpg

from faults.server import ServerProcess


def payments_worker(
    dsn: str, *, pool_size: int = 20, prepared_statements: bool = True, on_conflict: str = "reject"
) -> ServerProcess:
    """The payments example (transactional, Stripe-style) on ``dsn``; ``prepared_statements=False`` when ``dsn`` is
    a transaction-pooling PgBouncer; ``on_conflict="wait"`` has duplicates wait for their original."""
    return ServerProcess(
        "examples.payments.app:app",
        env={
            "DATABASE_URL": dsn,
            "PAYMENTS_POOL_SIZE": str(pool_size),
            "PAYMENTS_MIGRATE": "1",
            "PAYMENTS_PREPARED_STATEMENTS": "1" if prepared_statements else "0",
            "PAYMENTS_ON_CONFLICT": on_conflict,
        },
    )


def ledger_worker(
    dsn: str,
    *,
    transactional: bool = True,
    lease: float = 2.0,
    store_timeout: float = 5.0,
    max_response_bytes: int = 8 * 1024 * 1024,
    port: int = 0,
    sqlalchemy: bool = False,
    on_conflict: str = "reject",
    wait: float = 5.0,
    app_pool: int = 0,
) -> ServerProcess:
    """The ledger app (:mod:`faults.ledger_app`) on ``dsn``; with ``sqlalchemy``, its SQLAlchemy variant
    (:mod:`faults.ledger_sqlalchemy`, transactional only); ``app_pool``: the store on an asyncpg pool of the app's,
    of that size, made in its lifespan."""
    if sqlalchemy and not transactional:
        raise ValueError("the SQLAlchemy ledger is transactional only")
    return ServerProcess(
        "faults.ledger_sqlalchemy:create_app" if sqlalchemy else "faults.ledger_app:create_app",
        factory=True,
        port=port,
        env={
            "FAULTS_DSN": dsn,
            "FAULTS_TRANSACTIONAL": "1" if transactional else "0",
            "FAULTS_LEASE": str(lease),
            "FAULTS_STORE_TIMEOUT": str(store_timeout),
            "FAULTS_MAX_RESPONSE_BYTES": str(max_response_bytes),
            "FAULTS_ON_CONFLICT": on_conflict,
            "FAULTS_WAIT": str(wait),
            "FAULTS_APP_POOL": str(app_pool),
        },
    )


async def effects_per_key(dsn: str, keys: Sequence[str]) -> Counter[str]:
    """How many ``faults_effects`` rows each key wrote (keys that wrote none are absent)."""
    connection = await asyncpg.connect(dsn)
    try:
        rows = await connection.fetch(
            "SELECT key, count(*) AS n FROM faults_effects WHERE key = ANY($1::text[]) GROUP BY key", list(keys)
        )
    finally:
        await connection.close()
    return Counter({row["key"]: row["n"] for row in rows})


async def charges_per_key(dsn: str, keys: Sequence[str]) -> Counter[str]:
    """How many charge entries the payments ledger holds per Idempotency-Key."""
    connection = await asyncpg.connect(dsn)
    try:
        rows = await connection.fetch(
            "SELECT idempotency_key AS key, count(*) AS n FROM payments.ledger "
            "WHERE kind = 'charge' AND idempotency_key = ANY($1::text[]) GROUP BY idempotency_key",
            list(keys),
        )
    finally:
        await connection.close()
    return Counter({row["key"]: row["n"] for row in rows})


async def reruns(dsn: str, keys: Sequence[str]) -> int:
    """Handlers of these keys that ran again after a run of theirs was cut short (``faults_entries``, written as a
    handler starts, outside its transaction)."""
    connection = await asyncpg.connect(dsn)
    try:
        count: int = await connection.fetchval(
            "SELECT coalesce(sum(n - 1), 0) FROM (SELECT count(*) AS n FROM faults_entries "
            "WHERE key = ANY($1::text[]) GROUP BY key) AS runs",
            list(keys),
        )
    finally:
        await connection.close()
    return count


async def effects_without_a_record(dsn: str, keys: Sequence[str]) -> int:
    """Effects of these keys whose key has no completed record: the record of an effect that happened, lost."""
    connection = await asyncpg.connect(dsn)
    try:
        count: int = await connection.fetchval(
            "SELECT count(*) FROM faults_effects AS e WHERE e.key = ANY($1::text[]) AND NOT EXISTS "
            "(SELECT FROM idempotency_responses AS s WHERE s.tenant = e.tenant AND s.key = e.key)",
            list(keys),
        )
    finally:
        await connection.close()
    return count


async def violations(dsn: str, keys: Sequence[str]) -> list[str]:
    """Handlers of these keys that ran without a committed claim (see :mod:`faults.ledger_app`)."""
    connection = await asyncpg.connect(dsn)
    try:
        rows = await connection.fetch(
            "SELECT key, pid, what FROM faults_violations WHERE key = ANY($1::text[])", list(keys)
        )
    finally:
        await connection.close()
    return [f"{row['key']} (pid {row['pid']}): {row['what']}" for row in rows]


async def isolation_label(dsn: str) -> str:
    """ ", repeatable read" (say) when the database's sessions default to another level than READ COMMITTED, for the
    scenario's name; "" when they do not."""
    connection = await asyncpg.connect(dsn)
    try:
        level: str = await connection.fetchval("SHOW default_transaction_isolation")
    finally:
        await connection.close()
    return "" if level == "read committed" else f", {level}"


def tally(counts: Counter[str], keys: Sequence[str]) -> tuple[int, int]:
    """(extra effects beyond one per key, keys with no effect at all)."""
    duplicates = sum(max(counts.get(key, 0) - 1, 0) for key in keys)
    lost = sum(1 for key in keys if counts.get(key, 0) == 0)
    return duplicates, lost
