"""A claim that is the request's: its lease renewed while the handler runs, then completed with the final answer or
released so that the retry runs afresh; once, whatever happens to the request meanwhile.

Leases are renewed by one :class:`LeaseKeeper` per middleware (and event loop): a request registers its claim and
unregisters it when it settles, and the keeper's single timer wakes when the earliest renewal is due, every third
of the lease. Most requests end long before that and never cost a timer, a task or a store call of their own.
Leases of one duration come due in the order they were held or last renewed, so the keeper keeps one queue per
duration (an insertion-ordered dict: holding appends, renewing moves to the back, dropping removes, each O(1)); a
wake looks at the fronts of the queues only. A middleware served from more than one event loop (a server per
thread, a server restarted in process) has each loop renew its own leases, and forgets the loops that closed.

The claim and the settlement of a request must outlive a cancellation of the request (a server shutting down, an
outer timeout), so whatever waits on the store goes on in a task of its own (:func:`start_eagerly`), and the request
waits for it through :func:`outlasting`. The task starts eagerly: it runs in the caller's turn of the event loop up
to its first wait, so one that never waits (``MemoryStore``) is done at once, and one that waits for the database
has already sent its statement. Python 3.12 does this itself; on 3.11 :func:`start_eagerly` takes the first step by
hand, with the new task current (so ``asyncio.timeout``, which the pool uses, cancels the task and never the
request), and the task goes on from where that step stopped (:func:`_going_on`). Without it, each of these tasks
cost a request three turns of the event loop on 3.11.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import sys
import time
import types
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Generator
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from starlette.types import Scope

from idempotency_mw._events import FailureLog, Outcome, hash_key
from idempotency_mw._fingerprint import FingerprintKeys, fingerprint
from idempotency_mw._keys import ROUTE_TENANTS
from idempotency_mw._parts import RequestParts, request_parts
from idempotency_mw._policy import Policy
from idempotency_mw.store import (
    Claim,
    ClaimOutcome,
    PoolExhausted,
    RecordInfo,
    Store,
    StoredResponse,
    StoreUnavailable,
    Subscription,
)

if TYPE_CHECKING:
    from idempotency_mw.cutover import Earlier

T = TypeVar("T")
logger = logging.getLogger("idempotency_mw")


class OwnedClaim:
    """The claim of ``(tenant, key)`` under ``fence``, the request's until it settles: its lease renewed meanwhile
    (by ``leases``), then :meth:`complete` or :meth:`release`, which say how it ended. ``store_seconds`` is the
    time its settlement spent waiting on the store; ``expires_at`` when its record expires, as the store said when
    it was claimed (a renewal only ever moves that later), or None."""

    __slots__ = ("_failures", "_lease", "_leases", "expires_at", "fence", "key", "store", "store_seconds", "tenant")

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
        expires_at: float | None = None,
    ) -> None:
        self.store, self.tenant, self.key, self.fence = store, tenant, key, fence
        self.expires_at = expires_at
        self.store_seconds = 0.0
        self._failures = failures
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
        started = time.perf_counter()
        try:
            try:
                completed = await self.store.complete(self.tenant, self.key, self.fence, response)
            except StoreUnavailable:
                raise
            except Exception as refused:
                # The database refused the response itself (a header it cannot hold). The effect has happened: the
                # key completes all the same, without a response to replay, rather than run again after its lease.
                self._failures.failed("store a response (the key completes without it)", refused)
                unreplayable = response.unreplayable()
                completed = await self.store.complete(self.tenant, self.key, self.fence, unreplayable)
        except Exception as error:
            # The client has its response; the claim stays until its lease lapses, then a retry runs again.
            self._failures.failed("record a completed response", error)
            return store_failure(error)
        finally:
            self.store_seconds += time.perf_counter() - started
        return Outcome.EXECUTED if completed else Outcome.FENCED_OUT

    async def release(self) -> Outcome:
        """Free the key for the retry (FENCED_OUT when it was no longer this claim's to free). Shielded: it must happen
        even when the request was cancelled."""
        self.drop_lease()
        started = time.perf_counter()
        try:
            released = await asyncio.shield(self.store.release(self.tenant, self.key, self.fence))
        except Exception as error:
            self._failures.failed("release a key (it frees itself when its lease lapses)", error)
            return store_failure(error)
        finally:
            self.store_seconds += time.perf_counter() - started
        return Outcome.RELEASED if released else Outcome.FENCED_OUT


def store_failure(error: BaseException) -> Outcome:
    """An exhausted pool is its own outcome: the fix is a larger ``max_size``, not the database team."""
    return Outcome.POOL_EXHAUSTED if isinstance(error, PoolExhausted) else Outcome.STORE_ERROR


# -- leases --------------------------------------------------------------------------------------------------------


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
    """Renews the lease of every claim held, from one timer per event loop."""

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
                self.drop(held)
        except Exception as error:  # the store is unreachable for now: the next beat tries again
            self._failures.failed("renew a lease (retried at the next beat)", error)


# -- tasks that a cancellation of the request cannot stop ----------------------------------------------------------


if sys.version_info >= (3, 12):

    def start_eagerly(coroutine: Coroutine[Any, Any, T], name: str) -> asyncio.Future[T]:
        """A task running ``coroutine``, started eagerly: up to its first wait, in the caller's turn of the loop."""
        return asyncio.Task(coroutine, loop=asyncio.get_running_loop(), name=name, eager_start=True)

else:
    from asyncio.tasks import _enter_task, _leave_task

    def start_eagerly(coroutine: Coroutine[Any, Any, T], name: str) -> asyncio.Future[T]:
        """``coroutine`` run up to its first wait in the caller's turn of the loop, as Python 3.12's eager tasks do:
        a future already done when it never waited, else the task that goes on with it. The step is taken with that
        task current and in its context, as the task's own step would be."""
        loop = asyncio.get_running_loop()
        context = contextvars.copy_context()
        first = _FirstStep()
        going_on: Any = _going_on(coroutine, first)  # a generator-based coroutine, which asyncio.Task runs
        going_on.send(None)  # to its first yield, where the task's first step resumes it, or a cancellation before it
        task: asyncio.Task[T] = asyncio.Task(going_on, loop=loop, name=name, context=context)
        caller = asyncio.current_task(loop)
        if caller is not None:
            _leave_task(loop, caller)
        _enter_task(loop, task)
        try:
            first.waits_on = context.run(coroutine.send, None)
        except StopIteration as returned:
            first.finished = True
            return _done(loop, result=returned.value)
        except (KeyboardInterrupt, SystemExit):
            first.finished = True
            raise
        except BaseException as error:
            first.finished = True
            return _done(loop, error=error)
        finally:
            _leave_task(loop, task)
            if caller is not None:
                _enter_task(loop, caller)
        return task

    @dataclass(slots=True)
    class _FirstStep:
        """How :func:`start_eagerly`'s step left the coroutine: finished, or waiting on ``waits_on``."""

        finished: bool = False
        waits_on: Any = None

    @types.coroutine
    def _going_on(coroutine: Coroutine[Any, Any, Any], first: _FirstStep) -> Generator[Any, Any, Any]:
        """What the task runs. :func:`start_eagerly` starts it to its first ``yield`` before the coroutine's first
        step, so that the task's own first step resumes it there, and so does a cancellation of the task that comes
        before that step. Then: nothing if the coroutine finished in its first step; else it hands the task what the
        coroutine waits on, as though the coroutine had yielded it, and from then on delegates every step to the
        coroutine (``yield from``, in C). A cancellation before then is thrown into the coroutine where it waits, as
        a task's cancellation would be."""
        thrown: BaseException | None = None
        try:
            yield
        except BaseException as error:
            thrown = error
            if isinstance(error, asyncio.CancelledError) and isinstance(first.waits_on, asyncio.Future):
                first.waits_on.cancel()  # as a task's cancel() cancels the future it waits on
        while not first.finished:
            if thrown is not None:
                try:
                    first.waits_on = coroutine.throw(thrown)
                except StopIteration as returned:
                    return returned.value
                thrown = None
            try:
                yield first.waits_on
            except BaseException as error:
                thrown = error
            else:
                return (yield from coroutine)  # a coroutine, delegated to as types.coroutine allows
        if thrown is not None:
            raise thrown
        return None

    def _done(
        loop: asyncio.AbstractEventLoop, *, result: Any = None, error: BaseException | None = None
    ) -> asyncio.Future[Any]:
        """A future holding the outcome of a coroutine that finished in its first step."""
        future: asyncio.Future[Any] = loop.create_future()
        if isinstance(error, asyncio.CancelledError):
            future.cancel()
        elif error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
        return future


def outlasting(task: asyncio.Future[T]) -> asyncio.Future[T]:
    """What ``task`` ends with, to wait for: cancelling the wait leaves ``task`` running (``asyncio.shield``, minus
    its argument checks and its second turn of the loop). An error nobody reads after a cancelled wait is marked
    read, so that asyncio does not log it as lost."""
    if task.done():
        return task
    follower: asyncio.Future[T] = task.get_loop().create_future()
    task.add_done_callback(partial(_pass_on, follower))
    return follower


def _pass_on(follower: asyncio.Future[T], task: asyncio.Future[T]) -> None:
    if follower.cancelled():  # the waiter was cancelled: the outcome is the task's owner's to read
        if not task.cancelled():
            task.exception()  # marked as read, or asyncio would log an error that nobody retrieved
        return
    if task.cancelled():
        follower.cancel()
    elif (error := task.exception()) is not None:
        follower.set_exception(error)
    else:
        follower.set_result(task.result())


# -- taking a claim -------------------------------------------------------------------------------------------------


class Claimer(Protocol):
    """What takes a claim: the store, or a transactional run (on the connection its transaction then uses)."""

    async def claim(
        self,
        tenant: str,
        key: str,
        fingerprint: bytes,
        *,
        lease: float,
        ttl: float,
        matching: tuple[bytes, ...] = (),
        request: str | None = None,
        parts: bytes | None = None,
    ) -> Claim: ...


MAX_MOVES = 3  # a fresh claim moved to another tenant's record this often answers 409 rather than guess


@dataclass(eq=False, slots=True)
class Ask:
    """What a request asks of the store: its key, under whose name, for which request; filled in as the request is
    read (its key, then its tenant, then its fingerprint)."""

    key: str | None = None
    tenant: str = ""  # whose record: the tenant, or a route's own tenant in a namespace of its own
    owner: str = ""  # the tenant as resolved (its record's, across a rotation): what the context and event carry
    # Where the same request's record may be instead: a route's tenant as stored before routes had a namespace, or
    # its tenant under the other secret of a rotation in progress. A fresh claim looks there before it runs.
    others: tuple[str, ...] = ()
    line: str | None = None  # its method and route template, which the record keeps for inspect
    digest: bytes = b""  # the request's fingerprint, unkeyed: never stored, nor sent to the store
    digests: tuple[bytes, ...] = ()  # as stored, under each fingerprint key, the current one first
    # A route that explains a mismatch (explain_mismatch): the request's parts, to compare with a record's, and as
    # the claim writes them (keyed digests, under the current fingerprint key).
    parts: RequestParts | None = None
    stored_parts: bytes | None = None

    def scope_to(self, tenant: str, *, route_owns_it: bool, alternates: tuple[str, ...] = ()) -> bool:
        """Scope the key by ``tenant`` (``alternates``: the same tenant under the other secrets of a rotation). A
        route's own tenant (a provider's webhooks) has a namespace of its own, its records apart from every tenant of
        the resolver; False for a resolver's tenant in that namespace, which could meet a route's records."""
        if route_owns_it:
            self.owner, self.tenant, self.others = tenant, ROUTE_TENANTS + tenant, (tenant,)
        elif tenant.startswith(ROUTE_TENANTS):
            return False
        else:
            self.tenant = self.owner = tenant
            self.others = alternates
        return True

    def fingerprint(
        self, scope: Scope, content_type: bytes, body: bytes, policy: Policy, keys: FingerprintKeys
    ) -> None:
        """The request's fingerprint (method, path, query and body, less the policy's excluded fields), as stored
        under each of ``keys``; and, on a route that explains a mismatch, its parts (``_parts.py``)."""
        self.digest = fingerprint(
            scope["method"],
            scope["path"],
            scope.get("query_string", b""),
            content_type,
            body,
            policy.fingerprint_exclude,
        )
        self.digests = keys.digests(self.digest)
        if policy.explain_mismatch:
            exclude = policy.fingerprint_exclude
            self.parts = parts = request_parts(scope, content_type, body, exclude, keys, self.digests[0])
            self.stored_parts = parts.stored

    async def claim(
        self,
        claimer: Claimer,
        store: Store,
        *,
        lease: float,
        ttl: float,
        moves: int = 0,
        earlier: Callable[[str], Awaitable[Earlier | None]] | None = None,
    ) -> Claim:
        """The claim, by ``claimer``.

        A record whose fingerprint is a bare SHA-256 was written before fingerprints were keyed: when it is this
        request's own ``digest``, it is the same request after all (a retry in flight across the upgrade), and the
        claim is taken again with it.

        A fresh claim then looks under the request's ``others`` (a route's tenant as stored before routes had a
        namespace; the tenant under the other secret of a rotation) and runs only if none holds a live record. If
        one does, the fresh claim is released and the request is claimed there instead, so that it is still the same
        request (a replay, a 409, a 422), and where that claim is fresh in turn, the tenant it left is looked at
        again. Each side claims before it looks, so of two copies that race under two tenants at least one sees the
        other's claim: never both run. Two that keep seeing each other give up after ``MAX_MOVES`` with a 409. A look
        that fails releases the fresh claim before its error goes on (:meth:`_looked_up`)."""
        assert self.key is not None
        current, *previous = self.digests
        line, matching = self.line, tuple(previous)
        claim = await claimer.claim(
            self.tenant, self.key, current, lease=lease, ttl=ttl, matching=matching, request=line,
            parts=self.stored_parts,
        )  # fmt: skip
        if claim.outcome is ClaimOutcome.MISMATCH and claim.unkeyed is not None and claim.unkeyed == self.digest:
            matching = (*previous, self.digest)
            claim = await claimer.claim(
                self.tenant, self.key, current, lease=lease, ttl=ttl, matching=matching, request=line,
                parts=self.stored_parts,
            )  # fmt: skip
        if claim.outcome is not ClaimOutcome.OWNED or claim.attempts:
            return claim
        for other in self.others:
            found = await self._looked_up(store, claim.fence, store.inspect(other, self.key))
            if found is not None and found.expires_at > time.time() and self._may_move_to(found):
                await store.release(self.tenant, self.key, claim.fence)
                if moves == MAX_MOVES:
                    return Claim(ClaimOutcome.IN_PROGRESS, fence=found.fence)
                # The request is the record's from now on, under the tenant it was first seen under: its context
                # (downstream keys: a provider call it made then gets the same key) and its events say that one.
                if self.owner == self.tenant:  # a resolver's tenant (a route's own names its namespace: it stays)
                    self.owner = other
                self.tenant, self.others = other, tuple(t for t in (self.tenant, *self.others) if t != other)
                return await self.claim(claimer, store, lease=lease, ttl=ttl, moves=moves + 1, earlier=earlier)
        if earlier is not None:
            return await self._as_earlier(claim, store, await self._looked_up(store, claim.fence, earlier(self.key)))
        return claim

    def _may_move_to(self, found: RecordInfo) -> bool:
        """Whether a live record found elsewhere is this request's to move to. Under the other secret of a rotation
        it is the same caller's: any request of theirs (another one is a reused key, 422). Under the bare tenant a
        route's records had before routes had a namespace, only this very request's (the event redelivered): any
        other is a resolver tenant's that happens to spell the route's, which must not block its events."""
        if not self.tenant.startswith(ROUTE_TENANTS):
            return True
        return found.fingerprint in self.digests or found.fingerprint == self.digest

    async def _looked_up(self, store: Store, fence: int, looking: Awaitable[T]) -> T:
        """What ``looking`` (a look elsewhere after the fresh claim ``fence``) finds. Where it fails (a record there
        that does not open, the store unreachable), the claim is released first, as best it can be, so that the
        retry is not a 409 until its lease lapses; the error goes on."""
        assert self.key is not None
        try:
            return await looking
        except Exception:
            with contextlib.suppress(Exception):
                await store.release(self.tenant, self.key, fence)
            raise

    async def _as_earlier(self, claim: Claim, store: Store, earlier: Earlier | None) -> Claim:
        """A fresh claim, answered from what the package this app switched from recorded (``cutover.py``): its
        response becomes this record's (then replayed, here and to every later retry), a request it still runs is a
        409, another request a 422; where it recorded nothing, the claim stands. The 409 names no claim (fence 0):
        the one taken here is released, and nothing tells this store when the other package's run ends, so a waiter
        has nothing to wait for."""
        assert self.key is not None
        if earlier is None:
            return claim
        response = earlier.response if earlier.same_request else None
        if response is not None and await store.complete(self.tenant, self.key, claim.fence, response):
            return Claim(ClaimOutcome.COMPLETED, fence=claim.fence, response=response, expires_at=claim.expires_at)
        await store.release(self.tenant, self.key, claim.fence)
        if earlier.same_request:
            return Claim(ClaimOutcome.IN_PROGRESS, fence=0)
        return Claim(ClaimOutcome.MISMATCH, fence=claim.fence)


# -- waiting for the claim of another request -----------------------------------------------------------------------

Watch = Callable[[int], contextlib.AbstractAsyncContextManager[Subscription]]


class ClaimOrWait:
    """The claim; while another request runs under its key, watch that request's claim (``watch(fence)``), check
    again, and wait for it to settle, then claim again; for ``within`` seconds at most. A request that runs under no
    claim of the store's (fence 0: a cutover's earlier package runs it) is answered at once: nothing would wake the
    waiter, and claiming again until the deadline would only spin.

    A request cancelled meanwhile stops it (:meth:`stop`): a claim of its on the way lands, and it returns then
    instead of waiting again. ``asleep`` says whether it waits for a settlement, with no claim on the way: there the
    request may cancel it outright (nothing of it can be lost). ``met_running`` says whether a claim answered that
    another request runs under the key: a store failure after that must not fail open beside it."""

    def __init__(self, claim: Callable[[], Awaitable[Claim]], watch: Watch, within: float) -> None:
        self._claim, self._watch, self._within = claim, watch, within
        self.asleep = False
        self.met_running = False
        self._stopped = False

    def stop(self) -> None:
        """Wait no more: the request is gone."""
        self._stopped = True

    async def run(self) -> Claim:
        claimed = await self._claim()
        if claimed.outcome is not ClaimOutcome.IN_PROGRESS:
            return claimed
        self.met_running = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._within
        while claimed.outcome is ClaimOutcome.IN_PROGRESS and claimed.fence and deadline > loop.time():
            running = claimed.fence
            async with self._watch(running) as settled:
                claimed = await self._claim()  # subscribed: a settlement before this is found here, one after wakes us
                if claimed.outcome is ClaimOutcome.IN_PROGRESS and claimed.fence == running and not self._stopped:
                    self.asleep = True
                    try:
                        await settled.wait(deadline - loop.time())
                    finally:
                        self.asleep = False
                    claimed = await self._claim()
            if self._stopped:
                break
        return claimed
