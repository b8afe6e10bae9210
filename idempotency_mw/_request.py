"""One covered request, from its key to its recorded (or released) response: steps 1 to 7 of docs/design.md §2,
read top to bottom in :meth:`IdempotentRequest.run`.

The request asks a run (plain or transactional) to run the handler, and gets back what happened; it alone decides
what the client gets and what is reported (:class:`Report`). Two kinds of request take another path: one whose
tenant the app tells from inside (:class:`TenantFromAppRequest`: the claim waits for the app's own authentication),
and any request while the middleware is switched off (:class:`SwitchedOffRequest`: nothing is claimed). A request on a
route that only observes has a module of its own (``_observing.py``).
"""

from __future__ import annotations

import asyncio
import enum
import time
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol, cast

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from idempotency_mw import _problems as problems
from idempotency_mw._channels import BufferedBody, Read, ReplayHook, handler_scope, replay, replayed
from idempotency_mw._claim import (
    Ask,
    ClaimOrWait,
    LeaseKeeper,
    OwnedClaim,
    outlasting,
    start_eagerly,
    store_failure,
)
from idempotency_mw._context import PENDING_KEY, STATE_KEY, ClaimAnswered, IdempotencyContext, resumed_from
from idempotency_mw._events import (
    LOG_LEVELS,
    Event,
    EventHook,
    FailureLog,
    Notices,
    Outcome,
    hash_key,
    log_event,
    logger,
)
from idempotency_mw._fingerprint import FingerprintKeys
from idempotency_mw._keys import (
    HEADER,
    AuthorizationTenant,
    CookieTenant,
    InvalidKey,
    KeyFunctionFailed,
    MissingKey,
    RequestHeaders,
    TenantFromApp,
    TenantResolver,
    key_from_body,
    key_from_values,
    outlived,
    passes_unscoped,
    resolve_tenant,
)
from idempotency_mw._plain import PlainRun
from idempotency_mw._policy import UNMATCHED, Policy, RouteMatch
from idempotency_mw._stepped import SteppedRun, UnrecordedRun
from idempotency_mw._transactional import DID_NOT_COMMIT, State, TransactionalRun, refusal
from idempotency_mw.cutover import EarlierLookup
from idempotency_mw.store import (
    Claim,
    ClaimOutcome,
    Store,
    StoreNotGranted,
    StoreNotMigrated,
    StoreUnavailable,
    Transaction,
    TransactionalStore,
)

OUTAGES = (StoreUnavailable, OSError)  # the store cannot be reached, or answers late
SET_UP_WRONG = (StoreNotMigrated, StoreNotGranted)  # it answers, though: a deploy to fix, not an outage to ride out


def fails_open(policy: Policy, error: Exception) -> bool:
    """Whether a claim that failed with ``error`` runs the handler without a record (``fail_open``): only in an
    outage, never for a record that is there but does not open, nor for a store set up wrong."""
    return policy.fail_open and isinstance(error, OUTAGES) and not isinstance(error, SET_UP_WRONG)


class Middleware(Protocol):
    """What a request asks of the middleware it came through (``IdempotencyMiddleware``): its settings, and what
    its requests share."""

    app: ASGIApp
    store: Store
    tenant: TenantResolver | TenantFromApp  # the default resolver of keyed requests' tenants
    tenant_from_app: TenantFromApp | None  # set when the app tells each request's tenant from inside
    fingerprint_keys: FingerprintKeys
    retry_after: int  # seconds, with 409 and 503
    on_event: EventHook | None
    on_started: Callable[[Scope], Any] | None  # the hook's ``started``, if it has one
    on_replay: ReplayHook | None
    earlier: EarlierLookup | None  # what the package the app switched from recorded (cutover.py)
    failures: FailureLog  # store failures: the first in full, then a summary now and then
    notices: Notices  # misconfigurations the operator hears of once
    envelope: problems.Envelope  # what its own answers go out in: problem+json, or the app's (problem_renderer)
    leases: LeaseKeeper  # renews the lease of every handler still running


class Step(enum.IntEnum):
    """Where a covered request is, in the only order its steps come: it only moves forward. What it ends with is its
    :class:`Outcome`."""

    STARTED = 1  # key, tenant and body being read; nothing asked of the store yet
    WAITING = 2  # its tenant is the app's to tell: the app runs, and claims from inside (claim_for)
    CLAIMING = 3  # the claim is on its way to the store
    RUNNING = 4  # the key is the request's: the handler runs, its lease renewed
    ANSWERED = 5  # the outcome is decided, and reported


