"""The demo's customers: logical payments sent through the retrying client, and what the client believes happened.

A logical payment is a short story told in a few API calls: maybe a new customer, a payment intent confirmed at
once (sometimes with a card that is declined), then sometimes one or two partial refunds, and sometimes a payout
(a handler in steps that calls the payout provider between two local steps). Every call is a logical
operation with its own Idempotency-Key, chosen once. The client retries each one with that key; when it gives up
(``RetriesExhausted``), the workload sends the same operation again a little later, still with the same key. That
is the contract under test: however often an operation is sent, it takes effect once.

Each operation also carries ``metadata[demo_op]``, a name the server stores with the object it creates, so the
audit can count effects per logical operation without trusting the keys at all.

The seed decides the whole workload before anything is sent (:func:`plan`): each payment's account, whether it
creates a customer or pays as the customer an earlier payment created, its amount, currency, card and refunds.
So one seed gives the same operations and the same balances at any concurrency. What the seed cannot fix is
timing: which attempt the proxy's dice hit, and so how many attempts, drops, replays and 409s a run sees.
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
    payout_rate: float = 0.0  # payouts through the payout provider (the server needs one: PAYMENTS_PROVIDER_URL)


@dataclass
class Operation:
    """One logical operation: its request, fixed up front, and what came back in the end."""

    kind: str  # "customer", "payment_intent", "refund" or "payout"
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


@dataclass(frozen=True)
class Payment:
    """One logical payment as the seed decides it, before anything is sent."""

    index: int
    account: int  # index into the workload's API keys, in sorted order
    customer: int  # the payment that creates the customer this one pays as (``index`` itself: a new customer)
    amount: int
    currency: str
    decline: bool
    refunds: tuple[int, ...]  # partial refunds, in order; each at most half of what is left
    payout: int | None = None  # a payout of this amount after the payment (a handler in steps, with the provider)

    @property
    def new_customer(self) -> bool:
        return self.customer == self.index


def plan(mix: Mix, accounts: int) -> list[Payment]:
    """The payments ``mix`` makes over ``accounts`` accounts: a function of the seed alone.

    Each payment has dice of its own, seeded with the run's seed and its index, and throws all of them in one order
    whatever the outcome, so no throw depends on another payment's progress.
    """
    payments: list[Payment] = []
    creators: dict[int, list[int]] = defaultdict(list)  # per account: the payments that create a customer
    for index in range(mix.payments):
        dice = random.Random(f"{mix.seed}:{index}")
        account = index % accounts
        new_customer, pick = dice.random() < mix.new_customer_rate, dice.random()
        amount = dice.randrange(500, 20_000)
        decline = dice.random() < mix.decline_rate
        currency = mix.currencies[dice.randrange(len(mix.currencies))]
        refund, count = dice.random() < mix.refund_rate, 1 + dice.randrange(2)
        parts, left = [], amount
        for _ in range(count):
            part = dice.randrange(1, left // 2 + 1)
            parts.append(part)
            left -= part
        payout, payout_amount = dice.random() < mix.payout_rate, dice.randrange(100, 5_000)  # thrown last
        earlier = creators[account]
        if new_customer or not earlier:
            customer = index
            earlier.append(index)
        else:
            customer = earlier[int(pick * len(earlier))]
        refunds = tuple(parts) if refund and not decline else ()
        paid_out = payout_amount if payout and not decline else None
        payments.append(Payment(index, account, customer, amount, currency, decline, refunds, paid_out))
    return payments


class Workload:
    """Runs ``mix.payments`` logical payments, ``mix.concurrency`` at a time, through one client per account."""

    def __init__(self, mix: Mix, clients: Mapping[str, AsyncIdempotentClient], run: str) -> None:
        self.mix = mix
        self.clients = clients
        self.api_keys = sorted(clients)
        self.run_name = run
        self.operations: list[Operation] = []
        self.plan = plan(mix, len(self.api_keys))
        # The id of each planned customer once its creation has an answer (None if it never got one).
        self.customer_ids: dict[int, asyncio.Future[str | None]] = {}
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
        loop = asyncio.get_running_loop()
        self.customer_ids = {p.index: loop.create_future() for p in self.plan if p.new_customer}
        queue: asyncio.Queue[Payment] = asyncio.Queue()
        for payment in self.plan:
            queue.put_nowait(payment)

        async def worker() -> None:
            while not queue.empty():
                await self.payment(queue.get_nowait())
                self.payments_done += 1

        await asyncio.gather(*(worker() for _ in range(max(1, self.mix.concurrency))))

    async def payment(self, payment: Payment) -> None:
        """One logical payment: customer (new, or an earlier payment's), payment intent, then perhaps refunds.

        A payment that pays as an earlier payment's customer waits for that customer's creation, which started
        before it (payments start in index order) and waits for nothing itself.
        """
        index = payment.index
        api_key = self.api_keys[payment.account]
        name = f"{self.run_name}-{index}"
        if payment.new_customer:
            created = self.customer_ids[index]
            try:
                op = await self.perform(
                    Operation(
                        "customer",
                        api_key,
                        "/v1/customers",
                        {
                            "email": f"buyer{index}@example.com",
                            "name": f"Buyer {index}",
                            "metadata[demo_op]": name + "-c",
                        },
                        name + "-c",
                    )
                )
                created.set_result(op.object_id if op.succeeded else None)
            finally:
                if not created.done():
                    created.set_result(None)
        customer = await self.customer_ids[payment.customer]

        data = {
            "amount": str(payment.amount),
            "currency": payment.currency,
            "confirm": "true",
            "metadata[demo_op]": name + "-p",
            "metadata[order]": str(index),
        }
        if customer is not None:
            data["customer"] = customer
        if payment.decline:
            data["payment_method"] = "pm_card_chargeDeclined"
        intent = await self.perform(
            Operation(
                "payment_intent", api_key, "/v1/payment_intents", data, name + "-p", expect_decline=payment.decline
            )
        )
        if not intent.succeeded:
            return
        for number, part in enumerate(payment.refunds):
            refund_name = f"{name}-r{number}"
            await self.perform(
                Operation(
                    "refund",
                    api_key,
                    "/v1/refunds",
                    {"payment_intent": str(intent.object_id), "amount": str(part), "metadata[demo_op]": refund_name},
                    refund_name,
                )
            )
        if payment.payout is not None:
            payout_name = f"{name}-o"
            data = {"amount": str(payment.payout), "currency": payment.currency, "metadata[demo_op]": payout_name}
            await self.perform(Operation("payout", api_key, "/v1/payouts", data, payout_name))

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
