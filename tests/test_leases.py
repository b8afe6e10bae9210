"""The lease keeper: one timer renews every running handler's lease, each at a third of its own lease."""

from __future__ import annotations

import asyncio
import uuid

from idempotency_mw import MemoryStore
from idempotency_mw.leases import LeaseKeeper
from idempotency_mw.store import ClaimOutcome


class CountingStore(MemoryStore):
    """A MemoryStore that counts renewals per key."""

    def __init__(self) -> None:
        super().__init__()
        self.renewals: dict[str, int] = {}

    async def renew(self, tenant: str, key: str, fence: int, *, lease: float) -> bool:
        self.renewals[key] = self.renewals.get(key, 0) + 1
        return await super().renew(tenant, key, fence, lease=lease)


async def claimed(store: MemoryStore, lease: float) -> tuple[str, int]:
    key = str(uuid.uuid4())
    claim = await store.claim("t", key, b"f" * 32, lease=lease, ttl=60)
    assert claim.outcome is ClaimOutcome.OWNED
    return key, claim.fence


async def test_claims_with_different_leases_are_each_kept_alive() -> None:
    store = CountingStore()
    keeper = LeaseKeeper(store)
    long_key, long_fence = await claimed(store, 3.0)
    short_key, short_fence = await claimed(store, 0.3)
    long_held = keeper.hold("t", long_key, long_fence, 3.0)  # arms the timer for 1 s from now
    short_held = keeper.hold("t", short_key, short_fence, 0.3)  # due sooner: the timer is moved forward
    await asyncio.sleep(0.75)  # two and a half short leases
    assert store.renewals.get(short_key, 0) >= 3  # every 0.1 s
    assert long_key not in store.renewals  # not due yet
    short_record = await store.inspect("t", short_key)
    assert short_record is not None
    assert short_record.state == "in_progress"
    retry = await store.claim("t", short_key, b"f" * 32, lease=0.3, ttl=60)
    assert retry.outcome is ClaimOutcome.IN_PROGRESS  # still held: a retry gets its 409
    keeper.drop(short_held)
    keeper.drop(long_held)
    renewed = dict(store.renewals)
    await asyncio.sleep(0.35)
    assert store.renewals == renewed  # dropped claims are not renewed again


async def test_a_claim_taken_over_is_no_longer_renewed() -> None:
    store = CountingStore()
    keeper = LeaseKeeper(store)
    key, fence = await claimed(store, 0.3)
    keeper.hold("t", key, fence, 0.3)
    await store.forget("t", key)  # the record is gone (as after a takeover): the renewal is refused
    await asyncio.sleep(0.25)
    assert store.renewals[key] == 1  # refused once, then left alone
    await asyncio.sleep(0.25)
    assert store.renewals[key] == 1
