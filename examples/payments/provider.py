"""A fake payout provider (a bank) for the payments example's payouts (``examples/payments/payouts.py``): a process of
its own, with idempotency keys of its own as a real provider has, that counts the transfers it really makes.

Serve it on loopback with ``python -m faults.server examples.payments.provider:app`` (the demo and the fault soak
start it with ``faults.server.ServerProcess``, and stop it when they are done).

- ``POST /v1/transfers``, a JSON body ``{"amount", "currency", "reference"}`` and an ``Idempotency-Key`` header
  (required): a key it has seen answers the transfer it made for it, unchanged; another body under a seen key is
  refused (400); only a new key moves money.
- ``PROVIDER_FAIL_RATE``: the share of calls answered 503 before anything happens; ``PROVIDER_LOSE_RATE``: the share
  answered 503 after the transfer was made (its answer lost on the way back); ``PROVIDER_SEED`` seeds the dice.
- ``GET /v1/transfers``: every transfer made, for an audit; ``GET /v1/stats``: calls, transfers, failures.
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
from dataclasses import asdict, dataclass

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

LATENCY = 0.002  # seconds per call: a provider is never instant, and a retry may meet its original running


@dataclass(frozen=True)
class Transfer:
    id: str
    amount: int
    currency: str
    reference: str  # the payout it pays: one transfer per payout, if every caller keeps its key
    key: str


class Bank:
    """The provider's books: one transfer per idempotency key, and what each call met."""

    def __init__(self, fail_rate: float, lose_rate: float, seed: int) -> None:
        self.transfers: dict[str, Transfer] = {}
        self.calls = self.refused = self.failed = self.lost = 0
        self.fail_rate, self.lose_rate = fail_rate, lose_rate
        self.dice = random.Random(seed)

    async def transfer(self, request: Request) -> Response:
        self.calls += 1
        key = request.headers.get("idempotency-key")
        try:
            body = await request.json()
            wanted = (int(body["amount"]), str(body["currency"]), str(body["reference"]))
        except (ValueError, KeyError, TypeError):
            self.refused += 1
            return JSONResponse({"error": "amount, currency and reference are required"}, status_code=400)
        if not key:
            self.refused += 1
            return JSONResponse({"error": "an Idempotency-Key is required"}, status_code=400)
        await asyncio.sleep(LATENCY)
        if self.dice.random() < self.fail_rate:
            self.failed += 1
            return JSONResponse({"error": "try again"}, status_code=503)
        made = self.transfers.get(key)
        if made is None:  # no await between the look-up and the write: one transfer per key
            made = self.transfers[key] = Transfer(f"tr_{secrets.token_hex(8)}", *wanted, key)
        elif (made.amount, made.currency, made.reference) != wanted:
            self.refused += 1
            return JSONResponse({"error": "this key was used with other parameters"}, status_code=400)
        if self.dice.random() < self.lose_rate:
            self.lost += 1
            return JSONResponse({"error": "try again"}, status_code=503)  # made, and the answer is lost
        return JSONResponse(asdict(made))

    async def listing(self, request: Request) -> Response:
        return JSONResponse([asdict(made) for made in self.transfers.values()])

    async def stats(self, request: Request) -> Response:
        counts = {"calls": self.calls, "transfers": len(self.transfers), "refused": self.refused}
        return JSONResponse({**counts, "failed": self.failed, "lost": self.lost})


def create_app(fail_rate: float = 0.0, lose_rate: float = 0.0, seed: int = 1) -> Starlette:
    bank = Bank(fail_rate, lose_rate, seed)
    return Starlette(
        routes=[
            Route("/v1/transfers", bank.transfer, methods=["POST"]),
            Route("/v1/transfers", bank.listing, methods=["GET"]),
            Route("/v1/stats", bank.stats, methods=["GET"]),
        ]
    )


def _rate(name: str) -> float:
    value = float(os.environ.get(name, "0") or "0")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be at least 0 and below 1, got {value}")
    return value


_default_app: Starlette | None = None


def __getattr__(name: str) -> Starlette:
    """``app``: the provider as the environment describes it, built on first use, for a server to import."""
    global _default_app
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _default_app is None:
        seed = int(os.environ.get("PROVIDER_SEED", "1") or "1")
        _default_app = create_app(_rate("PROVIDER_FAIL_RATE"), _rate("PROVIDER_LOSE_RATE"), seed)
    return _default_app