class Report:
    """What the event of one request will say (:class:`~idempotency_mw.Event`), built and handed to the hook once,
    when the answer is decided: before it goes out, while a server span still records it."""

    __slots__ = ("attempts", "hook", "outcome", "reached_store", "route", "scope", "started", "status", "store_seconds")
    observed = False  # an observing route's report (``_observing.py``): the outcome is what enforcing would have done
    levels = LOG_LEVELS  # the default hook's level for each outcome

    def __init__(self, hook: EventHook | None, scope: Scope, route: str) -> None:
        self.hook, self.scope, self.route = hook, scope, route
        self.started = time.perf_counter()
        self.outcome: Outcome | None = None
        self.status: int | None = None
        self.store_seconds = 0.0  # spent waiting on the store (the claim; the settlement is its claim's)
        self.attempts = 0  # earlier claims of the key
        self.reached_store = False

    def reach_store(self, started: Callable[[Scope], object] | None) -> None:
        """The request goes to the store: the hook's ``started(scope)``, if it has one, hears it (an in-flight
        gauge)."""
        self.reached_store = True
        if started is not None:
            try:
                started(self.scope)
            except Exception:
                logger.exception("idempotency on_event.started hook failed")

    def decide(self, outcome: Outcome, status: int | None, tenant: str, key: str | None, settling: float) -> bool:
        """Report ``outcome`` and ``status`` (``settling``: seconds the settlement waited on the store); False when
        an outcome was decided before (the first stands)."""
        if self.outcome is not None:
            return False
        self.outcome, self.status = outcome, status
        hook = self.hook
        if hook is None or (hook is log_event and not logger.isEnabledFor(self.levels[outcome])):
            return True  # nobody listens, or the default hook would drop this event: do not build it
        scope = self.scope
        event = Event(
            outcome, scope["method"], scope["path"], self.route, tenant, hash_key(key), status,
            time.perf_counter() - self.started, self.store_seconds + settling, self.attempts, self.reached_store,
            resumed_from(scope), self.observed,
        )  # fmt: skip
        try:
            hook(event)
        except Exception:
            logger.exception("idempotency on_event hook failed")
        return True


