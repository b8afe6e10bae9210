"""claims.py: a claim that is this request's: its lease renewed while the handler runs, then completed with the
final answer (or, when the store refuses the response itself, without it) or released; and what each outcome is
when the store fails.

The lease keeper: one timer renews every running handler's lease, each at a third of its own lease.

eager.py: the claim's and the settlement's own tasks, started eagerly where Python can, and waited for through a
cancellation of the request that leaves them running (``outlasting``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from idempotency_mw import MemoryStore
from idempotency_mw._claim import Ask, HeldLease, LeaseKeeper, OwnedClaim, outlasting, start_eagerly, store_failure
from idempotency_mw._events import FailureLog, Outcome
from idempotency_mw.store import (
    ClaimOutcome,
    PoolExhausted,
    RecordInfo,
    StoredResponse,
    StoreUnavailable,
    UnknownKeyId,
)

RESPONSE = StoredResponse(201, [(b"content-type", b"application/json")], b'{"id": 1}', 9)
FINGERPRINT = b"f" * 32


class Refusing(MemoryStore):
    """A store that refuses what the test says: a response with headers (as a database refuses a NUL in a header),
    or every completion and release (a database that is down)."""

    def __init__(self, *, headers: bool = False, down: BaseException | None = None) -> None:
        super().__init__()
        self.refuse_headers = headers
        self.down = down
        self.completed: list[StoredResponse] = []

    async def complete(self, tenant: str, key: str, fence: int, response: StoredResponse) -> bool:
        if self.down is not None:
            raise self.down
        if self.refuse_headers and response.headers:
            raise ValueError("unsupported Unicode escape sequence")
        self.completed.append(response)
        return await super().complete(tenant, key, fence, response)

    async def release(self, tenant: str, key: str, fence: int) -> bool:
        if self.down is not None:
            raise self.down
        return await super().release(tenant, key, fence)


async def owned(store: MemoryStore, key: str = "k", *, lease: float = 30) -> tuple[OwnedClaim, OwnedClaim]:
    """The claim of ``key``, twice: the claim, and where its store time is told (the claim itself)."""
    claim = await store.claim("t", key, FINGERPRINT, lease=lease, ttl=60)
    assert claim.outcome is ClaimOutcome.OWNED
    failures = FailureLog(logging.getLogger("idempotency_mw"))
    leases = LeaseKeeper(store, failures)
    ours = OwnedClaim(store, "t", key, claim.fence, lease=lease, leases=leases, failures=failures)
    return ours, ours


async def test_completing_records_the_answer_and_times_the_store() -> None:
    store = MemoryStore()
    claim, report = await owned(store)
    assert await claim.complete(RESPONSE) is Outcome.EXECUTED
    info = await store.inspect("t", "k")
    assert info is not None
    assert (info.state, info.response) == ("completed", RESPONSE)
    assert report.store_seconds > 0


async def test_a_claim_taken_over_meanwhile_is_fenced_out() -> None:
    store = MemoryStore()
    claim, _ = await owned(store, lease=0.05)
    claim.drop_lease()  # a handler that stalled: nothing renews its lease
    await asyncio.sleep(0.1)
    takeover = await store.claim("t", "k", FINGERPRINT, lease=30, ttl=60)
    assert takeover.outcome is ClaimOutcome.OWNED
    assert await claim.complete(RESPONSE) is Outcome.FENCED_OUT
    assert await claim.release() is Outcome.FENCED_OUT  # refused by the fence: the takeover's record stays
    info = await store.inspect("t", "k")
    assert info is not None
    assert (info.state, info.fence) == ("in_progress", takeover.fence)


async def test_a_response_the_store_refuses_completes_the_key_without_it(caplog: pytest.LogCaptureFixture) -> None:
    """The effect has happened: the key completes all the same, with the status and size only, rather than stay in
    progress and run again once its lease lapses."""
    store = Refusing(headers=True)
    claim, _ = await owned(store)
    assert await claim.complete(RESPONSE) is Outcome.EXECUTED
    assert store.completed == [RESPONSE.unreplayable()]
    assert "the key completes without it" in caplog.text


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        (StoreUnavailable("connection refused"), Outcome.STORE_ERROR),
        (PoolExhausted("the pool", max_size=2, timeout=0.5), Outcome.POOL_EXHAUSTED),
        (OSError("connection reset"), Outcome.STORE_ERROR),
    ],
)
async def test_a_store_that_fails_to_complete_or_release_says_how(error: BaseException, outcome: Outcome) -> None:
    store = Refusing(down=error)
    claim, _ = await owned(store)
    assert await claim.complete(RESPONSE) is outcome
    assert await claim.release() is outcome
    assert store_failure(error) is outcome


async def test_a_release_goes_on_through_a_cancellation_of_the_request() -> None:
    released = asyncio.Event()

    class SlowRelease(MemoryStore):
        async def release(self, tenant: str, key: str, fence: int) -> bool:
            await asyncio.sleep(0.05)
            done = await super().release(tenant, key, fence)
            released.set()
            return done

    store = SlowRelease()
    claim, _ = await owned(store)
    releasing = asyncio.create_task(claim.release())
    await asyncio.sleep(0.01)
    releasing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await releasing
    await asyncio.wait_for(released.wait(), 5)
    assert await store.inspect("t", "k") is None


async def test_the_lease_is_renewed_until_the_claim_settles(monkeypatch: pytest.MonkeyPatch) -> None:
    renewals: list[str] = []
    store = MemoryStore()
    renew = store.renew

    async def counted(*args: Any, **kwargs: Any) -> bool:
        renewals.append("renewed")
        return await renew(*args, **kwargs)

    monkeypatch.setattr(store, "renew", counted)
    claim, _ = await owned(store, lease=0.3)
    await asyncio.sleep(0.35)  # a renewal every 0.1 s
    assert renewals
    assert await claim.complete(RESPONSE) is Outcome.EXECUTED
    seen = len(renewals)
    await asyncio.sleep(0.25)
    assert len(renewals) == seen  # settled: no more renewals


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


async def test_a_settlement_that_never_waits_is_done_at_once_where_tasks_start_eagerly() -> None:
    ran: list[str] = []

    async def settle() -> None:
        ran.append("settled")

    settling = start_eagerly(settle(), "settle")
    assert ran == ["settled"]  # run in the caller's turn, before anything else could (by hand on Python 3.11)
    assert settling.done()
    await settling
    assert ran == ["settled"]


async def test_a_settlement_that_waits_goes_on_in_a_task_of_its_own_through_a_cancellation() -> None:
    gate, steps = asyncio.Event(), []

    async def settle() -> None:
        steps.append("sent")
        await gate.wait()
        await asyncio.sleep(0)
        steps.append("written")

    async def request() -> None:
        await outlasting(start_eagerly(settle(), "settle"))

    task = asyncio.create_task(request())
    for _ in range(3):
        await asyncio.sleep(0)
    assert steps == ["sent"]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gate.set()
    for _ in range(10):
        await asyncio.sleep(0)
    assert steps == ["sent", "written"]


async def test_a_timeout_inside_the_task_cancels_the_task_not_the_request() -> None:
    """asyncio.timeout captures the current task. An earlier 3.11 emulation of eager start drove the coroutine by
    hand in the request's task up to its first wait, so a timeout entered before that wait (the store's pool,
    waiting for a connection) later cancelled the request instead: a busy pool gave a CancelledError, not a 503.
    The emulation now takes that step with the claim's own task current."""

    async def claim() -> str:
        try:
            async with asyncio.timeout(0.05):
                await asyncio.Event().wait()
        except TimeoutError:
            return "timed out"
        return "never"

    async def request() -> str:
        result = await outlasting(start_eagerly(claim(), "claim"))
        await asyncio.sleep(0.1)  # the request goes on: nothing cancels it
        return result

    assert await asyncio.wait_for(request(), 5) == "timed out"


