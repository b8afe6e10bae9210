"""claims.py: a claim that is this request's: its lease renewed while the handler runs, then completed with the
final answer (or, when the store refuses the response itself, without it) or released; and what each outcome is
when the store fails."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from idempotency_mw import MemoryStore
from idempotency_mw.claims import OwnedClaim, store_failure
from idempotency_mw.events import Outcome, Report
from idempotency_mw.failures import FailureLog
from idempotency_mw.leases import LeaseKeeper
from idempotency_mw.store import ClaimOutcome, PoolExhausted, StoredResponse, StoreUnavailable

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


async def owned(store: MemoryStore, key: str = "k", *, lease: float = 30) -> tuple[OwnedClaim, Report]:
    claim = await store.claim("t", key, FINGERPRINT, lease=lease, ttl=60)
    assert claim.outcome is ClaimOutcome.OWNED
    report = Report(None, "POST", "/charges", "/charges")
    failures = FailureLog(logging.getLogger("idempotency_mw"))
    leases = LeaseKeeper(store, failures)
    return OwnedClaim(
        store, "t", key, claim.fence, lease=lease, leases=leases, failures=failures, report=report
    ), report


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
