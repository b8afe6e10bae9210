"""The lease keeper: one timer renews every running handler's lease, each at a third of its own lease."""

from __future__ import annotations

import asyncio
import gc
import threading
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest

from idempotency_mw import MemoryStore
from idempotency_mw.leases import HeldLease, LeaseKeeper
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


# -- on a fake clock: what a wake looks at ----------------------------------------------------------------------


class Tick(float):
    """A loop time that counts its comparisons: the keeper compares a lease's due time to learn whether it is due."""

    comparisons = 0

    def __add__(self, other: float) -> Tick:
        return Tick(float(self) + other)

    __radd__ = __add__

    def __lt__(self, other: float) -> bool:
        Tick.comparisons += 1
        return float(self) < other

    def __le__(self, other: float) -> bool:
        Tick.comparisons += 1
        return float(self) <= other

    def __gt__(self, other: float) -> bool:
        Tick.comparisons += 1
        return float(self) > other

    def __ge__(self, other: float) -> bool:
        Tick.comparisons += 1
        return float(self) >= other


class FakeClock:
    """Stands in for the running loop's clock; the loop fires the keeper's timer once the clock reaches it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = Tick(1000.0)
        monkeypatch.setattr(asyncio.get_running_loop(), "time", lambda: self.now)

    async def advance_to(self, when: float) -> None:
        self.now = Tick(1000.0 + when)
        for _ in range(5):  # the timer fires, then the renewals it started run against the MemoryStore
            await asyncio.sleep(0)


async def hold_many(keeper: LeaseKeeper, store: MemoryStore, count: int, lease: float) -> list[HeldLease]:
    held = []
    for _ in range(count):
        key, fence = await claimed(store, lease)
        held.append(keeper.hold("t", key, fence, lease))
    return held


async def test_a_wake_looks_only_at_the_leases_that_are_due(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock(monkeypatch)
    store = CountingStore()
    keeper = LeaseKeeper(store)
    due_first = await hold_many(keeper, store, 3, 3.0)  # due at 1.0
    await clock.advance_to(0.5)
    later = await hold_many(keeper, store, 3000, 3.0)  # same duration, held later: due at 1.5
    longer = await hold_many(keeper, store, 3000, 300.0)  # another duration: due at 100
    Tick.comparisons = 0
    await clock.advance_to(1.0)
    assert sorted(store.renewals) == sorted(held.key for held in due_first)  # the three due, and only them
    assert Tick.comparisons < 60  # 6,003 leases held: a scan would compare each at least once

    Tick.comparisons = 0
    await clock.advance_to(1.5)
    assert len(store.renewals) == 3 + 3000
    assert Tick.comparisons < 3000 * 3  # proportional to the leases due
    for held in due_first + later + longer:
        keeper.drop(held)


async def test_renewed_leases_come_due_again_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock(monkeypatch)
    store = CountingStore()
    keeper = LeaseKeeper(store)
    first, second = await hold_many(keeper, store, 2, 3.0)  # both due at 1.0, then every second
    await clock.advance_to(0.5)
    (third,) = await hold_many(keeper, store, 1, 3.0)  # due at 1.5, 2.5, ...
    for step in range(1, 7):
        await clock.advance_to(step / 2)
    assert store.renewals == {first.key: 3, second.key: 3, third.key: 2}  # at 1, 2, 3 and at 1.5, 2.5
    keeper.drop(second)
    await clock.advance_to(3.5)
    await clock.advance_to(4.0)
    assert store.renewals == {first.key: 4, second.key: 3, third.key: 3}


class FlakyStore(CountingStore):
    """Fails the first renewal of every key, as an unreachable database would."""

    async def renew(self, tenant: str, key: str, fence: int, *, lease: float) -> bool:
        if key not in self.renewals:
            self.renewals[key] = 1
            raise ConnectionError("database unreachable")
        return await super().renew(tenant, key, fence, lease=lease)


async def test_a_failed_renewal_is_tried_again_at_the_next_beat(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock(monkeypatch)
    store = FlakyStore()
    keeper = LeaseKeeper(store)
    (held,) = await hold_many(keeper, store, 1, 3.0)
    await clock.advance_to(1.0)  # fails
    await clock.advance_to(2.0)  # renewed
    assert store.renewals == {held.key: 2}
    record = await store.inspect("t", held.key)
    assert record is not None
    assert record.state == "in_progress"
    keeper.drop(held)


async def test_a_lease_taken_over_is_dropped_without_disturbing_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock(monkeypatch)
    store = CountingStore()
    keeper = LeaseKeeper(store)
    lost, kept = await hold_many(keeper, store, 2, 3.0)
    await store.forget("t", lost.key)  # as after a takeover: its renewal is refused
    for step in range(1, 4):
        await clock.advance_to(step)
    assert store.renewals == {lost.key: 1, kept.key: 3}
    keeper.drop(lost)  # the request ends later: dropping a lease the keeper already let go is harmless
    keeper.drop(kept)


def test_another_event_loop_starts_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    store = CountingStore()
    keeper = LeaseKeeper(store)
    ended: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def hold_and_leave() -> str:
        (held,) = await hold_many(keeper, store, 1, 3.0)
        ended.append(weakref.ref(asyncio.get_running_loop()))
        return held.key  # never dropped: its loop ends with it (a server stopped mid-request)

    async def hold_and_beat() -> HeldLease:
        clock = FakeClock(monkeypatch)
        (held,) = await hold_many(keeper, store, 1, 3.0)
        await clock.advance_to(1.0)
        keeper.drop(held)
        return held

    abandoned = asyncio.run(hold_and_leave())
    current = asyncio.run(hold_and_beat())
    assert store.renewals == {current.key: 1}  # the lease of the loop that ended is not carried over
    assert abandoned not in store.renewals
    gc.collect()
    assert ended[0]() is None  # nor kept: the keeper let go of the closed loop and what it held there


class ThreadedRenewals(MemoryStore):
    """Records each renewal with the thread that made it; holds no claims (renewals from two threads at once)."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.renewals: dict[str, list[int]] = {}

    async def renew(self, tenant: str, key: str, fence: int, *, lease: float) -> bool:
        with self.lock:
            self.renewals.setdefault(key, []).append(threading.get_ident())
        return True


