"""The payments demo's SQL, all of it: accounts, customers, payment intents, refunds, and the ledger behind them.

Writes take the connection of the request's transaction (in transactional mode, the one whose commit also records
the idempotency response), so an effect and its record commit together or not at all. Refunds lock their payment
intent's row, and the ``refunds_within_captured`` CHECK constraint (``schema.sql``) makes an over-refund
impossible even for code that forgets to.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import asyncpg
import orjson

from examples.payments.wire import MetadataUpdate, new_id

SCHEMA_LOCK = 0x1DE4_0DE1  # pg_advisory_xact_lock key: app instances starting together apply the schema in turn

Connection = asyncpg.Connection | asyncpg.pool.PoolConnectionProxy


def schema_sql() -> str:
    return Path(__file__).with_name("schema.sql").read_text()


async def apply_schema(pool: asyncpg.Pool) -> None:
    """Create the demo's tables if they are missing (every statement in ``schema.sql`` may run again)."""
    async with pool.acquire() as connection, connection.transaction():
        await connection.execute("SELECT pg_advisory_xact_lock($1)", SCHEMA_LOCK)
        await connection.execute(schema_sql())


def _json(value: Any) -> str:
    return orjson.dumps(value).decode()


def _now() -> int:
    return int(time.time())


async def ensure_account(db: Connection, account: str) -> None:
    """Accounts exist from the first write made with their key (a demo convenience: no sign-up)."""
    await db.execute("INSERT INTO payments.accounts (id) VALUES ($1) ON CONFLICT (id) DO NOTHING", account)


# -- customers -------------------------------------------------------------------------------------------------


async def insert_customer(
    db: Connection,
    account: str,
    *,
    email: str | None,
    name: str | None,
    description: str | None,
    metadata: dict[str, str],
) -> asyncpg.Record:
    row = await db.fetchrow(
        "INSERT INTO payments.customers (id, account, email, name, description, metadata, created)"
        " VALUES ($1, $2, $3, $4, $5, $6::jsonb, $7) RETURNING *",
        new_id("cus"),
        account,
        email,
        name,
        description,
        _json(metadata),
        _now(),
    )
    assert row is not None
    return row


def _storable(object_id: str) -> bool:
    """PostgreSQL text cannot hold NUL, so an id containing one names nothing (and must not reach the database)."""
    return "\x00" not in object_id


async def find_customer(db: Connection, account: str, customer_id: str) -> asyncpg.Record | None:
    if not _storable(customer_id):
        return None
    return await db.fetchrow("SELECT * FROM payments.customers WHERE id = $1 AND account = $2", customer_id, account)


# -- payment intents -------------------------------------------------------------------------------------------


async def insert_payment_intent(
    db: Connection,
    account: str,
    *,
    amount: int,
    currency: str,
    customer: str | None,
    payment_method: str | None,
    description: str | None,
    metadata: dict[str, str],
) -> asyncpg.Record:
    intent_id = new_id("pi")
    row = await db.fetchrow(
        "INSERT INTO payments.payment_intents"
        " (id, account, customer, amount, currency, status, payment_method, client_secret, description, metadata,"
        "  created)"
        " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10::jsonb, $11) RETURNING *",
        intent_id,
        account,
        customer,
        amount,
        currency,
        "requires_confirmation" if payment_method else "requires_payment_method",
        payment_method,
        intent_id + "_secret_" + new_id("cs")[3:],
        description,
        _json(metadata),
        _now(),
    )
    assert row is not None
    return row


async def find_payment_intent(
    db: Connection, account: str, intent_id: str, *, lock: bool = False
) -> asyncpg.Record | None:
    """The payment intent; with ``lock``, its row stays locked until the transaction ends (refunds, confirms)."""
    if not _storable(intent_id):
        return None
    query = "SELECT * FROM payments.payment_intents WHERE id = $1 AND account = $2"
    return await db.fetchrow(query + (" FOR UPDATE" if lock else ""), intent_id, account)


