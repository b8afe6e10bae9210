"""The demo's customers: logical payments sent through the retrying client, and what the client believes happened.

A logical payment is a short story told in a few API calls: maybe a new customer, a payment intent confirmed at
once (sometimes with a card that is declined), then sometimes one or two partial refunds. Every call is a logical
operation with its own Idempotency-Key, chosen once. The client retries each one with that key; when it gives up
(``RetriesExhausted``), the workload sends the same operation again a little later, still with the same key. That
is the contract under test: however often an operation is sent, it takes effect once.

Each operation also carries ``metadata[demo_op]``, a name the server stores with the object it creates, so the
audit can count effects per logical operation without trusting the keys at all.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from idempotency_mw.client import AsyncIdempotentClient, RetriesExhausted


@dataclass(frozen=True)
class Mix:
    """The shape of the workload. Rates are probabilities per logical payment."""

    payments: int = 200
    concurrency: int = 16
    accounts: int = 3
    new_customer_rate: float = 0.3
    decline_rate: float = 0.05
    refund_rate: float = 0.4
    currencies: tuple[str, ...] = ("usd", "eur")
    resends: int = 6  # how many more times an operation is sent after the client gave up on it
    seed: int = 1


@dataclass
class Operation:
    """One logical operation: its request, fixed up front, and what came back in the end."""

    kind: str  # "customer", "payment_intent" or "refund"
    api_key: str
    path: str
    data: dict[str, str]
    name: str  # also sent as metadata[demo_op]
    expect_decline: bool = False
    key: str = field(default_factory=lambda: str(uuid.uuid4()))
    status: int | None = None  # of the final answer; None while (or if) there is none
    body: Any = None
    replayed: bool = False
    outcomes: list[int | str] = field(default_factory=list)  # every HTTP attempt: a status or an error name
    gave_up: int = 0  # times the client raised RetriesExhausted and the operation was sent again later

    @property
    def succeeded(self) -> bool:
        return self.status == 200

    @property
    def declined(self) -> bool:
        return self.status == 402

    @property
    def object_id(self) -> str | None:
        """The id of what the operation created, as the answer reported it."""
        if not isinstance(self.body, dict):
            return None
        if self.succeeded:
            return str(self.body["id"])
        if self.declined:
            return str(self.body["error"]["payment_intent"]["id"])
        return None

    @property
    def expected(self) -> bool:
        """Whether the final answer is the one this operation should get (a decline for a declining card)."""
        return self.declined if self.expect_decline else self.succeeded


class Workload:
    """Runs ``mix.payments`` logical payments, ``mix.concurrency`` at a time, through one client per account."""

    def __init__(self, mix: Mix, clients: Mapping[str, AsyncIdempotentClient], run: str) -> None:
        self.mix = mix
        self.clients = clients
        self.api_keys = sorted(clients)
        self.run_name = run
        self.operations: list[Operation] = []
        self.customers: dict[str, list[str]] = defaultdict(list)
        self.payments_done = 0

    # -- what the client believes -------------------------------------------------------------------------------

    @property
    def attempts(self) -> int:
        return sum(len(op.outcomes) for op in self.operations)

    def count_outcome(self, outcome: int | str) -> int:
        return sum(op.outcomes.count(outcome) for op in self.operations)

    def believed_balances(self) -> dict[tuple[str, str], int]:
        """Per (secret key, currency): what the answers the client got add up to."""
        totals: dict[tuple[str, str], int] = defaultdict(int)
        for op in self.operations:
            if not op.succeeded:
                continue
            if op.kind == "payment_intent" and op.body["status"] == "succeeded":
                totals[op.api_key, op.body["currency"]] += op.body["amount_received"]
            elif op.kind == "refund":
                totals[op.api_key, op.body["currency"]] -= op.body["amount"]
        return dict(totals)

    # -- driving ---------------------------------------------------------------------------------------------

    async def run(self) -> None:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for index in range(self.mix.payments):
            queue.put_nowait(index)

        async def worker() -> None:
            while not queue.empty():
                await self.payment(queue.get_nowait())
                self.payments_done += 1

        await asyncio.gather(*(worker() for _ in range(max(1, self.mix.concurrency))))

    async def payment(self, index: int) -> None:
        """One logical payment: customer (maybe new), payment intent, then perhaps partial refunds."""
        dice = random.Random(f"{self.mix.seed}:{index}")
        api_key = self.api_keys[index % len(self.api_keys)]
        name = f"{self.run_name}-{index}"
        customers = self.customers[api_key]
        customer: str | None = None
        if not customers or dice.random() < self.mix.new_customer_rate:
            created = await self.perform(
                Operation(
                    "customer",
                    api_key,
                    "/v1/customers",
                    {"email": f"buyer{index}@example.com", "name": f"Buyer {index}", "metadata[demo_op]": name + "-c"},
                    name + "-c",
                )
            )
            customer = created.object_id if created.succeeded else None
            if customer is not None:
                customers.append(customer)
        else:
            customer = dice.choice(customers)

        amount = dice.randrange(500, 20_000)
        decline = dice.random() < self.mix.decline_rate
        data = {
            "amount": str(amount),
            "currency": dice.choice(self.mix.currencies),
            "confirm": "true",
            "metadata[demo_op]": name + "-p",
            "metadata[order]": str(index),
        }
        if customer is not None:
            data["customer"] = customer
        if decline:
            data["payment_method"] = "pm_card_chargeDeclined"
        intent = await self.perform(
            Operation("payment_intent", api_key, "/v1/payment_intents", data, name + "-p", expect_decline=decline)
        )
        if not intent.succeeded or dice.random() >= self.mix.refund_rate:
            return
        unrefunded = amount
        for number in range(dice.choice((1, 2))):
            part = dice.randrange(1, unrefunded // 2 + 1)
            refund_name = f"{name}-r{number}"
            refund = await self.perform(
                Operation(
                    "refund",
                    api_key,
                    "/v1/refunds",
                    {"payment_intent": str(intent.object_id), "amount": str(part), "metadata[demo_op]": refund_name},
                    refund_name,
                )
            )
            if refund.succeeded:
                unrefunded -= part

    async def perform(self, op: Operation) -> Operation:
        """Send ``op`` until it gets a final answer, always with its one key; give up after ``mix.resends``."""
        self.operations.append(op)
        client = self.clients[op.api_key]
        for resend in range(self.mix.resends + 1):
            try:
                result = await client.post(op.path, data=op.data, idempotency_key=op.key)
            except RetriesExhausted as error:
                op.outcomes.extend(error.outcomes)
                op.gave_up += 1
                if resend < self.mix.resends:
                    await asyncio.sleep(min(0.25 * 2**resend, 4.0))  # "later", as an application would
                continue
            op.outcomes.extend(result.outcomes)
            op.status, op.replayed = result.status_code, result.replayed
            op.body = result.json()
            break
        return op
