"""After the demo: hold what the client believes against what the ledger holds.

Three independent views must agree: the answers the client got (``Workload``), the ledger and the objects in
PostgreSQL (read directly), and the API's own ``GET /v1/balance`` (asked without the lossy proxy); and for payouts,
a fourth: the transfers the payout provider made (one per payout, the one the payout and its answer name).
Effects are counted two ways, so a mistake in one cannot hide in the other: ledger entries per Idempotency-Key (the
middleware's view) and objects per logical operation name (``metadata[demo_op]``, which knows nothing of keys).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import asyncpg
import httpx

from examples.demo.workload import Workload
from examples.payments.wire import account_id

_OBJECTS = """
SELECT 'customer' AS kind, id, metadata->>'demo_op' AS name, NULL AS status FROM payments.customers
 WHERE account = ANY($1)
UNION ALL
SELECT 'payment_intent', id, metadata->>'demo_op', status FROM payments.payment_intents WHERE account = ANY($1)
UNION ALL
SELECT 'refund', id, metadata->>'demo_op', NULL FROM payments.refunds WHERE account = ANY($1)
UNION ALL
SELECT 'payout', id, metadata->>'demo_op', status FROM payments.payouts WHERE account = ANY($1)
"""

_PAYOUTS = "SELECT id, status, transfer FROM payments.payouts WHERE account = ANY($1)"

_LEDGER_BALANCES = """
SELECT account, currency, sum(amount)::bigint AS total FROM payments.ledger WHERE account = ANY($1)
 GROUP BY account, currency
"""

# Ledger entries beyond the first per Idempotency-Key: each keyed write makes at most one.
_DUPLICATE_ENTRIES = """
SELECT coalesce(sum(n - 1), 0)::bigint FROM (
    SELECT count(*) AS n FROM payments.ledger WHERE account = ANY($1) AND idempotency_key IS NOT NULL
     GROUP BY account, idempotency_key
) AS per_key
"""

# Payment intents whose captured or refunded amounts disagree with their ledger entries.
_OUT_OF_STEP = """
SELECT count(*) FROM payments.payment_intents AS p WHERE p.account = ANY($1) AND (
    p.amount_received <> coalesce((SELECT sum(amount) FROM payments.ledger
                                    WHERE payment_intent = p.id AND kind = 'charge'), 0)
 OR p.amount_refunded <> -coalesce((SELECT sum(amount) FROM payments.ledger
                                     WHERE payment_intent = p.id AND kind = 'refund'), 0))
"""


@dataclass
class Audit:
    believed: dict[tuple[str, str], int]  # (account, currency) -> amount, from the client's answers
    ledger: dict[tuple[str, str], int]  # the same, summed from the ledger
    api: dict[tuple[str, str], int]  # the same, from GET /v1/balance
    duplicate_entries: int  # ledger entries beyond one per Idempotency-Key
    duplicate_objects: int  # objects beyond one per logical operation
    lost: list[str] = field(default_factory=list)  # operations without an answer, or whose effect is missing
    unexpected: list[str] = field(default_factory=list)  # operations whose final answer was not the expected one
    out_of_step: int = 0  # payment intents whose amounts disagree with their ledger entries
    # The payout provider's view (when the run had one): transfers it made, and those beyond one per payout.
    provider_transfers: int = 0
    provider_duplicates: int = 0

    @property
    def duplicates(self) -> int:
        return self.duplicate_entries + self.duplicate_objects + self.provider_duplicates

    @property
    def balances_agree(self) -> bool:
        return _nonzero(self.believed) == _nonzero(self.ledger) == _nonzero(self.api)

    @property
    def ok(self) -> bool:
        return (
            self.duplicates == 0
            and not self.lost
            and not self.unexpected
            and self.out_of_step == 0
            and self.balances_agree
        )


def _nonzero(totals: dict[tuple[str, str], int]) -> dict[tuple[str, str], int]:
    return {k: v for k, v in totals.items() if v}


async def audit(
    workload: Workload, dsn: str, api: httpx.AsyncClient, provider: httpx.AsyncClient | None = None
) -> Audit:
    """Compare the workload's answers with the database at ``dsn`` and the balances ``api`` (the server) reports,
    and the payouts with the transfers ``provider`` (the payout provider, if the run had one) made."""
    accounts = {account_id(key): key for key in workload.api_keys}
    ids = list(accounts)
    connection = await asyncpg.connect(dsn)
    try:
        objects = await connection.fetch(_OBJECTS, ids)
        ledger_rows = await connection.fetch(_LEDGER_BALANCES, ids)
        duplicate_entries = int(await connection.fetchval(_DUPLICATE_ENTRIES, ids))
        out_of_step = int(await connection.fetchval(_OUT_OF_STEP, ids))
        payouts = {row["id"]: (row["status"], row["transfer"]) for row in await connection.fetch(_PAYOUTS, ids)}
    finally:
        await connection.close()

    reported: dict[tuple[str, str], int] = {}
    for account, key in accounts.items():
        response = await api.get("/v1/balance", headers={"Authorization": f"Bearer {key}"})
        response.raise_for_status()
        for entry in response.json()["available"]:
            reported[account, entry["currency"]] = entry["amount"]

    per_name: dict[str, list[tuple[str, str, str | None]]] = defaultdict(list)
    for row in objects:
        per_name[row["name"]].append((row["kind"], row["id"], row["status"]))
    duplicate_objects = sum(len(stored) - 1 for stored in per_name.values())

    result = Audit(
        believed={(account_id(key), currency): v for (key, currency), v in workload.believed_balances().items()},
        ledger={(row["account"], row["currency"]): row["total"] for row in ledger_rows},
        api=reported,
        duplicate_entries=duplicate_entries,
        duplicate_objects=duplicate_objects,
        out_of_step=out_of_step,
    )
    transfers: dict[str, list[str]] = defaultdict(list)  # per payout: the transfers the provider made for it
    if provider is not None:
        response = await provider.get("/v1/transfers")
        response.raise_for_status()
        for made in response.json():
            transfers[made["reference"]].append(made["id"])
        result.provider_transfers = sum(len(made) for made in transfers.values())
        # beyond one per payout, and any for a payout these accounts do not have
        result.provider_duplicates = sum(len(made) - (reference in payouts) for reference, made in transfers.items())
    for op in workload.operations:
        if op.kind == "payout" and op.succeeded and provider is not None:
            paid = (op.body["status"], op.body["transfer"])
            if payouts.get(str(op.object_id)) != paid or transfers.get(str(op.object_id)) != [paid[1]]:
                result.lost.append(
                    f"{op.name}: answered {paid}; the payout is {payouts.get(str(op.object_id))}, and the provider "
                    f"made {transfers.get(str(op.object_id), [])} for it"
                )
                continue
        stored = per_name.get(op.name, [])
        if op.status is None:
            result.lost.append(f"{op.name}: no final answer after {len(op.outcomes)} attempts")
        elif not op.expected:
            result.unexpected.append(f"{op.name}: {op.status} {op.body}")
        elif op.object_id not in {object_id for _, object_id, _ in stored}:
            result.lost.append(f"{op.name}: the answer names {op.object_id}, which the database does not have")
        elif op.declined and any(status != "requires_payment_method" for _, _, status in stored):
            result.lost.append(f"{op.name}: declined, but the payment intent was captured")
    return result