async def test_an_eager_task_passes_on_errors_and_its_own_cancellation() -> None:
    async def fails_after_a_wait() -> None:
        await asyncio.sleep(0)
        raise RuntimeError("the store refused")

    with pytest.raises(RuntimeError, match="the store refused"):
        await start_eagerly(fails_after_a_wait(), "fails")

    cleaned_up: list[bool] = []

    async def waits_forever() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cleaned_up.append(True)

    settling = start_eagerly(waits_forever(), "waits")
    await asyncio.sleep(0)
    settling.cancel()  # the settlement itself cancelled (the loop closing): it sees the cancellation
    with pytest.raises(asyncio.CancelledError):
        await settling
    assert cleaned_up == [True]


async def test_an_eager_task_cancelled_before_its_first_turn_cancels_the_coroutine_where_it_waits() -> None:
    """Cancelled in the turn that started it (a loop closing, a server cancelling every task), the task throws the
    cancellation into the coroutine where its first step left it, as Python 3.12's eager tasks do: its cleanup runs
    then, not whenever the collector finds the abandoned coroutine."""
    seen: list[str] = []

    async def waits_forever() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen.append("cancelled where it waited")
            raise
        finally:
            seen.append("cleaned up")

    settling = start_eagerly(waits_forever(), "waits")
    settling.cancel()
    with pytest.raises(asyncio.CancelledError):
        await settling
    assert seen == ["cancelled where it waited", "cleaned up"]

    waited_on = asyncio.get_running_loop().create_future()

    async def waits_on_a_future() -> None:
        await waited_on

    settling = start_eagerly(waits_on_a_future(), "waits on a future")
    settling.cancel()
    with pytest.raises(asyncio.CancelledError):
        await settling
    assert waited_on.cancelled()  # as a task's cancel() cancels the future it waits on (a statement's, say)


