"""The official Stripe Python SDK (``stripe`` 16.x) against the payments example (issue 12, section 1).

Sync (``StripeClient`` on requests) and async (``http_client=stripe.HTTPXClient()``, the ``*_async`` methods),
pointed at the example served on loopback, with ``max_network_retries=8`` and the keys the SDK mints itself. The
first test goes through a proxy that loses answers and holds the ledger against what the clients were told; the
others check what a Stripe user relies on: the error classes, Request-Id and the key echo, expand[], and
auto-pagination.
"""

from __future__ import annotations

import asyncio
import random
import re
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import asyncpg
import pytest

from examples.payments.app import create_app
from examples.payments.wire import account_id
from faults.proxy import LossyProxy
from faults.server import ServerProcess, serve
from idempotency_mw import PostgresStore

stripe = pytest.importorskip("stripe", reason="the Stripe SDK is not installed (pip install -e '.[dev]')")

T = TypeVar("T")
# The SDK's HTTPXClient posts its form as bytes through data=, which httpx deprecates: its business, not ours.
pytestmark = pytest.mark.filterwarnings("ignore:Use .content=<...>. to upload raw bytes:DeprecationWarning")
RETRIES = 8
SDK_KEY = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")  # what the SDK mints
# A key the SDK minted (random hex in UUID shape) that reads as a UUIDv7 born long ago: the middleware once
# refused it as expired (issue 10, defect 12).
OLD_LOOKING_KEY = "00249a52-a346-784a-b512-74d3ab0cb4c2"


def sync_client(api_key: str, base_url: str) -> Any:
    """The SDK's default client: requests underneath, blocking."""
    return stripe.StripeClient(
        api_key,
        base_addresses={"api": base_url},
        max_network_retries=RETRIES,
        http_client=stripe.RequestsClient(timeout=30),
    )


def async_client(api_key: str, base_url: str, http: Any) -> Any:
    """The SDK's async flavour: an httpx client, and the ``*_async`` methods."""
    return stripe.StripeClient(api_key, base_addresses={"api": base_url}, max_network_retries=RETRIES, http_client=http)


@pytest.fixture
async def server(idempotency_database_url: str) -> AsyncIterator[str]:
    """The example served in this process, on loopback (the sync SDK runs in threads meanwhile)."""
    app = create_app(idempotency_database_url, pool_size=8)
    async with serve(app) as base_url:
        yield base_url


@pytest.fixture
async def http() -> AsyncIterator[Any]:
    client = stripe.HTTPXClient(timeout=30)
    yield client
    await client.close_async()


def new_api_key() -> str:
    return f"sk_test_sdk_{uuid.uuid4().hex}"


# -- exactly once, through a lossy network -----------------------------------------------------------------------


@dataclass
class Payment:
    """One logical payment and what the SDK answered for it."""

    name: str
    api_key: str
    amount: int
    currency: str
    declined: bool
    refund: int | None  # the amount to refund afterwards, if any
    new_customer: bool
    customer: str | None = None
    intent: str | None = None
    intent_key: str | None = None  # the Idempotency-Key the SDK minted for the payment intent (echoed back)
    refund_id: str | None = None

    @property
    def captured(self) -> int:
        return 0 if self.declined else self.amount - (self.refund or 0)


def plan(run: str, api_keys: list[str], count: int, seed: int) -> list[Payment]:
    dice = random.Random(seed)
    payments = []
    for n in range(count):
        amount = dice.randrange(500, 20_000)
        declined = dice.random() < 0.1
        payments.append(
            Payment(
                name=f"{run}-{n}",
                api_key=api_keys[n % len(api_keys)],
                amount=amount,
                currency=dice.choice(("usd", "eur")),
                declined=declined,
                refund=None if declined or dice.random() > 0.4 else dice.randrange(1, amount + 1),
                new_customer=dice.random() < 0.5,
            )
        )
    return payments