def test_leases_held_on_two_event_loops_are_each_kept_alive() -> None:
    """One middleware served from two event loops (two threads, each running a server): holding a lease on one
    loop must not wipe the other's, or that lease lapses while its handler runs and a retry runs it again."""
    store = ThreadedRenewals()
    keeper = LeaseKeeper(store)
    both_held = threading.Barrier(2, timeout=5)

    async def hold_for_a_while(key: str) -> int:
        held = keeper.hold("t", key, 1, 0.3)  # renewed every 0.1 s
        await asyncio.to_thread(both_held.wait)  # the other loop holds its own before this one sleeps
        await asyncio.sleep(0.75)
        keeper.drop(held)
        return threading.get_ident()

    with ThreadPoolExecutor(2) as threads:
        running = {key: threads.submit(asyncio.run, hold_for_a_while(key)) for key in ("first", "second")}
        thread_of = {key: future.result(timeout=10) for key, future in running.items()}
    for key, thread in thread_of.items():
        assert len(store.renewals.get(key, [])) >= 4  # about seven beats in 0.75 s; before, one loop had none
        assert set(store.renewals[key]) == {thread}  # each renewed on its own loop


class SlowRenewStore(MemoryStore):
    """A renewal that waits on the test: room for the request to end (complete its record) meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.renewing = asyncio.Event()
        self.go = asyncio.Event()

    async def renew(self, tenant: str, key: str, fence: int, *, lease: float) -> bool:
        self.renewing.set()
        await self.go.wait()
        return await super().renew(tenant, key, fence, lease=lease)


async def test_a_renewal_on_its_way_when_the_request_ends_is_neither_cancelled_nor_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The record completed while its renewal waited (in transactional mode, on the row lock of the commit): the
    renewal then finds no claim in progress. That is no takeover to warn about, and cancelling the renewal would
    have cost its connection."""
    from idempotency_mw import StoredResponse

    store = SlowRenewStore()
    keeper = LeaseKeeper(store)
    key, fence = await claimed(store, 0.3)
    held = keeper.hold("t", key, fence, 0.3)
    await asyncio.wait_for(store.renewing.wait(), 5)
    assert await store.complete("t", key, fence, StoredResponse(201, [], b"done", 4))
    keeper.drop(held)
    renewal = held.renewal
    assert renewal is not None
    with caplog.at_level("WARNING", logger="idempotency_mw"):
        store.go.set()
        await asyncio.wait_for(renewal, 5)
    assert not renewal.cancelled()
    assert "taken over" not in caplog.text
