"""Observe only (``observe=True``): a covered request runs and is answered exactly as without the middleware, while
the middleware does on the side what enforcing does before the handler runs, and reports what enforcing would have
done. For a rollout: observe app-wide, then enforce route by route, then require keys (docs/rollout.md).

An observed request is the off switch's (``SwitchedOffRequest``: the handler runs as without the middleware, with
its context, and a transactional route in its transaction) plus steps 1 to 4 of docs/design.md §2 taken leniently:
the key and its tenant, the body under its cap, the fingerprint, a claim through the store. What they find is
reported, never answered:

- a key enforcing would refuse (missing where required, malformed, outside the route's format, or its tenant
  unknown), a body over the cap (the handler still gets every byte), a store that fails: reported, and the request
  proceeds;
- a record completed (would replay), running (would 409, never waited for) or of another request (would 422):
  reported, and the handler runs all the same, recording nothing;
- a fresh claim: the handler runs, and its response, which goes out untouched, is recorded as a plain run records it
  (``PlainRun``), so that a retry replays it once the route enforces; a transient answer releases the key.

On a transactional route the record stays out of the handler's transaction: the claim and the completion go through
the store's own connections, and the completion is written as the final body message passes, after the transaction
committed (the key is released when it did not).

The event is what enforcing would have done, marked ``observed`` (:class:`ObservedReport`), with the status that
went out: metrics count it apart, so that a dashboard never counts a would-be replay as a replay.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from functools import partial
from typing import cast

from starlette.types import Message, Receive, Scope, Send

from idempotency_mw import _problems as problems
from idempotency_mw._channels import Read, handler_scope
from idempotency_mw._claim import outlasting, start_eagerly, store_failure
from idempotency_mw._context import PENDING_KEY, STATE_KEY, ClaimAnswered, IdempotencyContext
from idempotency_mw._events import OBSERVED_LOG_LEVELS, Outcome
from idempotency_mw._keys import (
    AuthorizationTenant,
    InvalidKey,
    KeyFunctionFailed,
    MissingKey,
    outlived,
    passes_unscoped,
    resolve_tenant,
)
from idempotency_mw._plain import PlainRun
from idempotency_mw._policy import RouteMatch
from idempotency_mw._request import (
    IdempotentRequest,
    Middleware,
    Report,
    Step,
    fails_open,
    not_committed,
    take_pending,
    wait_for_the_app,
)
from idempotency_mw._stepped import SteppedRun, UnrecordedRun
from idempotency_mw._transactional import DID_NOT_COMMIT
from idempotency_mw.store import ClaimOutcome, Transaction, TransactionalStore


class ObservedReport(Report):
    """The event of an observed request: ``observed``, its outcome what enforcing would have done; logged at INFO
    where that is not what the app did."""

    __slots__ = ()
    observed = True
    levels = OBSERVED_LOG_LEVELS


class ObservingRequest(IdempotentRequest):
    """A covered request on a route that observes: run and answered as without the middleware; what enforcing would
    have answered instead of running it goes to ``would``, and a fresh claim to the recording run (``ran``)."""

    def __init__(self, middleware: Middleware, route: RouteMatch, scope: Scope, receive: Receive, send: Send) -> None:
        super().__init__(middleware, route, scope, receive, send)
        self.report = ObservedReport(middleware.on_event, scope, route.template)
        self.ran = PlainRun(self.policy, self._send_out)  # records a fresh claim's response; else passes it on
        self.would: Outcome | None = None  # what enforcing would have answered instead of running the handler
        self.status: int | None = None  # the status that went out
        self.from_app = middleware.tenant_from_app is not None and self.policy.tenant is None  # told from inside
        self.transaction: UnrecordedRun | None = None  # a transactional route's, as when switched off
        self.cannot_run = False  # its transaction could not begin: answered 503, and what the app sends is dropped
        self.scoped = False  # the key has its tenant: the handler's context carries it

    async def run(self) -> None:
        try:
            await self._observe()
            if self.from_app:
                wait_for_the_app(self)  # steps 2 and 4 once the app tells the tenant (claim_for), then the handler
            await self._execute()
        finally:
            self._finish()

    # -- 1. to 4., on the side --------------------------------------------------------------------------------------

    async def _observe(self) -> None:
        """Steps 1 to 4 as enforcing takes them, answering nothing; they stop where enforcing would have."""
        if callable(self.policy.key_from) and not await self._read_leniently():
            return  # a webhook's key is in its body: over the cap (would 413), or the client left
        if not self._key_leniently():
            return
        if not self.from_app and not await self._scope_leniently():
            return
        if await self._read_leniently() and not self.from_app:  # the app's tenant: claimed once it tells it
            await self._claim_on_the_side()

    def _key_leniently(self) -> bool:
        """1. The key; False when there is none to claim with: none sent where none is required (no event, as when
        enforcing), or one enforcing would refuse (``would``)."""
        try:
            self.ask.key = self._key()
            return True
        except MissingKey:
            if self.policy.required:
                self.would = Outcome.KEY_MISSING
        except KeyFunctionFailed as error:
            self.would = problems.key_function_failed(error, self.middleware.notices)[1]
        except InvalidKey:
            self.would = Outcome.KEY_INVALID
        return False

    async def _scope_leniently(self) -> bool:
        """2. The key's tenant; False where enforcing would go no further: a tenant it would refuse (``would``), or
        none for a request it lets through untouched (a browser without a session)."""
        resolver = self.policy.tenant or self.middleware.tenant
        try:
            if isinstance(resolver, AuthorizationTenant):  # the default: its header values are picked out already
                tenant = resolver.of(self.headers.authorization)
                alternates = resolver.alternates(self.headers.authorization)
            else:  # not from the app: a resolver's
                tenant, alternates = await resolve_tenant(resolver, self.scope), ()  # type: ignore[arg-type]
        except Exception as error:  # enforcing, the request would fail with it; observing, it proceeds
            self.middleware.notices.once(
                "observed resolver",
                f"idempotency: the tenant resolver {resolver!r} raised on a request of a route that observes: the "
                "request ran, reported as tenant_unknown; enforcing, such a request fails with this error. Logged "
                "once per middleware.",
                error=error,
            )
            tenant, alternates = None, ()
        if tenant is None:
            if not passes_unscoped(resolver) or self.policy.required:
                self.would = problems.tenant_unknown_to(resolver, self.middleware.notices)[1]
            return False
        if not self.ask.scope_to(tenant, route_owns_it=self.policy.tenant is not None, alternates=alternates):
            self.would = problems.tenant_reserved(resolver, self.middleware.notices)[1]
            return False
        self.scoped = True
        return True

    async def _read_leniently(self) -> bool:
        """3. The body under the cap, and the fingerprint; False when there is nothing to fingerprint: over the cap
        (``would``; the handler gets what was read, then the rest as it comes) or the client left."""
        body = self.body
        if body.read:
            return True
        read = await body.read_all(self.headers.content_length)
        if read is Read.TOO_LARGE:
            self.would = Outcome.REQUEST_TOO_LARGE
        if read is not Read.WHOLE:
            return False
        keys = self.middleware.fingerprint_keys
        self.ask.fingerprint(self.scope, self.headers.content_type, body.body, self.policy, keys)
        return True

    async def _claim_on_the_side(self) -> None:
        """4. The claim, through the store, never on the handler's connection, and never waiting for a running
        original. A fresh claim is the recording run's; anything else, and a store that fails, is ``would``."""
        self._to(Step.CLAIMING)
        middleware, policy, report = self.middleware, self.policy, self.report
        report.reach_store(middleware.on_started)
        store = middleware.store
        earlier = middleware.earlier and partial(middleware.earlier, self.scope, self.body.body)  # a cutover
        claiming = self.ask.claim(store, store, lease=policy.lease, ttl=policy.ttl, earlier=earlier)
        task = start_eagerly(claiming, "idempotency claim")  # a cancellation must not lose a claim that landed
        started = time.perf_counter()
        try:
            claim = await outlasting(task)
        except asyncio.CancelledError:
            self.abandoning = asyncio.ensure_future(self._abandon(task, None))  # released once known to be ours
            raise
        except Exception as error:
            del task  # it holds the error, whose traceback holds this frame: the request would be left in a cycle
            middleware.failures.failed("claim a key", error)
            unprotected = fails_open(policy, error)  # enforcing, it would run without a record
            self.would = Outcome.UNPROTECTED if unprotected else store_failure(error)
            return
        finally:
            report.store_seconds += time.perf_counter() - started
        report.attempts = claim.attempts
        if middleware.failures.failing:
            middleware.failures.succeeded()
        if claim.outcome is ClaimOutcome.OWNED:
            self.owned = self._own(claim)
            self._to(Step.RUNNING)
            self.recording.claimed(self.owned)
            if policy.check_uuid7_age and outlived(self.owned.key, policy.ttl):
                self.would = Outcome.KEY_EXPIRED  # recorded all the same: the handler runs
        elif claim.outcome is ClaimOutcome.COMPLETED and claim.response is not None and claim.response.body is not None:
            self.would = Outcome.REPLAYED
        else:
            self.would = problems.answer_to(claim, middleware.retry_after, policy)[1]

    async def claim_for(self, tenant: str | None) -> IdempotencyContext:
        """Steps 2 and 4 for the tenant the app tells, on the side (never :class:`ClaimAnswered` for them); then the
        handler's context, and a transactional route's transaction."""
        state = take_pending(self, tenant)
        middleware, keyed = self.middleware, self.ask.key is not None and self.would is None
        if tenant is not None and self.ask.scope_to(tenant, route_owns_it=False):
            self.scoped = True
            if keyed and self.ask.digests:  # and its body was read whole
                await self._claim_on_the_side()
        elif keyed:  # a tenant enforcing would refuse
            refused = problems.tenant_unknown_to if tenant is None else problems.tenant_reserved
            self.would = refused(middleware.tenant, middleware.notices)[1]
        if self.transaction is not None and not await self._begin_observed(self.transaction):
            raise ClaimAnswered  # answered 503: the handler's transaction could not begin
        if self.transaction is None:
            self._set_context()
        context = state.get(STATE_KEY)
        assert isinstance(context, IdempotencyContext)
        return context

    # -- 5. and 6., as without the middleware -----------------------------------------------------------------------

    @property
    def recording(self) -> PlainRun:
        assert isinstance(self.ran, PlainRun)
        return self.ran

    async def _execute(self) -> None:
        """The handler, as without the middleware (a transactional route in its transaction, as when switched off), its
        response going out untouched; a fresh claim's recording settles as the final body message passes."""
        transactional = self.policy.transactional
        if not transactional and not self.from_app:
            self._set_context()
        app = self._in_transaction if transactional else self.middleware.app
        try:
            await self.recording.run(app, handler_scope(self.scope), self.body.receive)
        except Exception:
            if not self.cannot_run:
                raise  # the app's own error, as without the middleware
        finally:
            if self.owned is not None:
                self.owned.drop_lease()

    async def _in_transaction(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The handler in its transaction, as when switched off: the ASGI app that the recording run runs. Its writes
        commit when its answer is final; the record is not among them. One that did not commit is answered as when
        switched off (503, or the database's error)."""
        store = cast(TransactionalStore, self.middleware.store)  # checked when the middleware was built
        ran = self.transaction = UnrecordedRun(store, self.policy, send)
        if not self.from_app and not await self._begin_observed(ran):
            return
        try:
            state = await ran.run(self.middleware.app, scope, receive)
        except BaseException:
            if self.cannot_run or ran.state not in DID_NOT_COMMIT:
                raise
            state = ran.state
        if state in DID_NOT_COMMIT:
            await not_committed(ran, self.middleware)[0].send(send)

    async def _begin_observed(self, ran: UnrecordedRun) -> bool:
        """Begin the handler's transaction, without a record in it; False when it could not begin (the database is
        down): then answered 503 as when switched off, reported, and what the app sends after is dropped."""
        if await ran.begin(None, self.ask.owner):
            return self._set_context(ran.transaction, ran)
        assert ran.failure is not None
        self.middleware.failures.failed("run the handler's transaction", ran.failure)
        self.would = self.would or store_failure(ran.failure)
        await problems.store_unavailable(self.middleware.retry_after).send(self._send_out)
        self.cannot_run = True
        return False

    def _set_context(self, transaction: Transaction | None = None, ran: SteppedRun | None = None) -> bool:
        """The handler's context, as when switched off: a key without a tenant scopes nothing, and a transactional
        route's steps all run, none recorded (``UnrecordedRun``)."""
        key = self.ask.key if self.scoped else None
        steps = None if ran is None else weakref.ref(ran)
        self.scope.setdefault("state", {})[STATE_KEY] = IdempotencyContext(self.ask.owner, key, transaction, steps)
        return True

    # -- the report -------------------------------------------------------------------------------------------------

    async def _send_out(self, message: Message) -> None:
        """What the app sends, on to the client as it is; its status noted for the event. A fresh claim's recording
        has settled by the time its final body message gets here: reported then, before it goes out."""
        if self.cannot_run:
            return
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif self.report.outcome is None and message["type"] == "http.response.body" and not message.get("more_body"):
            if (settled := self.recording.outcome) is not None:
                self._decide(*settled)
            elif self.owned is None and (would := self._reported_would()) is not None:
                self._decide(would, self.status)
        await self.send(message)

    def _decide(self, outcome: Outcome, status: int | None) -> None:
        """What enforcing would have answered instead of running the handler, where it would not have run it; else
        how the recording settled; with the status that went out (None when none did)."""
        super()._decide(self.would or outcome, self.status)

    def _reported_would(self) -> Outcome | None:
        """``would``, if it is the request's event: not for a request the app answered itself before it told its
        tenant (its 401), as when enforcing; but a body over the cap, which enforcing answers before the app runs."""
        told = self.scope.get("state", {}).get(PENDING_KEY) is not self
        return self.would if told or self.would is Outcome.REQUEST_TOO_LARGE else None

    def _finish(self) -> None:
        """A request whose response never finished (the app raised) is reported as it ends."""
        if self.report.outcome is None and self.owned is None and (would := self._reported_would()) is not None:
            self._decide(would, self.status)
        super()._finish()
        self.transaction = None  # it refers back to this request through the recording run