def pay_sync(client: Any, payment: Payment) -> None:
    """Customer (sometimes), payment intent confirmed at once, refund (sometimes): each call one SDK-minted key."""
    metadata = {"op": payment.name}
    if payment.new_customer:
        customer = client.v1.customers.create(params={"email": f"{payment.name}@example.com", "metadata": metadata})
        payment.customer = customer.id
    params: dict[str, Any] = {
        "amount": payment.amount,
        "currency": payment.currency,
        "confirm": True,
        "metadata": metadata,
        "expand": ["customer"],
    }
    if payment.customer:
        params["customer"] = payment.customer
    if payment.declined:
        params["payment_method"] = "pm_card_chargeDeclined"
        with pytest.raises(stripe.CardError) as declined:
            client.v1.payment_intents.create(params=params)
        payment.intent = declined.value.json_body["error"]["payment_intent"]["id"]
        payment.intent_key = declined.value.headers["idempotency-key"]
        return
    intent = client.v1.payment_intents.create(params=params)
    assert intent.status == "succeeded"
    assert intent.customer is None or intent.customer.id == payment.customer  # expanded
    payment.intent, payment.intent_key = intent.id, intent.last_response.idempotency_key
    assert intent.last_response.request_id.startswith("req_")
    if payment.refund:
        refund = client.v1.refunds.create(
            params={"payment_intent": intent.id, "amount": payment.refund, "metadata": metadata}
        )
        payment.refund_id = refund.id


async def pay_async(client: Any, payment: Payment) -> None:
    """The same payment with the async client."""
    metadata = {"op": payment.name}
    if payment.new_customer:
        customer = await client.v1.customers.create_async(
            params={"email": f"{payment.name}@example.com", "metadata": metadata}
        )
        payment.customer = customer.id
    params: dict[str, Any] = {"amount": payment.amount, "currency": payment.currency, "metadata": metadata}
    if payment.customer:
        params["customer"] = payment.customer
    created = await client.v1.payment_intents.create_async(params=params)  # confirmed in a second call
    payment.intent = created.id
    method = "pm_card_chargeDeclined" if payment.declined else "pm_card_visa"
    if payment.declined:
        with pytest.raises(stripe.CardError) as declined:
            await client.v1.payment_intents.confirm_async(created.id, params={"payment_method": method})
        payment.intent_key = declined.value.headers["idempotency-key"]
        return
    intent = await client.v1.payment_intents.confirm_async(created.id, params={"payment_method": method})
    assert intent.status == "succeeded"
    payment.intent_key = intent.last_response.idempotency_key
    if payment.refund:
        refund = await client.v1.refunds.create_async(
            params={"payment_intent": intent.id, "amount": payment.refund, "metadata": metadata}
        )
        payment.refund_id = refund.id