class IdempotentRequest:
    """One covered request, from its key to its recorded (or released) response."""

    run_type: type[SteppedRun] = SteppedRun  # a transactional route's run (switched off: one that records nothing)

    def __init__(self, middleware: Middleware, route: RouteMatch, scope: Scope, receive: Receive, send: Send) -> None:
        self.middleware = middleware
        self.policy = policy = route.policy
        self.scope, self.send = scope, send
        self.step = Step.STARTED
        key_from = policy.key_from
        header = key_from.lower().encode("latin-1") if isinstance(key_from, str) else HEADER
        self.headers = RequestHeaders(scope["headers"], header)
        self.body = BufferedBody(receive, policy.max_request_bytes)
        self.report = Report(middleware.on_event, scope, route.template)
        self.ask = Ask(line=f"{scope['method']} {route.template}")  # its key, tenant and fingerprint: as they are read
        self.refusal: problems.Refusal | None = None  # a bad key, answered once the tenant is known
        self.owned: OwnedClaim | None = None  # the claim, once it is this request's
        self.ran: PlainRun | TransactionalRun | None = None  # the handler's run, once there is one
        self.abandoning: asyncio.Future[Outcome] | None = None  # the claim of a request cancelled as it claimed

    async def run(self) -> None:
        """Steps 1 to 7 of docs/design.md §2, in the order they happen."""
        try:
            # 1. The key, validated before anything touches the store (unless it is in the body: a webhook's).
            if not await self._read_key():
                return
            # 2. Whose key it is: none means the key cannot be scoped, and an unscoped key must never meet another's.
            if not await self._scope_key():
                return
            # 3. The body, capped, and its fingerprint; 4. the claim, which decides what happens next.
            if await self._read_body() and await self._claim():
                # 5. and 6. The key is ours: run the handler, then record its answer or release the key.
                await self._execute()
        finally:
            self._finish()

    # -- 1. to 3. the key, the tenant, the body -------------------------------------------------------------

    async def _read_key(self) -> bool:
        """The request's key, or the refusal of a bad one (answered once the tenant is known); False when the
        request ended here (a keyless request the middleware lets through, or whose body could not be read)."""
        policy = self.policy
        if callable(policy.key_from) and not await self._read_body():
            return False
        try:
            self.ask.key = self._key()
        except MissingKey:
            if not policy.required:
                await self._keyless()
                return False
            self.refusal = (problems.key_missing(), Outcome.KEY_MISSING)
        except KeyFunctionFailed as error:
            self.refusal = problems.key_function_failed(error, self.middleware.notices)
        except InvalidKey as error:
            self.refusal = (problems.key_invalid(str(error)), Outcome.KEY_INVALID)
        return True

    def _key(self) -> str:
        key_from = self.policy.key_from
        if callable(key_from):
            key = key_from_body(key_from, self.body.payload(self.headers.content_type))
        else:
            key = key_from_values(self.headers.key)
        if self.policy.key_format is not None and (why := self.policy.key_refusal(key)) is not None:
            raise InvalidKey(why)
        return key

    async def _scope_key(self) -> bool:
        """The tenant of a keyed request (``Ask.scope_to``); False when the request was refused instead."""
        if self.refusal is None:
            resolver = self.policy.tenant or self.middleware.tenant
            if isinstance(resolver, AuthorizationTenant):  # the default: its header values are picked out already
                tenant = resolver.of(self.headers.authorization)
                alternates = resolver.alternates(self.headers.authorization)  # a rotation of its secret
            elif isinstance(resolver, CookieTenant):  # a browser's: its tenant follows a rotation too
                tenant, alternates = resolver(self.scope), resolver.alternates(self.scope)
            else:  # not from the app: a resolver's
                tenant, alternates = await resolve_tenant(resolver, self.scope), ()  # type: ignore[arg-type]
            if tenant is None and passes_unscoped(resolver) and not self.policy.required:
                await self._keyless()  # not the middleware's to scope (no session cookie): as without a key
                return False
            if tenant is None:
                self.refusal = problems.tenant_unknown_to(resolver, self.middleware.notices)
            elif not self.ask.scope_to(tenant, route_owns_it=self.policy.tenant is not None, alternates=alternates):
                self.refusal = problems.tenant_reserved(resolver, self.middleware.notices)
        if self.refusal is not None:
            await self._refuse(*self.refusal)
            return False
        return True

    async def _read_body(self) -> bool:
        """Buffer the body and fingerprint the request; False when the request ended here (413, or the client left)."""
        body = self.body
        if body.read:
            return True
        read = await body.read_all(self.headers.content_length)
        if read is Read.TOO_LARGE:
            await self._refuse(problems.request_too_large(self.policy.max_request_bytes), Outcome.REQUEST_TOO_LARGE)
        if read is not Read.WHOLE:
            return False
        ask, headers = self.ask, self.headers
        ask.fingerprint(self.scope, headers.content_type, body.body, self.policy, self.middleware.fingerprint_keys)
        return True

    # -- 4. the claim -----------------------------------------------------------------------------------------

    async def _claim(self) -> bool:
        """Claim the key: True when the handler may run (the key is ours; or, failing open, nobody's), False when the
        request was answered (a replay, a conflict, a refusal)."""
        self._to(Step.CLAIMING)
        middleware, policy, report = self.middleware, self.policy, self.report
        report.reach_store(middleware.on_started)
        claimer = self._transaction() if policy.transactional else middleware.store  # on its transaction's connection
        ask, store = self.ask, middleware.store
        earlier = middleware.earlier and partial(middleware.earlier, self.scope, self.body.body)  # a cutover
        asking = partial(ask.claim, claimer, store, lease=policy.lease, ttl=policy.ttl, earlier=earlier)
        waiting = ClaimOrWait(asking, store.watch, policy.wait) if policy.on_conflict == "wait" else None
        started = time.perf_counter()
        # A cancellation must not lose a claim that landed: the claim runs in a task of its own, started eagerly.
        task = start_eagerly(asking() if waiting is None else waiting.run(), "idempotency claim")
        try:
            claim = await outlasting(task)
        except asyncio.CancelledError:
            # Cancelled (a server shutting down, an outer timeout) while the claim was on its way: it may have
            # landed. A claim that turns out to be ours is released, so the key is not left to its lease; a
            # transactional claim's connection goes back after it, not from under it (the app may be telling its
            # tenant: its run ends with this cancellation). A copy waiting for another's claim waits no more.
            if waiting is not None:
                waiting.stop()
                if waiting.asleep:
                    task.cancel()  # no claim of its on the way: nothing to outlast
            if isinstance(self.ran, TransactionalRun):
                self.ran.abandoned = True
            self.abandoning = asyncio.ensure_future(self._abandon(task, self.ran))
            raise
        except (TypeError, ValueError):
            # A store set up wrong (an engine in AUTOCOMMIT, say) says so, rather than as an outage: its error goes on
            # (an app's handler for it may answer), reported so that the request is not left in flight.
            del task  # it holds the error, whose traceback holds this frame: the request would be left in a cycle
            self.report.decide(Outcome.STORE_ERROR, None, self.ask.owner, self.ask.key, 0.0)
            raise
        except Exception as error:
            del task  # it holds the error, whose traceback holds this frame: the request would be left in a cycle
            report.store_seconds += time.perf_counter() - started
            middleware.failures.failed("claim a key", error)
            # Never beside a request that a waiting copy saw running.
            if fails_open(policy, error) and not (waiting is not None and waiting.met_running):
                # Failing open: the handler runs without a record, with its context (its ``downstream_key`` is the
                # provider's usual key), and what it sends passes untouched: a run with no claim (``PlainRun``).
                self._to(Step.RUNNING)
                return self._set_context()
            await self._refuse(problems.store_unavailable(middleware.retry_after), store_failure(error))
            return False
        report.store_seconds += time.perf_counter() - started
        report.attempts = claim.attempts
        if middleware.failures.failing:
            middleware.failures.succeeded()
        if claim.outcome is not ClaimOutcome.OWNED:
            await self._answer(claim)
            return False
        self.owned = owned = self._own(claim)
        if policy.check_uuid7_age and outlived(owned.key, policy.ttl):
            # No record is left to compare with: running now could repeat an operation whose record was purged.
            await owned.release()
            if isinstance(self.ran, TransactionalRun):
                await self.ran.close()
            await self._refuse(problems.key_expired(int(policy.ttl)), Outcome.KEY_EXPIRED)
            return False
        self._to(Step.RUNNING)
        if policy.transactional:
            return await self._begin()
        if self.ran is None:
            self.ran = PlainRun(policy, self._send_out)
        self.ran.claimed(owned)  # type: ignore[union-attr]  # plain
        return self._set_context()

    def _own(self, claim: Claim) -> OwnedClaim:
        assert self.ask.key is not None
        middleware = self.middleware
        return OwnedClaim(
            middleware.store, self.ask.tenant, self.ask.key, claim.fence, expires_at=claim.expires_at,
            lease=self.policy.lease, leases=middleware.leases, failures=middleware.failures,
        )  # fmt: skip

    async def _abandon(self, claiming: asyncio.Future[Claim], ran: PlainRun | TransactionalRun | None) -> Outcome:
        """The claim of a request cancelled while it was on its way: released once it is known to be ours (so that
        the key is not left to its lease), and the connection a transactional claim ran on given back then."""
        try:
            claim = await claiming
            return await self._own(claim).release() if claim.outcome is ClaimOutcome.OWNED else Outcome.CANCELLED
        except asyncio.CancelledError:
            if not claiming.cancelled():
                raise  # this release's own cancellation
            return Outcome.CANCELLED  # stopped asleep (ClaimOrWait): no claim of its was on the way
        except Exception:
            return Outcome.STORE_ERROR  # the claim failed: nothing of it is left
        finally:
            if isinstance(ran, TransactionalRun):
                await ran.close()

    async def _answer(self, claim: Claim) -> None:
        """A claim that is not ours: 7. replayed, or refused (``problems.answer_to``)."""
        middleware, response = self.middleware, claim.response
        if claim.outcome is not ClaimOutcome.COMPLETED or response is None or response.body is None:
            return await self._refuse(*problems.answer_to(claim, middleware.retry_after, self.policy, self.ask.parts))
        if middleware.on_replay is not None:
            response = await replayed(middleware.on_replay, self.scope, response)
        self._decide(Outcome.REPLAYED, response.status)
        await replay(response, self.send, claim.expires_at)

    # -- 5. and 6. running the handler, then recording or releasing -----------------------------------------

    async def _execute(self) -> None:
        """Run the handler, its response recorded on the way out (plain) or held in its transaction; what the app
        raised goes on, unless its transaction did not commit and a 409 or 503 answers in its place."""
        ran = self.ran
        if ran is None:  # the app tells its tenant: the run is there before the claim
            ran = self._transaction() if self.policy.transactional else PlainRun(self.policy, self._send_out)
            self.ran = ran
        try:
            if isinstance(ran, PlainRun):
                await ran.run(self.middleware.app, handler_scope(self.scope), self.body.receive)
            elif await ran.run(self.middleware.app, handler_scope(self.scope), self.body.receive) in DID_NOT_COMMIT:
                await self._refuse(*not_committed(ran, self.middleware))
        except ClaimAnswered:
            pass  # the middleware answered from inside the app (claim_for): the handler did not run
        except BaseException:
            if not isinstance(ran, TransactionalRun) or ran.state not in DID_NOT_COMMIT:
                raise  # from here, so that its traceback holds no frame that holds it (tests/test_cycles.py)
            await self._refuse(*not_committed(ran, self.middleware))
        finally:
            if self.owned is not None:
                self.owned.drop_lease()

    async def _keyless(self) -> None:
        """Not ours (no key, or no tenant to scope it): untouched, with a context that has no key (as when observing
        or switched off); a transactional route gets its transaction still."""
        self.ask.key = None  # a key no tenant scopes is none the handler may derive from
        if not self.policy.transactional:
            self._set_context()
            return await self.middleware.app(self.scope, self.body.receive, self.send)
        if await self._begin():  # on a transactional run of its own (_transaction)
            await self._execute()

    async def _begin(self) -> bool:
        """Begin the handler's transaction and lend it (``request.state.idempotency.transaction``); False when the
        request was answered instead (503)."""
        ran = self._transaction()
        try:
            begun = await ran.begin(self.owned, self.ask.owner)
        except asyncio.CancelledError:
            # Cancelled while BEGIN was on its way (a claim landed on the same connection): nothing ran. As for a claim
            # on its way (_abandon), a task the cancellation does not stop gives the connection back and frees the
            # key, which would otherwise stay in progress, its lease renewed for as long as the process lives.
            giving_up = start_eagerly(self._give_up(ran), "idempotency release")
            if self.owned is not None:  # reported once it ends (_finish); a keyless request reports nothing
                self.abandoning = giving_up
            raise
        if not begun:
            assert ran.failure is not None
            self.middleware.failures.failed("run the handler's transaction", ran.failure)
            problem = problems.store_unavailable(self.middleware.retry_after)
            if self.owned is None:  # keyless, or switched off: nothing claimed, nothing reported (a 503 all the same)
                await self.middleware.envelope.send(problem, self.scope, self.send)
            else:
                await self._refuse(problem, store_failure(ran.failure))
            return False
        return self._set_context(ran.transaction, ran)

    async def _give_up(self, ran: TransactionalRun) -> Outcome:
        """A request cancelled as its transaction began (nothing ran): its key, if any, released so that the retry
        runs, and its connection given back, as :meth:`_abandon` does."""
        try:
            return Outcome.CANCELLED if self.owned is None else await self.owned.release()
        finally:
            await ran.close()

    # -- the answer, decided once -----------------------------------------------------------------------------

    async def _refuse(self, problem: problems.Problem, outcome: Outcome) -> None:
        self._decide(outcome, problem.status)
        await self.middleware.envelope.send(problem, self.scope, self.send)

    async def _send_out(self, message: Message) -> None:
        """A run's response, to the client: its outcome reported as soon as the run has settled. Once the middleware
        answered from inside the app, what the app sends after (its answer to :class:`ClaimAnswered`) is dropped."""
        if self.report.outcome is None:
            settled = self.ran.outcome if self.ran is not None else None
            if settled is not None:
                self._decide(*settled)
        elif self.owned is None and self.step is Step.ANSWERED:
            return
        await self.send(message)

    def _decide(self, outcome: Outcome, status: int | None) -> None:
        """The answer is known: report it now, before it goes out. Once: the first decision stands."""
        settling = self.owned.store_seconds if self.owned is not None else 0.0
        if self.report.decide(outcome, status, self.ask.owner, self.ask.key, settling):
            self.step = Step.ANSWERED

    def _finish(self) -> None:
        """On the way out: a settlement (or abandoned claim) that goes on after a cancellation reports once it ends.
        What refers back to this request goes, so that it is freed as it ends, not by the cycle collector."""
        ran = self.ran
        if self.report.outcome is None:
            settling = self.abandoning or (ran.settling if isinstance(ran, PlainRun) else None)
            status = ran.recorder.status if ran is not None else None
            if settling is not None:
                settling.add_done_callback(lambda done: self._decide_after(done, status))
            elif ran is not None and ran.outcome is not None:
                self._decide(*ran.outcome)
            elif self.owned is not None:
                self._decide(Outcome.STORE_ERROR, status)
            elif self.step is Step.RUNNING:  # running with no claim: failing open
                self._decide(Outcome.UNPROTECTED, status)
        self.ran = None
        self.scope.get("state", {}).pop(PENDING_KEY, None)

    def _decide_after(self, settled: asyncio.Future[Outcome], status: int | None) -> None:
        if not settled.cancelled() and settled.exception() is None:
            self._decide(settled.result(), status)

    def _to(self, step: Step) -> None:
        if step <= self.step:
            raise RuntimeError(f"a request cannot go from {self.step.name} to {step.name}")
        self.step = step

    def _transaction(self) -> SteppedRun:
        """The request's transactional run (a ``run_type``): the one there is, or a new one."""
        if not isinstance(self.ran, self.run_type):
            # Checked when the middleware was built: an isinstance of a runtime Protocol costs ~20 us a request.
            store = cast(TransactionalStore, self.middleware.store)
            self.ran = self.run_type(store, self.policy, self._send_out)
        return self.ran

    def _set_context(self, transaction: Transaction | None = None, ran: SteppedRun | None = None) -> bool:
        recovery = None if ran is None else weakref.ref(ran)  # weakly: the run refers back to this request
        context = IdempotencyContext(self.ask.owner, self.ask.key, transaction, recovery)
        self.scope.setdefault("state", {})[STATE_KEY] = context
        return True


