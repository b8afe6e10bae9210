"""The API objects as Stripe shapes them (a subset of their fields), rendered from ledger rows.

The models are the single source of both the JSON the endpoints send and the schemas in ``/openapi.json``, so the
two cannot drift apart (schemathesis checks the second against the first).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import asyncpg
import orjson
from pydantic import BaseModel, Field

IntentStatus = Literal["requires_payment_method", "requires_confirmation", "succeeded"]


class Customer(BaseModel):
    id: str = Field(pattern=r"^cus_")
    object: Literal["customer"] = "customer"
    balance: int = 0
    created: int
    description: str | None
    email: str | None
    livemode: bool = False
    metadata: dict[str, str]
    name: str | None


class PaymentError(BaseModel):
    """``last_payment_error`` of a declined payment intent."""

    type: Literal["card_error"] = "card_error"
    code: str
    decline_code: str
    message: str


class PaymentIntent(BaseModel):
    id: str = Field(pattern=r"^pi_")
    object: Literal["payment_intent"] = "payment_intent"
    amount: int
    amount_capturable: int = 0
    amount_received: int
    capture_method: Literal["automatic"] = "automatic"
    client_secret: str
    confirmation_method: Literal["automatic"] = "automatic"
    created: int
    currency: str
    customer: str | Customer | None = Field(description="The customer's id, or the customer with expand[]=customer")
    description: str | None
    last_payment_error: PaymentError | None
    livemode: bool = False
    metadata: dict[str, str]
    payment_method: str | None
    payment_method_types: list[str] = ["card"]
    status: IntentStatus


class Refund(BaseModel):
    id: str = Field(pattern=r"^re_")
    object: Literal["refund"] = "refund"
    amount: int
    charge: None = None
    created: int
    currency: str
    metadata: dict[str, str]
    payment_intent: str | PaymentIntent = Field(
        description="The payment intent's id, or the payment intent with expand[]=payment_intent"
    )
    reason: str | None
    status: Literal["succeeded"] = "succeeded"


class CustomerList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Customer]
    has_more: bool
    url: str


class PaymentIntentList(BaseModel):
    object: Literal["list"] = "list"
    data: list[PaymentIntent]
    has_more: bool
    url: str


class RefundList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Refund]
    has_more: bool
    url: str


class BalanceAmount(BaseModel):
    amount: int
    currency: str
    source_types: dict[str, int]


class Balance(BaseModel):
    object: Literal["balance"] = "balance"
    available: list[BalanceAmount]
    pending: list[BalanceAmount]
    livemode: bool = False


class ErrorDetail(BaseModel):
    type: Literal["invalid_request_error", "card_error", "idempotency_error", "api_error"]
    message: str
    code: str | None = None
    param: str | None = None
    decline_code: str | None = None
    payment_intent: PaymentIntent | None = None


class ErrorEnvelope(BaseModel):
    """Every error, Stripe's way."""

    error: ErrorDetail


def _metadata(row: asyncpg.Record) -> dict[str, str]:
    value: dict[str, str] = orjson.loads(row["metadata"])
    return value


def customer(row: asyncpg.Record) -> dict[str, Any]:
    return Customer(
        id=row["id"],
        created=row["created"],
        description=row["description"],
        email=row["email"],
        metadata=_metadata(row),
        name=row["name"],
    ).model_dump(mode="json")


def payment_intent(row: asyncpg.Record) -> dict[str, Any]:
    error = row["last_payment_error"]
    return PaymentIntent(
        id=row["id"],
        amount=row["amount"],
        amount_received=row["amount_received"],
        client_secret=row["client_secret"],
        created=row["created"],
        currency=row["currency"],
        customer=row["customer"],
        description=row["description"],
        last_payment_error=PaymentError(**orjson.loads(error)) if error else None,
        metadata=_metadata(row),
        payment_method=row["payment_method"],
        status=row["status"],
    ).model_dump(mode="json")


def refund(row: asyncpg.Record) -> dict[str, Any]:
    return Refund(
        id=row["id"],
        amount=row["amount"],
        created=row["created"],
        currency=row["currency"],
        metadata=_metadata(row),
        payment_intent=row["payment_intent"],
        reason=row["reason"],
    ).model_dump(mode="json")


def balance(totals: Mapping[str, int], default_currency: str = "usd") -> dict[str, Any]:
    """Funds are available at once in the demo (Stripe holds them as ``pending`` for a few days first)."""
    currencies = sorted(totals) or [default_currency]
    return Balance(
        available=[
            BalanceAmount(amount=totals.get(c, 0), currency=c, source_types={"card": totals.get(c, 0)})
            for c in currencies
        ],
        pending=[BalanceAmount(amount=0, currency=c, source_types={"card": 0}) for c in currencies],
    ).model_dump(mode="json")