@pytest.mark.slow
async def test_sdk_payments_through_a_lossy_network_take_effect_exactly_once(idempotency_database_url: str) -> None:
    """Sync and async SDK clients, SDK-minted keys, ~28 % of requests lost on the way: every payment once."""
    run = uuid.uuid4().hex[:8]
    api_keys = [new_api_key() for _ in range(2)]
    sync_payments = plan(f"{run}-sync", api_keys, 30, seed=1)
    async_payments = plan(f"{run}-async", api_keys, 30, seed=2)
    env = {"DATABASE_URL": idempotency_database_url, "PAYMENTS_POOL_SIZE": "8"}
    async with (
        ServerProcess("examples.payments.app:app", env=env) as server,
        LossyProxy(server.port, drop_rate=0.15, reset_rate=0.08, cut_rate=0.05, seed=12) as proxy,
    ):
        http = stripe.HTTPXClient(timeout=30)
        sync_clients = {key: sync_client(key, proxy.url) for key in api_keys}
        async_clients = {key: async_client(key, proxy.url, http) for key in api_keys}
        gate = asyncio.Semaphore(8)
        loop = asyncio.get_running_loop()

        async def in_turn(payment: Payment) -> None:
            async with gate:
                await pay_async(async_clients[payment.api_key], payment)

        threads = ThreadPoolExecutor(8)
        try:
            # Every payment runs to its end (return_exceptions), so none is left running when one fails; and the
            # threads are never waited for on the event loop, which must keep serving the proxy meanwhile.
            outcomes = await asyncio.wait_for(
                asyncio.gather(
                    *(loop.run_in_executor(threads, pay_sync, sync_clients[p.api_key], p) for p in sync_payments),
                    *(in_turn(p) for p in async_payments),
                    return_exceptions=True,
                ),
                timeout=240,  # proves "did not hang"; a run takes a fraction of this
            )
            failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
            if failures:
                raise failures[0]
            balances = {key: (await async_clients[key].v1.balance.retrieve_async()).available for key in api_keys}
        finally:
            threads.shutdown(wait=False, cancel_futures=True)
            await http.close_async()
        stats = proxy.stats

    payments = sync_payments + async_payments
    assert stats.dropped > 0  # the network did lose answers
    assert stats.resets > 0  # and requests
    assert stats.replays > 0  # and the SDK's retries of lost answers were answered by replays

    accounts = [account_id(key) for key in api_keys]
    connection = await asyncpg.connect(idempotency_database_url)
    try:
        stored = await connection.fetch(
            "SELECT 'customer' AS kind, id, metadata->>'op' AS op, NULL AS status FROM payments.customers"
            " WHERE account = ANY($1)"
            " UNION ALL SELECT 'payment_intent', id, metadata->>'op', status FROM payments.payment_intents"
            " WHERE account = ANY($1)"
            " UNION ALL SELECT 'refund', id, metadata->>'op', NULL FROM payments.refunds WHERE account = ANY($1)",
            accounts,
        )
        entries = await connection.fetch(
            "SELECT account, currency, amount, kind, payment_intent, idempotency_key FROM payments.ledger"
            " WHERE account = ANY($1)",
            accounts,
        )
    finally:
        await connection.close()

    # No effect twice: one object per kind and logical payment, one ledger entry per key.
    per_op = Counter((row["kind"], row["op"]) for row in stored)
    assert [entry for entry, n in per_op.items() if n > 1] == []
    keys = Counter(entry["idempotency_key"] for entry in entries)
    assert [key for key, n in keys.items() if n > 1] == []
    assert all(SDK_KEY.fullmatch(key) for key in keys)  # the SDK's own keys, as it minted them
    # None lost: every object the SDK was told of is there, and nothing is there that it was not told of.
    told = {(kind, object_id) for p in payments for kind, object_id in _objects(p)}
    assert {(row["kind"], row["id"]) for row in stored} == told
    status = {row["id"]: row["status"] for row in stored if row["kind"] == "payment_intent"}
    charges = {entry["payment_intent"]: entry for entry in entries if entry["kind"] == "charge"}
    for payment in payments:
        assert payment.intent is not None
        assert status[payment.intent] == ("requires_payment_method" if payment.declined else "succeeded")
        if payment.declined:
            assert payment.intent not in charges
        else:
            assert charges[payment.intent]["amount"] == payment.amount
            assert charges[payment.intent]["idempotency_key"] == payment.intent_key  # the key echoed back
    # Balances: what the clients were told, the ledger, and GET /v1/balance agree.
    believed: Counter[tuple[str, str]] = Counter()
    for payment in payments:
        believed[account_id(payment.api_key), payment.currency] += payment.captured
    ledger: Counter[tuple[str, str]] = Counter()
    for entry in entries:
        ledger[entry["account"], entry["currency"]] += entry["amount"]
    reported = Counter(
        {(account_id(key), b.currency): b.amount for key, available in balances.items() for b in available}
    )
    assert +believed == +ledger == +reported


def _objects(payment: Payment) -> list[tuple[str, str]]:
    found = [("payment_intent", payment.intent)]
    if payment.customer:
        found.append(("customer", payment.customer))
    if payment.refund_id:
        found.append(("refund", payment.refund_id))
    return [(kind, object_id) for kind, object_id in found if object_id]


# -- errors, headers, keys ---------------------------------------------------------------------------------------


async def in_thread(call: Callable[[], T]) -> T:
    """A blocking SDK call, off the event loop that serves the app."""
    return await asyncio.to_thread(call)