class TenantFromAppRequest(IdempotentRequest):
    """A covered request whose tenant the app tells from inside (``TenantFromApp``: a FastAPI dependency), once its
    own authentication has answered: steps 2 and 4 wait for :meth:`claim_for`, and so do the refusals of step 1,
    so that the app's 401 comes before any answer of the middleware's."""

    def _finish(self) -> None:
        # A route the startup check could not read (a mounted ASGI app without a route table: ``<unmatched>``) that
        # gave a keyed request a final answer without telling its tenant ran it unclaimed: the operator hears it.
        ran = self.ran
        unread = self.report.route == UNMATCHED and self.step is Step.WAITING and self.ask.key is not None
        if unread and isinstance(ran, PlainRun) and ran.recorder.status in self.policy.recorded:
            self.middleware.notices.once(
                "unclaimed",  # once, whatever the path: a scan of random paths must not grow what is remembered
                f"idempotency: a keyed request to {self.scope['method']} {self.scope['path']} was answered "
                f"{ran.recorder.status} by a route that never told its tenant ({self.middleware.tenant!r} was "
                "not among its dependencies: a mounted app's route, say), so nothing was claimed or recorded and "
                "its retries run again. Add the dependency to that route, or leave it uncovered",
            )
        super()._finish()

    async def _scope_key(self) -> bool:
        if await self._read_body():
            wait_for_the_app(self)
            await self._execute()
        return False

    async def _keyless(self) -> None:
        if self.policy.transactional:
            self._transaction()
        wait_for_the_app(self)  # the context carries the tenant the app tells (claim_for)
        await self._execute()

    async def claim_for(self, tenant: str | None) -> IdempotencyContext:
        """Steps 2 and 4, for the tenant the app tells (``idempotency_mw.claim``). Raises :class:`ClaimAnswered` when
        the answer went out without the handler (a refusal, a replay, a conflict)."""
        state = take_pending(self, tenant)
        keyed = self.ask.key is not None
        if self.refusal is None and keyed:
            if tenant is None:
                self.refusal = problems.tenant_unknown_to(self.middleware.tenant, self.middleware.notices)
            elif not self.ask.scope_to(tenant, route_owns_it=False):  # in the namespace of routes' own tenants
                self.refusal = problems.tenant_reserved(self.middleware.tenant, self.middleware.notices)
        if self.refusal is not None:
            await self._refuse(*self.refusal)
            raise ClaimAnswered
        self.ask.tenant = self.ask.owner = tenant or ""
        if not keyed and not self.policy.transactional:  # nothing to claim or begin: the context alone
            self._set_context()
        elif not (await self._claim() if keyed else await self._begin()):  # keyless: no record
            raise ClaimAnswered
        context = state.get(STATE_KEY)
        assert isinstance(context, IdempotencyContext)
        return context