async def test_outlasting_passes_on_what_the_task_ends_with() -> None:
    async def answers() -> str:
        await asyncio.sleep(0)
        return "claimed"

    async def fails() -> None:
        await asyncio.sleep(0)
        raise RuntimeError("the store refused")

    async def is_cancelled() -> None:
        asyncio.current_task().cancel()  # type: ignore[union-attr]
        await asyncio.sleep(0)

    assert await outlasting(start_eagerly(answers(), "answers")) == "claimed"
    with pytest.raises(RuntimeError, match="the store refused"):
        await outlasting(start_eagerly(fails(), "fails"))
    with pytest.raises(asyncio.CancelledError):
        await outlasting(start_eagerly(is_cancelled(), "cancelled"))
    done = start_eagerly(answers(), "done")
    await done
    assert outlasting(done) is done  # nothing left to wait for: no follower, no callback


async def test_a_cancelled_wait_leaves_the_task_running_and_its_error_to_its_owner(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gate = asyncio.Event()

    async def store_call() -> None:
        await gate.wait()
        raise RuntimeError("the store refused")

    task = start_eagerly(store_call(), "store call")
    waiting = asyncio.ensure_future(outlasting(task))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert not task.done()  # the request's cancellation did not reach the task
    gate.set()
    for _ in range(5):
        await asyncio.sleep(0)
    assert task.done()
    with pytest.raises(RuntimeError, match="the store refused"):
        task.result()  # the owner still reads it (IdempotentRequest._abandon does)

    # An owner that does not read it: the error is its to handle, and asyncio does not log it as lost.
    gate.clear()
    unread = start_eagerly(store_call(), "unread")
    waiting = asyncio.ensure_future(outlasting(unread))
    await asyncio.sleep(0)
    waiting.cancel()
    gate.set()
    for _ in range(5):
        await asyncio.sleep(0)
    assert unread.done()
    assert waiting.cancelled()
    del unread, waiting
    gc.collect()
    assert "never retrieved" not in caplog.text


class Unreadable(MemoryStore):
    """A store whose look under another tenant fails: a record there that does not open, or the store gone."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error

    async def inspect(self, tenant: str, key: str) -> RecordInfo | None:
        raise self.error


@pytest.mark.parametrize(
    "error", [UnknownKeyId("2026-06", ("2026-11",)), StoreUnavailable("down")], ids=["unknown key id", "unavailable"]
)
async def test_a_fresh_claim_is_released_when_looking_under_the_other_tenant_fails(error: BaseException) -> None:
    """The look under the other secret of a rotation (or a route's older namespace) fails after the fresh claim was
    taken: the error goes on, and the claim is released rather than left to answer 409 until its lease lapses."""
    store = Unreadable(error)
    ask = Ask(key="k", tenant="t", owner="t", others=("t-old",), digests=(FINGERPRINT,))
    with pytest.raises(type(error)):
        await ask.claim(store, store, lease=30, ttl=60)
    retry = await store.claim("t", "k", FINGERPRINT, lease=30, ttl=60)
    assert retry.outcome is ClaimOutcome.OWNED


async def test_a_fresh_claim_is_released_when_looking_for_what_an_earlier_package_recorded_fails() -> None:
    store = MemoryStore()
    ask = Ask(key="k", tenant="t", owner="t", digests=(FINGERPRINT,))

    async def earlier(key: str) -> None:
        raise OSError("connection reset")

    with pytest.raises(OSError, match="connection reset"):
        await ask.claim(store, store, lease=30, ttl=60, earlier=earlier)
    assert (await store.claim("t", "k", FINGERPRINT, lease=30, ttl=60)).outcome is ClaimOutcome.OWNED