async def test_sdk_error_classes_carry_request_ids(server: str, http: Any) -> None:
    client = sync_client(new_api_key(), server)

    key = str(uuid.uuid4())
    first = await in_thread(lambda: client.v1.customers.create(params={"name": "a"}, options={"idempotency_key": key}))
    assert first.last_response.idempotency_key == key
    with pytest.raises(stripe.IdempotencyError) as reused:
        await in_thread(lambda: client.v1.customers.create(params={"name": "b"}, options={"idempotency_key": key}))
    assert reused.value.http_status == 400
    assert reused.value.json_body["error"]["type"] == "idempotency_error"
    assert reused.value.request_id.startswith("req_")

    with pytest.raises(stripe.InvalidRequestError) as small:
        await in_thread(lambda: client.v1.payment_intents.create(params={"amount": 10, "currency": "usd"}))
    assert (small.value.param, small.value.code) == ("amount", "amount_too_small")
    assert small.value.request_id.startswith("req_")
    with pytest.raises(stripe.InvalidRequestError) as unknown:
        await in_thread(lambda: client.v1.customers.list(params={"colour": "red"}))  # not a Stripe parameter
    assert (unknown.value.param, unknown.value.code) == ("colour", "parameter_unknown")

    for bad_key in ("sk_live_nope", ""):

        def retrieve(key: str = bad_key) -> Any:
            return sync_client(key, server).v1.balance.retrieve()

        with pytest.raises(stripe.AuthenticationError) as refused:
            await in_thread(retrieve)
        assert refused.value.http_status == 401
        assert refused.value.request_id.startswith("req_")
    with pytest.raises(stripe.AuthenticationError):  # the async client, the same
        await async_client("sk_live_nope", server, http).v1.customers.create_async(params={"name": "x"})

    declined_key = str(uuid.uuid4())
    params = {"amount": 1500, "currency": "usd", "confirm": True, "payment_method": "pm_card_chargeDeclined"}
    with pytest.raises(stripe.CardError) as declined:
        await in_thread(
            lambda: client.v1.payment_intents.create(params=params, options={"idempotency_key": declined_key})
        )
    assert (declined.value.code, declined.value.http_status) == ("card_declined", 402)
    assert declined.value.json_body["error"]["decline_code"] == "generic_decline"
    with pytest.raises(stripe.CardError) as again:  # a decline is an outcome: recorded, replayed
        await in_thread(
            lambda: client.v1.payment_intents.create(params=params, options={"idempotency_key": declined_key})
        )
    assert again.value.headers["idempotent-replayed"] == "true"
    assert again.value.request_id == declined.value.request_id  # a replay carries the original's id
    assert again.value.http_body == declined.value.http_body


async def test_keys_the_sdk_mints_are_never_refused_as_expired(server: str, http: Any) -> None:
    """SDK keys are random hex in UUID shape; one in 64 looks like a UUIDv7, mostly "born" long ago."""
    client = async_client(new_api_key(), server, http)
    intent = await client.v1.payment_intents.create_async(
        params={"amount": 2000, "currency": "usd", "confirm": True}, options={"idempotency_key": OLD_LOOKING_KEY}
    )
    assert intent.status == "succeeded"
    assert intent.last_response.idempotency_key == OLD_LOOKING_KEY
    again = await client.v1.payment_intents.create_async(
        params={"amount": 2000, "currency": "usd", "confirm": True}, options={"idempotency_key": OLD_LOOKING_KEY}
    )
    assert again.id == intent.id
    assert again.last_response.headers["idempotent-replayed"] == "true"
    assert again.last_response.request_id == intent.last_response.request_id

    minted = await asyncio.gather(
        *(client.v1.customers.create_async(params={"name": f"c{n}"}) for n in range(100))  # keys the SDK chose
    )
    assert len({c.id for c in minted}) == 100
    assert all(SDK_KEY.fullmatch(c.last_response.idempotency_key) for c in minted)


