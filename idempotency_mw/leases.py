"""Keeping the leases of running handlers alive, from one timer per middleware.

A claim holds its key for ``lease`` seconds. While the handler runs, the lease is renewed every third of that, so
a slow handler keeps its key and a crashed one frees it soon. One :class:`LeaseKeeper` serves every request of a
middleware: a request registers its claim and unregisters it when it ends (a set insertion and removal), and
the keeper's single timer wakes when the earliest renewal is due. Most requests end long before that and never
cost a timer, a task or a store call of their own.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass

from idempotency_mw.events import hash_key
from idempotency_mw.store import Store

logger = logging.getLogger("idempotency_mw")


@dataclass(eq=False, slots=True)
class HeldLease:
    """One claim in flight (compared by identity: two claims are never the same one)."""

    tenant: str
    key: str
    fence: int
    lease: float
    due: float  # loop time of the next renewal
    renewal: asyncio.Task[None] | None = None


class LeaseKeeper:
    def __init__(self, store: Store) -> None:
        self._store = store
        self._loop: asyncio.AbstractEventLoop | None = None
        self._held: set[HeldLease] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._wake_at = math.inf

    def hold(self, tenant: str, key: str, fence: int, lease: float) -> HeldLease:
        """Renew this claim's lease until :meth:`drop` is called with what this returns."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # another event loop (a test, a server restarted in process): start afresh
            self._loop, self._held, self._timer, self._wake_at = loop, set(), None, math.inf
        held = HeldLease(tenant, key, fence, lease, loop.time() + lease / 3)
        self._held.add(held)
        if held.due < self._wake_at:
            self._arm(held.due)
        return held

    def drop(self, held: HeldLease) -> None:
        """The request has ended: stop renewing. The timer is left to lapse; it costs one idle wake at most."""
        self._held.discard(held)
        if held.renewal is not None:
            held.renewal.cancel()

    def _arm(self, when: float) -> None:
        assert self._loop is not None
        if self._timer is not None:
            self._timer.cancel()
        self._wake_at = when
        self._timer = self._loop.call_at(when, self._wake)

    def _wake(self) -> None:
        assert self._loop is not None
        self._timer, self._wake_at = None, math.inf
        now = self._loop.time()
        earliest = math.inf
        for held in self._held:
            if held.due <= now:
                held.due = now + held.lease / 3
                if held.renewal is None or held.renewal.done():
                    held.renewal = self._loop.create_task(self._renew(held))
            earliest = min(earliest, held.due)
        if earliest < math.inf:
            self._arm(earliest)

    async def _renew(self, held: HeldLease) -> None:
        try:
            if not await self._store.renew(held.tenant, held.key, held.fence, lease=held.lease):
                logger.warning("idempotency lease of key %s was taken over", hash_key(held.key))
                self._held.discard(held)
        except Exception:  # the store is unreachable for now: the next beat tries again
            logger.warning("idempotency lease renewal failed; retrying", exc_info=True)
