"""Keeping the leases of running handlers alive, from one timer per middleware (and event loop).

A claim holds its key for ``lease`` seconds. While the handler runs, the lease is renewed every third of that, so
a slow handler keeps its key and a crashed one frees it soon. One :class:`LeaseKeeper` serves every request of a
middleware: a request registers its claim and unregisters it when it ends, and the keeper's single timer wakes
when the earliest renewal is due. Most requests end long before that and never cost a timer, a task or a store
call of their own.

A middleware served from more than one event loop (a server per thread, a server restarted in process while the
old loop still runs) has its leases renewed by each loop for itself: the keeper keeps the queues and the timer of
each loop apart, and forgets those of loops that have closed when it first meets another loop.

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
from dataclasses import dataclass, field

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
    leases: LoopLeases  # those of the loop it was held on, which renews it
    renewal: asyncio.Task[None] | None = None
    dropped: bool = False  # the request has ended: a renewal still on its way changes nothing and says nothing


@dataclass(eq=False, slots=True)
class LoopLeases:
    """The leases held on one event loop and the timer that renews them: a loop's timer and tasks run on it alone."""

    loop: asyncio.AbstractEventLoop
    queues: dict[float, OrderedDict[HeldLease, None]] = field(default_factory=dict)  # lease -> leases, earliest first
    timer: asyncio.TimerHandle | None = None
    wake_at: float = math.inf


class LeaseKeeper:
    def __init__(self, store: Store, failures: FailureLog | None = None) -> None:
        self._store = store
        self._failures = failures if failures is not None else FailureLog(logger)
        self._loops: dict[asyncio.AbstractEventLoop, LoopLeases] = {}

    def hold(self, tenant: str, key: str, fence: int, lease: float) -> HeldLease:
        """Renew this claim's lease until :meth:`drop` is called with what this returns."""
        loop = asyncio.get_running_loop()
        leases = self._loops.get(loop)
        if leases is None:
            leases = self._meet(loop)
        held = HeldLease(tenant, key, fence, lease, loop.time() + lease / 3, leases)
        queue = leases.queues.get(lease)
        if queue is None:  # one queue per duration a route configures, kept for the life of the loop
            queue = leases.queues[lease] = OrderedDict()
        queue[held] = None  # due last among the leases of its duration
        if held.due < leases.wake_at:
            self._arm(leases, held.due)
        return held

    def _meet(self, loop: asyncio.AbstractEventLoop) -> LoopLeases:
        """Start keeping the leases of a loop seen for the first time (another thread's, a server restarted in
        process), and forget the loops that have closed: nothing renews their leases again, and kept they would
        pile up, one per loop the middleware ever served."""
        for known in list(self._loops):  # a copy: another thread's loop may meet the keeper meanwhile
            if known.is_closed():
                self._loops.pop(known, None)
        leases = self._loops[loop] = LoopLeases(loop)
        return leases

    def drop(self, held: HeldLease) -> None:
        """The request has ended: stop renewing. The timer is left to lapse; it costs one idle wake at most.

        A renewal already on its way is left to finish rather than cancelled: cancelling a statement in flight
        costs its connection, and the renewal is harmless (fenced, and a completed record is never renewed)."""
        held.dropped = True
        self._forget(held)

    def _forget(self, held: HeldLease) -> None:
        queue = held.leases.queues.get(held.lease)
        if queue is not None:
            queue.pop(held, None)

    def _arm(self, leases: LoopLeases, when: float) -> None:
        if leases.timer is not None:
            leases.timer.cancel()
        leases.wake_at = when
        leases.timer = leases.loop.call_at(when, self._wake, leases)

    def _wake(self, leases: LoopLeases) -> None:
        leases.timer, leases.wake_at = None, math.inf
        loop = leases.loop
        now = loop.time()
        earliest = math.inf
        for lease, queue in leases.queues.items():
            for _ in range(len(queue)):  # each lease once at most, even one so short that it is due again at once
                held = next(iter(queue))
                if held.due > now:
                    break
                held.due = now + lease / 3
                queue.move_to_end(held)  # renewed now: due after every other lease of this duration
                if held.renewal is None or held.renewal.done():
                    held.renewal = loop.create_task(self._renew(held))
            if queue:
                earliest = min(earliest, next(iter(queue)).due)
        if earliest < math.inf:
            self._arm(leases, earliest)

    async def _renew(self, held: HeldLease) -> None:
        try:
            renewed = await self._store.renew(held.tenant, held.key, held.fence, lease=held.lease)
            if not renewed and not held.dropped:  # dropped: it was completed or released meanwhile, not taken over
                logger.warning("idempotency lease of key %s was taken over", hash_key(held.key))
                self._forget(held)
        except Exception as error:  # the store is unreachable for now: the next beat tries again
            self._failures.failed("renew a lease (retried at the next beat)", error)