async def test_sdk_retries_a_409_in_progress_until_the_original_answers(
    server: str, http: Any, idempotency_database_url: str, idempotency_store: PostgresStore
) -> None:
    """A retry that meets its original still running gets 409 idempotency_key_in_use with Stripe-Should-Retry:
    true; the SDK waits and retries, and hears the original's answer, replayed."""
    api_key = new_api_key()
    port = int(server.rsplit(":", 1)[1])
    async with LossyProxy(port) as proxy:  # loses nothing: it counts the answers
        client = async_client(api_key, proxy.url, http)
        intent = await client.v1.payment_intents.create_async(
            params={"amount": 3000, "currency": "eur", "confirm": True}
        )
        key = str(uuid.uuid4())

        def refund() -> Any:
            return client.v1.refunds.create_async(
                params={"payment_intent": intent.id, "amount": 700}, options={"idempotency_key": key}
            )

        blocker = await asyncpg.connect(idempotency_database_url)
        calls: list[asyncio.Task[Any]] = []
        try:
            holding = blocker.transaction()
            await holding.start()
            await blocker.execute("SELECT FROM payments.payment_intents WHERE id = $1 FOR UPDATE", intent.id)
            original = asyncio.create_task(refund())  # claims the key, then waits for the intent's row
            calls.append(original)
            await until(lambda: _claimed(idempotency_store, account_id(api_key), key))
            retry = asyncio.create_task(refund())
            calls.append(retry)
            await until(lambda: _answered(proxy, 409))
            await holding.rollback()  # the original goes on
            first, second = await asyncio.wait_for(asyncio.gather(original, retry), timeout=60)
        finally:
            await blocker.close()  # if the test failed midway: lets the calls end
            await asyncio.wait(calls, timeout=30)
    assert second.id == first.id
    assert second.last_response.headers["idempotent-replayed"] == "true"
    assert first.last_response.request_id.startswith("req_")
    assert second.last_response.request_id == first.last_response.request_id
    assert proxy.stats.statuses[409] >= 1


async def until(condition: Callable[[], Awaitable[bool]], patience: float = 30.0) -> None:
    """Wait for ``condition``, polling; fail after ``patience`` seconds (a "did not hang" bound)."""
    for _ in range(int(patience / 0.02)):
        if await condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"still waiting after {patience}s")


async def _claimed(store: PostgresStore, tenant: str, key: str) -> bool:
    return await store.inspect(tenant, key) is not None


async def _answered(proxy: LossyProxy, status: int) -> bool:
    return proxy.stats.statuses[status] > 0


# -- expand and pagination ---------------------------------------------------------------------------------------


async def test_sdk_expands_and_pages_sync_and_async(server: str, http: Any) -> None:
    api_key = new_api_key()
    client = async_client(api_key, server, http)
    blocking = sync_client(api_key, server)
    jenny = await client.v1.customers.create_async(params={"email": "jenny@example.com"})
    created = []
    for n in range(10):  # one after the other: their order is known
        params: dict[str, Any] = {"amount": 1000 + n, "currency": "usd", "confirm": True}
        if n < 7:
            params["customer"] = jenny.id
        created.append((await client.v1.payment_intents.create_async(params=params)).id)
    newest_first = created[::-1]

    page = await in_thread(
        lambda: blocking.v1.payment_intents.list(params={"limit": 3, "customer": jenny.id, "expand": ["data.customer"]})
    )
    assert page.last_response.request_id.startswith("req_")
    theirs = await in_thread(lambda: list(page.auto_paging_iter()))  # three pages
    assert [i.id for i in theirs] == newest_first[3:]
    assert all(isinstance(i.customer, stripe.Customer) and i.customer.email == jenny.email for i in theirs)

    first = await client.v1.payment_intents.list_async(params={"limit": 4})
    assert first.has_more
    everything = [i.id async for i in first.auto_paging_iter()]
    assert everything == newest_first
    backwards = await client.v1.payment_intents.list_async(params={"limit": 2, "ending_before": created[0]})
    assert [i.id async for i in backwards.auto_paging_iter()] == created[1:]  # oldest first, going back

    customers = await client.v1.customers.list_async(params={"email": "jenny@example.com"})
    assert [c.id for c in customers.data] == [jenny.id]

    refund = await client.v1.refunds.create_async(
        params={"payment_intent": created[0], "amount": 100, "expand": ["payment_intent.customer"]}
    )
    assert refund.payment_intent.customer.id == jenny.id
    fetched = await in_thread(lambda: blocking.v1.refunds.retrieve(refund.id, params={"expand": ["payment_intent"]}))
    assert (fetched.payment_intent.id, fetched.payment_intent.customer) == (created[0], jenny.id)
    updated = await client.v1.payment_intents.update_async(
        created[1], params={"description": "order 6735", "metadata": {"order": "6735"}, "expand": ["customer"]}
    )
    assert (updated.description, updated.metadata.to_dict(), updated.customer.id) == (
        "order 6735",
        {"order": "6735"},
        jenny.id,
    )
    refunds = await in_thread(
        lambda: list(blocking.v1.refunds.list(params={"payment_intent": created[0]}).auto_paging_iter())
    )
    assert [r.id for r in refunds] == [refund.id]
