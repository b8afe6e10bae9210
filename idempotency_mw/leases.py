"""Keeping the leases of running handlers alive, from one timer per middleware.

A claim holds its key for ``lease`` seconds. While the handler runs, the lease is renewed every third of that, so
a slow handler keeps its key and a crashed one frees it soon. One :class:`LeaseKeeper` serves every request of a
middleware: a request registers its claim and unregisters it when it ends, and the keeper's single timer wakes
when the earliest renewal is due. Most requests end long before that and never cost a timer, a task or a store
call of their own.

Leases of one duration come due in the order they were held or last renewed, so the keeper keeps one queue per
duration (an insertion-ordered dict: holding appends, renewing moves to the back, dropping removes, each O(1)).
A wake takes the due leases from the fronts of the queues and stops at the first that is not due: its cost is the
number of leases due plus one look per duration, however many handlers are running.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import OrderedDict
from dataclasses import dataclass

from idempotency_mw.events import hash_key
from idempotency_mw.failures import FailureLog
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
    dropped: bool = False  # the request has ended: a renewal still on its way changes nothing and says nothing


class LeaseKeeper:
    def __init__(self, store: Store, failures: FailureLog | None = None) -> None:
        self._store = store
        self._failures = failures if failures is not None else FailureLog(logger)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[float, OrderedDict[HeldLease, None]] = {}  # lease duration -> leases, earliest due first
        self._timer: asyncio.TimerHandle | None = None
        self._wake_at = math.inf

    def hold(self, tenant: str, key: str, fence: int, lease: float) -> HeldLease:
        """Renew this claim's lease until :meth:`drop` is called with what this returns."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # another event loop (a test, a server restarted in process): start afresh
            self._loop, self._queues, self._timer, self._wake_at = loop, {}, None, math.inf
        held = HeldLease(tenant, key, fence, lease, loop.time() + lease / 3)
        queue = self._queues.get(lease)
        if queue is None:  # one queue per duration a route configures, kept for the life of the loop
            queue = self._queues[lease] = OrderedDict()
        queue[held] = None  # due last among the leases of its duration
        if held.due < self._wake_at:
            self._arm(held.due)
        return held

    def drop(self, held: HeldLease) -> None:
        """The request has ended: stop renewing. The timer is left to lapse; it costs one idle wake at most.

        A renewal already on its way is left to finish rather than cancelled: cancelling a statement in flight
        costs its connection, and the renewal is harmless (fenced, and a completed record is never renewed)."""
        held.dropped = True
        self._forget(held)

    def _forget(self, held: HeldLease) -> None:
        queue = self._queues.get(held.lease)
        if queue is not None:
            queue.pop(held, None)

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
        for lease, queue in self._queues.items():
            for _ in range(len(queue)):  # each lease once at most, even one so short that it is due again at once
                held = next(iter(queue))
                if held.due > now:
                    break
                held.due = now + lease / 3
                queue.move_to_end(held)  # renewed now: due after every other lease of this duration
                if held.renewal is None or held.renewal.done():
                    held.renewal = self._loop.create_task(self._renew(held))
            if queue:
                earliest = min(earliest, next(iter(queue)).due)
        if earliest < math.inf:
            self._arm(earliest)

    async def _renew(self, held: HeldLease) -> None:
        try:
            renewed = await self._store.renew(held.tenant, held.key, held.fence, lease=held.lease)
            if not renewed and not held.dropped:  # dropped: it was completed or released meanwhile, not taken over
                logger.warning("idempotency lease of key %s was taken over", hash_key(held.key))
                self._forget(held)
        except Exception as error:  # the store is unreachable for now: the next beat tries again
            self._failures.failed("renew a lease (retried at the next beat)", error)