class SwitchedOffRequest(IdempotentRequest):
    """The off switch: nothing is claimed, recorded or answered here. The handler runs as it would without the
    middleware, with its context (the key and tenant read leniently: ``downstream_key`` gives what it gives when
    switched on), and a transactional route still gets its transaction, committed when its answer is final, and its
    steps, which all run and are never recorded."""

    run_type = UnrecordedRun

    async def run(self) -> None:
        try:
            if callable(self.policy.key_from):  # over the cap, or cut short: no key; the handler gets it as sent
                await self.body.read_all(self.headers.content_length)
            try:
                if self.body.read or not callable(self.policy.key_from):
                    self.ask.key = self._key()
            except (MissingKey, InvalidKey):
                pass
            if self.middleware.tenant_from_app is not None and self.policy.tenant is None:
                wait_for_the_app(self)  # the app tells the tenant (claim_for), then the handler runs
                return await self._execute()
            tenant = None
            if self.ask.key is not None:  # the resolver is asked only about a key, as when switched on
                resolver = self.policy.tenant or self.middleware.tenant
                tenant = await resolve_tenant(resolver, self.scope)  # type: ignore[arg-type]  # not from the app
            self._scope_to(tenant)
            if not self.policy.transactional:
                self._set_context()
                return await self.middleware.app(self.scope, self.body.receive, self.send)
            if await self._begin():
                await self._execute()
        finally:
            self._finish()

    async def claim_for(self, tenant: str | None) -> IdempotencyContext:
        """Nothing to claim: the context, and a transactional route's transaction."""
        state = take_pending(self, tenant)
        self._scope_to(tenant)
        if not (await self._begin() if self.policy.transactional else self._set_context()):
            raise ClaimAnswered
        context = state.get(STATE_KEY)
        assert isinstance(context, IdempotencyContext)
        return context

    def _scope_to(self, tenant: str | None) -> None:
        """The tenant the context carries; without one the key scopes nothing."""
        self.ask.tenant = self.ask.owner = tenant or ""
        if tenant is None:
            self.ask.key = None