async def capture(
    db: Connection, intent: asyncpg.Record, payment_method: str, idempotency_key: str | None
) -> asyncpg.Record:
    """Capture the full amount: the intent succeeds and the ledger gets its one charge entry."""
    row = await db.fetchrow(
        "UPDATE payments.payment_intents"
        " SET status = 'succeeded', payment_method = $2, amount_received = amount, last_payment_error = NULL"
        " WHERE id = $1 RETURNING *",
        intent["id"],
        payment_method,
    )
    assert row is not None
    await db.execute(
        "INSERT INTO payments.ledger (account, currency, amount, kind, payment_intent, idempotency_key)"
        " VALUES ($1, $2, $3, 'charge', $4, $5)",
        row["account"],
        row["currency"],
        row["amount"],
        row["id"],
        idempotency_key,
    )
    return row


async def decline(db: Connection, intent: asyncpg.Record, error: dict[str, str]) -> asyncpg.Record:
    """The card was declined: nothing is captured, and the intent waits for another payment method."""
    row = await db.fetchrow(
        "UPDATE payments.payment_intents"
        " SET status = 'requires_payment_method', payment_method = NULL, last_payment_error = $2::jsonb"
        " WHERE id = $1 RETURNING *",
        intent["id"],
        _json(error),
    )
    assert row is not None
    return row


# -- refunds ---------------------------------------------------------------------------------------------------


async def insert_refund(
    db: Connection,
    intent: asyncpg.Record,
    *,
    amount: int,
    reason: str | None,
    metadata: dict[str, str],
    idempotency_key: str | None,
) -> asyncpg.Record:
    """Refund ``amount`` of a captured intent whose row the caller has locked (``find_payment_intent(lock=True)``).

    The intent's ``amount_refunded`` grows first: past ``amount_received`` the CHECK constraint refuses it, so
    even a caller that skipped the lock could not refund more than was captured.
    """
    await db.execute(
        "UPDATE payments.payment_intents SET amount_refunded = amount_refunded + $2 WHERE id = $1",
        intent["id"],
        amount,
    )
    row = await db.fetchrow(
        "INSERT INTO payments.refunds (id, account, payment_intent, amount, currency, reason, metadata, created)"
        " VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb, $8) RETURNING *",
        new_id("re"),
        intent["account"],
        intent["id"],
        amount,
        intent["currency"],
        reason,
        _json(metadata),
        _now(),
    )
    assert row is not None
    await db.execute(
        "INSERT INTO payments.ledger (account, currency, amount, kind, payment_intent, refund, idempotency_key)"
        " VALUES ($1, $2, $3, 'refund', $4, $5, $6)",
        row["account"],
        row["currency"],
        -amount,
        row["payment_intent"],
        row["id"],
        idempotency_key,
    )
    return row


async def find_refund(db: Connection, account: str, refund_id: str) -> asyncpg.Record | None:
    if not _storable(refund_id):
        return None
    return await db.fetchrow("SELECT * FROM payments.refunds WHERE id = $1 AND account = $2", refund_id, account)


# -- updates ---------------------------------------------------------------------------------------------------

# The columns an update may set, per table (the API's update endpoints; metadata apart).
UPDATABLE = {
    "customers": frozenset({"email", "name", "description"}),
    "payment_intents": frozenset({"description"}),
    "refunds": frozenset(),
}


