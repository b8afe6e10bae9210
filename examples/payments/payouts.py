"""Payouts: money sent to the account's bank through an outside provider (``examples/payments/provider.py``, a process
of its own), in three steps with recovery points (docs/guide.md, "Requests with steps outside the database").

1. ``create_payout`` (local): the payout row, pending; committed with its recovery point.
2. ``provider_transfer`` (outside): the provider's transfer, under the step's downstream key, the same on every
   attempt, so that the provider makes one transfer however often it is asked.
3. ``record_payout`` (local): the transfer's id on the payout, which is now paid; committed with the answer.

A request that stops between steps (the provider's 503, a lost answer, a crash of the app) leaves the payout at its
last recovery point; the client's retry, same key, resumes there: it creates no second payout, asks the provider again
with the same key (and gets the same transfer back), and answers as a first run would, from the steps' results.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal

import httpx
import orjson
from pydantic import BaseModel, Field

from examples.payments.ledger import ensure_account
from examples.payments.wire import new_id
from idempotency_mw import IdempotencyContext


class Payout(BaseModel):
    id: str = Field(pattern=r"^po_")
    object: Literal["payout"] = "payout"
    amount: int
    created: int
    currency: str
    metadata: dict[str, str]
    status: Literal["paid"]
    transfer: str = Field(description="The provider's transfer that paid it")


class ProviderFailed(Exception):
    """The provider answered 5xx, or not at all: the request stops here, and its retry asks again with the same key."""


async def pay_out(
    context: IdempotencyContext,
    provider: httpx.AsyncClient,
    *,
    account: str,
    amount: int,
    currency: str,
    metadata: dict[str, str],
    pause: float = 0.0,
) -> dict[str, Any]:
    """The payout, in its three steps; the answer is built from their results (a resumed run answers the same).
    ``pause``: seconds to wait after each step, for the fault harness to crash the app between them."""
    steps, db = context.steps, context.connection
    assert db is not None  # the payouts route is transactional on a PostgresStore

    async def create_payout() -> dict[str, Any]:
        await ensure_account(db, account)
        row = await db.fetchrow(
            "INSERT INTO payments.payouts (id, account, amount, currency, status, metadata, idempotency_key, created)"
            " VALUES ($1, $2, $3, $4, 'pending', $5::jsonb, $6, $7) RETURNING id, created",
            new_id("po"),
            account,
            amount,
            currency,
            orjson.dumps(metadata).decode(),
            context.key,
            int(time.time()),
        )
        assert row is not None
        return {"id": row["id"], "created": row["created"]}

    created = await steps.local("create_payout", create_payout)
    await asyncio.sleep(pause)

    async def provider_transfer(downstream_key: str) -> dict[str, str]:
        body = {"amount": amount, "currency": currency, "reference": created["id"]}
        try:
            answer = await provider.post("/v1/transfers", json=body, headers={"Idempotency-Key": downstream_key})
        except httpx.HTTPError as error:
            raise ProviderFailed(f"the provider could not be reached: {type(error).__name__}") from error
        if answer.status_code >= 500:
            raise ProviderFailed(f"the provider answered {answer.status_code}")
        answer.raise_for_status()  # a 4xx is a bug here: the request fails, and stays at its recovery point
        return {"transfer": answer.json()["id"]}

    paid = await steps.outside("provider_transfer", provider_transfer)
    await asyncio.sleep(pause)

    async def record_payout() -> Literal["paid"]:
        sql = "UPDATE payments.payouts SET status = 'paid', transfer = $2 WHERE id = $1 AND status = 'pending'"
        if await db.execute(sql, created["id"], paid["transfer"]) != "UPDATE 1":
            raise RuntimeError(f"payout {created['id']} was not pending")
        return "paid"

    status: Literal["paid"] = await steps.local("record_payout", record_payout)
    await asyncio.sleep(pause)
    return Payout(
        id=created["id"],
        amount=amount,
        created=created["created"],
        currency=currency,
        metadata=metadata,
        status=status,
        transfer=paid["transfer"],
    ).model_dump(mode="json")
