"""MemoryStore's expiry: memory follows the live records, and no claim pays for the records that are not expiring."""

from __future__ import annotations

from idempotency_mw import MemoryStore, StoredResponse
from idempotency_mw.store import ClaimOutcome

FP = b"f" * 32


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_an_expired_record_is_gone_by_the_next_claim() -> None:
    clock = Clock()
    store = MemoryStore(clock=clock)
    first = await store.claim("t", "old", FP, lease=5, ttl=10)
    assert await store.complete("t", "old", first.fence, StoredResponse(201, [], b"done", 4))
    clock.now += 11
    await store.claim("t", "new", FP, lease=5, ttl=10)
    assert len(store) == 1
    assert await store.inspect("t", "old") is None


async def test_a_record_kept_past_its_first_expiry_by_its_lease_stays() -> None:
    clock = Clock()
    store = MemoryStore(clock=clock)
    held = await store.claim("t", "slow", FP, lease=5, ttl=10)
    clock.now += 4
    assert await store.renew("t", "slow", held.fence, lease=20)  # now expires at +24, not +10
    clock.now += 7  # +11: past the first expiry
    await store.claim("t", "other", FP, lease=5, ttl=10)
    assert len(store) == 2
    clock.now += 14  # +25: past the renewed expiry too
    await store.claim("t", "another", FP, lease=5, ttl=10)
    assert await store.inspect("t", "slow") is None
    assert len(store) == 1


async def test_a_key_forgotten_and_claimed_again_lives_by_its_new_expiry() -> None:
    clock = Clock()
    store = MemoryStore(clock=clock)
    await store.claim("t", "k", FP, lease=5, ttl=10)
    assert await store.forget("t", "k")
    clock.now += 5
    again = await store.claim("t", "k", FP, lease=5, ttl=10)  # expires at +15
    clock.now += 6  # +11: the first claim's expiry has passed, not this one's
    assert await store.purge_expired() == 0
    info = await store.inspect("t", "k")
    assert info is not None
    assert info.fence == again.fence


async def test_a_claim_says_when_its_record_expires() -> None:
    """A claim that is the request's, and one that replays, carry the record's expiry (the Idempotency-Expires
    header): a lease taken over keeps the record's first expiry, not a new ttl from now."""
    clock = Clock()
    store = MemoryStore(clock=clock)
    fresh = await store.claim("t", "k", FP, lease=5, ttl=10)
    assert fresh.expires_at == 1010.0
    clock.now += 6  # the lease lapsed: the retry takes it over, and the record still expires at +10
    taken = await store.claim("t", "k", FP, lease=5, ttl=10)
    assert (taken.outcome, taken.expires_at) == (ClaimOutcome.OWNED, 1011.0)  # moved past the new lease only
    assert await store.complete("t", "k", taken.fence, StoredResponse(201, [], b"done", 4))
    replay = await store.claim("t", "k", FP, lease=5, ttl=10)
    info = await store.inspect("t", "k")
    assert info is not None
    assert (replay.outcome, replay.expires_at) == (ClaimOutcome.COMPLETED, info.expires_at)
    clock.now += 1
    assert (await store.claim("t", "k", b"o" * 32, lease=5, ttl=10)).expires_at is None  # a 422 tells nothing


async def test_purge_takes_at_most_a_batch_and_the_oldest_first() -> None:
    clock = Clock()
    store = MemoryStore(clock=clock)
    for n in range(5):
        await store.claim("t", f"k{n}", FP, lease=1, ttl=10 + n)
    clock.now += 100
    assert await store.purge_expired(batch_size=2) == 2
    assert [await store.inspect("t", f"k{n}") is None for n in range(5)] == [True, True, False, False, False]
    assert await store.purge_expired(batch_size=10) == 3
    assert len(store) == 0


async def test_keys_released_and_claimed_again_do_not_pile_up_expiries() -> None:
    """A retry storm on a transient failure claims and releases one key over and over within its ttl: each claim
    leaves an expiry behind, and memory must still follow the live records, not the claims of the last day."""
    store = MemoryStore(clock=Clock())
    for _ in range(10_000):
        claim = await store.claim("t", "flaky", FP, lease=5, ttl=86_400)
        assert await store.release("t", "flaky", claim.fence)
    await store.claim("t", "live", FP, lease=5, ttl=86_400)
    assert len(store) == 1
    assert len(store._expiries) <= 2 * len(store) + MemoryStore.SPARE_EXPIRIES


async def test_inspect_shows_the_request_and_counts_replays_at_once() -> None:
    """MemoryStore counts each replay as it happens (PostgresStore writes them in batches)."""
    store = MemoryStore()
    claim = await store.claim("t", "k", b"f" * 32, lease=30, ttl=60, request="POST /v1/charges")
    assert await store.complete("t", "k", claim.fence, StoredResponse(201, [], b"{}", 2))
    for _ in range(2):
        assert (await store.claim("t", "k", b"f" * 32, lease=30, ttl=60)).outcome is ClaimOutcome.COMPLETED
    record = await store.inspect("t", "k")
    assert record is not None
    assert (record.request, record.replays, record.attempts) == ("POST /v1/charges", 2, 0)
    assert record.last_replayed_at is not None