async def update(
    db: Connection,
    table: str,
    account: str,
    object_id: str,
    fields: Mapping[str, str | None],
    metadata: MetadataUpdate | None,
) -> asyncpg.Record | None:
    """Set ``fields`` (None clears one) and apply ``metadata`` to one object; None when the account has no such
    object. Metadata keys are merged, then the unset ones removed, as Stripe does."""
    if table not in UPDATABLE or not set(fields) <= UPDATABLE[table]:
        raise ValueError(f"cannot update {sorted(fields)} of {table}")
    if not _storable(object_id):
        return None
    args: list[Any] = [object_id, account]
    assignments = []
    for column, value in fields.items():
        args.append(value)
        assignments.append(f"{column} = ${len(args)}")
    if metadata is not None:
        args += [metadata.clear, _json(metadata.set), metadata.unset]
        n = len(args)
        assignments.append(
            f"metadata = (CASE WHEN ${n - 2} THEN '{{}}'::jsonb ELSE metadata END || ${n - 1}::jsonb) - ${n}::text[]"
        )
    if not assignments:  # nothing to change: Stripe answers with the object as it is
        return await db.fetchrow(f"SELECT * FROM payments.{table} WHERE id = $1 AND account = $2", *args)
    return await db.fetchrow(
        f"UPDATE payments.{table} SET {', '.join(assignments)} WHERE id = $1 AND account = $2 RETURNING *", *args
    )


# -- lists -----------------------------------------------------------------------------------------------------

# The columns a list may be filtered on, per table (besides created).
FILTERS = {
    "customers": frozenset({"email"}),
    "payment_intents": frozenset({"customer"}),
    "refunds": frozenset({"payment_intent"}),
}
COMPARISONS = {"gt": ">", "gte": ">=", "lt": "<", "lte": "<="}


async def position(db: Connection, table: str, account: str, object_id: str) -> int | None:
    """Where an object stands in its list (its ``seq``), for a cursor; None when the account has no such object."""
    if table not in FILTERS:
        raise ValueError(f"{table} is not listed")
    if not _storable(object_id):
        return None
    seq: int | None = await db.fetchval(
        f"SELECT seq FROM payments.{table} WHERE id = $1 AND account = $2", object_id, account
    )
    return seq


async def page(
    db: Connection,
    table: str,
    account: str,
    *,
    equal: Mapping[str, str],
    created: Mapping[str, int],
    after: int | None,
    before: int | None,
    limit: int,
) -> tuple[list[asyncpg.Record], bool]:
    """One page of a list, newest first, and whether more lie beyond it in the direction of travel.

    ``after`` (a ``seq``) pages towards older objects, ``before`` towards newer ones: the ``limit`` objects just
    newer than it, still sorted newest first.
    """
    if table not in FILTERS or not set(equal) <= FILTERS[table] or not set(created) <= set(COMPARISONS):
        raise ValueError(f"cannot filter {table} on {sorted(equal)} and created {sorted(created)}")
    args: list[Any] = [account]
    conditions = ["account = $1"]
    for column, value in equal.items():
        args.append(value)
        conditions.append(f"{column} = ${len(args)}")
    for comparison, bound in created.items():
        args.append(bound)
        conditions.append(f"created {COMPARISONS[comparison]} ${len(args)}")
    newer_first = before is None
    if after is not None:
        args.append(after)
        conditions.append(f"seq < ${len(args)}")
    if before is not None:
        args.append(before)
        conditions.append(f"seq > ${len(args)}")
    args.append(limit + 1)  # one more than asked tells whether there are more
    rows = await db.fetch(
        f"SELECT * FROM payments.{table} WHERE {' AND '.join(conditions)}"
        f" ORDER BY seq {'DESC' if newer_first else 'ASC'} LIMIT ${len(args)}",
        *args,
    )
    more = len(rows) > limit
    rows = rows[:limit]
    if not newer_first:
        rows.reverse()
    return rows, more


# -- balances --------------------------------------------------------------------------------------------------


async def balance(db: Connection, account: str) -> dict[str, int]:
    """The account's balance per currency: the sum of its ledger entries, nothing else."""
    rows = await db.fetch(
        "SELECT currency, sum(amount)::bigint AS total FROM payments.ledger WHERE account = $1 GROUP BY currency",
        account,
    )
    return {row["currency"]: row["total"] for row in rows}