def take_pending(request: IdempotentRequest, tenant: object) -> dict[str, object]:
    """The request's state, once its pending claim is taken (once only), for a tenant that is a str or None."""
    state: dict[str, object] = request.scope.setdefault("state", {})
    if state.pop(PENDING_KEY, None) is not request:
        raise RuntimeError("the claim of this request was taken already")
    if tenant is not None and not isinstance(tenant, str):
        raise TypeError(f"the tenant of a request must be a str or None, not {type(tenant).__name__}")
    return state


def not_committed(ran: TransactionalRun, middleware: Middleware) -> problems.Refusal:
    """What the client of a transaction that did not commit hears: what a retry would (409 when a newer claim owns the
    key, 503 when the database could not be reached). One the database refused fails as the handler's error (a
    deferred constraint at COMMIT, an error that aborted it, the handler ending it itself): nothing committed, and
    the key is free again."""
    failure, retry_after = ran.failure, middleware.retry_after
    if ran.state is State.FENCED_OUT:  # our writes were rolled back; the key is another claim's
        return problems.in_progress(retry_after), Outcome.FENCED_OUT
    if ran.state is State.NOT_RESUMABLE:  # an unrepeatable step of an earlier attempt has no recorded outcome
        step = ran.unresumable if isinstance(ran, SteppedRun) else None
        return problems.step_not_resumable(step or "unknown"), Outcome.NOT_RESUMABLE
    assert failure is not None
    if ran.state is not State.UNAVAILABLE:
        logger.error("idempotency: %s", refusal(failure))
        raise failure
    middleware.failures.failed("run the handler's transaction", failure)
    return problems.store_unavailable(retry_after), store_failure(failure)


def wait_for_the_app(request: IdempotentRequest) -> None:
    """The app tells the request's tenant from inside (``claim_for``); then the handler runs."""
    request.step = Step.WAITING  # from STARTED: nothing was asked of the store yet
    request.scope.setdefault("state", {})[PENDING_KEY] = request
