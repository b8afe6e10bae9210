"""A claim that is this request's: its lease renewed while the handler runs, then completed with the final answer,
or released so that the retry runs afresh; once, whatever happens to the request meanwhile."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

from idempotency_mw.events import Outcome, Report
from idempotency_mw.failures import FailureLog
from idempotency_mw.leases import HeldLease, LeaseKeeper
from idempotency_mw.store import PoolExhausted, Store, StoredResponse, StoreUnavailable

T = TypeVar("T")


class OwnedClaim:
    def __init__(
        self,
        store: Store,
        tenant: str,
        key: str,
        fence: int,
        *,
        lease: float,
        leases: LeaseKeeper,
        failures: FailureLog,
        report: Report,
    ) -> None:
        self.store, self.tenant, self.key, self.fence = store, tenant, key, fence
        self._failures = failures
        self._report = report
        self._leases = leases
        self._lease: HeldLease | None = leases.hold(tenant, key, fence, lease)

    def drop_lease(self) -> None:
        """The handler is done (its answer settles now): stop renewing."""
        if self._lease is not None:
            self._leases.drop(self._lease)
            self._lease = None

    async def complete(self, response: StoredResponse) -> Outcome:
        """Record the final answer: EXECUTED, or FENCED_OUT when a newer claim owns the key."""
        self.drop_lease()
        try:
            try:
                completed = await self._timed(self.store.complete(self.tenant, self.key, self.fence, response))
            except StoreUnavailable:
                raise
            except Exception as refused:
                # The database refused the response itself (a header it cannot hold). The effect has happened: the
                # key completes all the same, without a response to replay, rather than run again after its lease.
                self._failures.failed("store a response (the key completes without it)", refused)
                unreplayable = response.unreplayable()
                completed = await self._timed(self.store.complete(self.tenant, self.key, self.fence, unreplayable))
        except Exception as error:
            # The client has its response; the claim stays until its lease lapses, then a retry runs again.
            self._failures.failed("record a completed response", error)
            return store_failure(error)
        return Outcome.EXECUTED if completed else Outcome.FENCED_OUT

    async def release(self) -> Outcome:
        """Free the key for the retry (FENCED_OUT when it was no longer this claim's to free). Shielded: it must happen
        even when the request was cancelled."""
        self.drop_lease()
        try:
            released = await asyncio.shield(self._timed(self.store.release(self.tenant, self.key, self.fence)))
        except Exception as error:
            self._failures.failed("release a key (it frees itself when its lease lapses)", error)
            return store_failure(error)
        return Outcome.RELEASED if released else Outcome.FENCED_OUT

    async def _timed(self, operation: Awaitable[T]) -> T:
        started = time.perf_counter()
        try:
            return await operation
        finally:
            self._report.store_seconds += time.perf_counter() - started


def store_failure(error: BaseException) -> Outcome:
    """An exhausted pool is its own outcome: the fix is a larger ``max_size``, not the database team."""
    return Outcome.POOL_EXHAUSTED if isinstance(error, PoolExhausted) else Outcome.STORE_ERROR
