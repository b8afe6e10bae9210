"""The Idempotency-Key middleware: the whole request flow, in the order it happens (docs/design.md §2).

``IdempotencyMiddleware`` holds the configuration and picks the requests it covers; ``IdempotentRequest`` owns one
covered request, from its key to its recorded (or released) response, and reads top to bottom in ``run``.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import time
from collections.abc import Awaitable, Mapping
from typing import Any, TypeVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from idempotency_mw import problems
from idempotency_mw.capture import ResponseRecorder, replay
from idempotency_mw.context import (
    NOT_EXECUTED_KEY,
    PENDING_KEY,
    STATE_KEY,
    ClaimAnswered,
    IdempotencyContext,
)
from idempotency_mw.eager import outlasting, start_eagerly
from idempotency_mw.events import Event, EventHook, Outcome, hash_key, log_event, log_level, logger
from idempotency_mw.failures import FailureLog
from idempotency_mw.fingerprint import fingerprint
from idempotency_mw.keys import InvalidKey, MissingKey, key_from_headers, uuid7_time
from idempotency_mw.leases import HeldLease, LeaseKeeper
from idempotency_mw.policy import DAY, RELEASED_STATUSES, MiB, Policy, PolicyResolver
from idempotency_mw.routes import RouteMatch, RouteTemplates
from idempotency_mw.store import (
    Claim,
    ClaimOutcome,
    PoolExhausted,
    Store,
    StoreUnavailable,
    Transaction,
    TransactionalStore,
    TransactionEnded,
)
from idempotency_mw.tenants import AuthorizationTenant, TenantFromApp, TenantResolver, requirement
from idempotency_mw.transaction import State, TransactionalRun
from idempotency_mw.wire import WITHHELD_EXTENSIONS

T = TypeVar("T")


class IdempotencyMiddleware:
    """Make covered requests (POST and PATCH by default) that carry an ``Idempotency-Key`` run at most once.

    ``app.add_middleware(IdempotencyMiddleware, store=PostgresStore(dsn))``. Every keyword below is also a
    field of :class:`~idempotency_mw.policy.Policy`, except:

    - ``tenant``: maps the ASGI scope to the tenant that owns the key (sync or async), or to None when it cannot
      tell (the keyed request is then refused with 400); by default
      :class:`~idempotency_mw.tenants.AuthorizationTenant`, an HMAC of the ``Authorization`` header keyed by
      ``IDEMPOTENCY_TENANT_SECRET``. Or a :class:`~idempotency_mw.tenants.TenantFromApp`, when the app
      authenticates inside the request and tells the tenant itself (``idempotency_mw.fastapi.TenantDependency``).
    - ``routes``: per-path overrides, ``{"/v1/refunds*": {"required": True}}`` (``*`` matches anything).
    - ``on_event``: called with an :class:`~idempotency_mw.events.Event` when a keyed request ends; if it also
      has a ``started(scope)`` method, that is called when the request reaches the store (metrics use it for
      an in-flight gauge).
    - ``retry_after``: the ``Retry-After`` seconds sent with 409 and 503.
    """

    def __init__(
        self,
        app: ASGIApp,
        store: Store,
        *,
        tenant: TenantResolver | TenantFromApp | None = None,
        methods: tuple[str, ...] | frozenset[str] = ("POST", "PATCH"),
        required: bool = False,
        ttl: float = DAY,
        lease: float = 30.0,
        transactional: bool = False,
        fail_open: bool = False,
        max_request_bytes: int = MiB,
        max_response_bytes: int = 8 * MiB,
        released_statuses: frozenset[int] = RELEASED_STATUSES,
        retry_window: float | None = None,
        check_uuid7_age: bool = False,
        routes: Mapping[str, Mapping[str, Any]] | None = None,
        on_event: EventHook | None = log_event,
        retry_after: int = 1,
    ) -> None:
        if tenant is None:
            tenant = AuthorizationTenant()  # fails here, with what to set, when no secret is configured
        if not (isinstance(tenant, TenantFromApp) or callable(tenant)):
            raise TypeError("tenant must be a callable taking the ASGI scope, or a TenantFromApp")
        if not isinstance(retry_after, int) or retry_after < 0:
            raise ValueError("retry_after must be a whole number of seconds >= 0")
        default = Policy(
            required=required,
            ttl=ttl,
            lease=lease,
            transactional=transactional,
            fail_open=fail_open,
            max_request_bytes=max_request_bytes,
            max_response_bytes=max_response_bytes,
            released_statuses=frozenset(released_statuses),
            methods=methods,  # type: ignore[arg-type]  # a collection; Policy checks and freezes it
            retry_window=retry_window,
            check_uuid7_age=check_uuid7_age,
        )
        self.app = app
        self.store = store
        self.tenant = tenant
        self.tenant_from_app = tenant if isinstance(tenant, TenantFromApp) else None
        self.tenant_unknown_logged = False  # the operator hears of unscoped keyed requests once, not per request
        self.policies = PolicyResolver.build(default, routes or {})
        self.failures = FailureLog(logger)  # store failures: the first in full, then a summary now and then
        self.leases = LeaseKeeper(store, self.failures)  # renews the lease of every handler still running
        self.routes = RouteTemplates(app)  # until the routes are scanned (at startup, or the first request)
        self.on_event = on_event
        self.on_started = getattr(on_event, "started", None)
        self.retry_after = retry_after
        self._check_transactional(default, *(p for _, p in self.policies.patterns))

    def _check_transactional(self, *policies: Policy) -> None:
        if any(p.transactional for p in policies) and not isinstance(self.store, TransactionalStore):
            raise TypeError(
                f"transactional mode needs a store with database transactions (PostgresStore, or SQLAlchemyStore "
                f"from idempotency_mw.sqlalchemy), "
                f"not {type(self.store).__name__}"
            )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                return await self._lifespan(scope, receive, send)
            return await self.app(scope, receive, send)
        if not self.policies.scanned:  # no lifespan (a test transport): requests scan until a scan succeeds
            self._scan(scope)
        if scope["method"] not in self.policies.methods:
            await self.app(scope, receive, send)
            return
        policy = self.policies.resolve(scope)
        if scope["method"] not in policy.methods:
            await self.app(scope, receive, send)
            return
        route = self.route_of(scope["method"], scope["path"], scope.get("root_path", ""))
        if route.routed is False:  # the router answers 404 or 405 (or redirects): nothing runs, nothing to claim
            await self.app(scope, receive, send)
            return
        await IdempotentRequest(self, policy, route.template, scope, receive, send).run()

    def _scan(self, scope: Scope) -> None:
        """Read the app's routes, which are all declared by now: their ``@idempotent`` declarations, their templates
        (to label events by route), and, with a tenant the app tells, whether every covered route tells it."""
        app = scope.get("app", self.app)
        self.policies.scan(app, check=lambda found: self._check_transactional(*found))
        if self.tenant_from_app is not None:
            self.tenant_from_app.check(app, self._covers)
        self.routes = RouteTemplates(app)

    def _covers(self, endpoint: Any, path: str, methods: frozenset[str] | None) -> bool:
        """Whether a route (its endpoint, path template and methods) takes requests this middleware covers."""
        covered = self.policies.for_endpoint(endpoint, path).methods
        return bool(covered) if methods is None else not covered.isdisjoint(methods)

    def route_of(self, method: str, path: str, root_path: str) -> RouteMatch:
        """The route a request is for (its template, ``/v1/charges/{id}``, or ``<unmatched>``), and whether one takes
        it. Give the path and root path as the request arrived: the router rewrites ``scope["root_path"]`` on its
        way through a Mount."""
        if root_path and path.startswith(root_path):
            path = path[len(root_path) :]
        return self.routes.match(method, path)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Check the per-route policies at startup, so a bad one stops the server instead of the first payment."""
        first = await receive()
        if first["type"] == "lifespan.startup" and not self.policies.scanned:
            try:
                self._scan(scope)
            except (TypeError, ValueError) as error:
                await send({"type": "lifespan.startup.failed", "message": f"idempotency_mw: {error}"})
                return
        delivered = False

        async def receive_again() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return first
            return await receive()

        await self.app(scope, receive_again, send)


class Phase(enum.Enum):
    """Where a covered request is; it only moves forward. What it ends with is its :class:`Outcome`, decided once."""

    STARTED = "started"  # key, tenant and body being read; nothing asked of the store yet
    WAITING = "waiting"  # its tenant is the app's to tell: the app runs, and will claim from inside (claim_for)
    CLAIMING = "claiming"  # the claim is on its way to the store
    RUNNING = "running"  # the key is ours: the handler runs, its lease renewed
    SETTLING = "settling"  # its answer is being recorded, or its key released
    ANSWERED = "answered"  # the outcome is decided, and reported


class IdempotentRequest:
    """One covered request, from its key to its recorded (or released) response."""

    def __init__(
        self,
        middleware: IdempotencyMiddleware,
        policy: Policy,
        route: str,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        self.middleware = middleware
        self.store = middleware.store
        self.policy = policy
        self.route = route  # the template of the route it is for, to label its event
        self.scope = scope
        self.path = scope["path"]  # before the router rewrites it
        self.receive = receive
        self.send = send
        self.phase = Phase.STARTED
        self.key: str | None = None
        self.tenant = ""
        self.body = b""
        self.body_delivered = False
        self.digest = b""
        self.fence: int | None = None
        self.refusal: tuple[problems.Problem, Outcome] | None = None  # a bad key, once the tenant is known
        self.outcome: Outcome | None = None
        self.status: int | None = None
        self.started = time.perf_counter()
        self.store_seconds = 0.0
        self.attempts = 0
        self.reached_store = False
        self.lease: HeldLease | None = None
        self.recorder: ResponseRecorder | None = None  # the response on its way out, in plain mode
        self.transaction: TransactionalRun | None = None  # the request's connection and transaction, if any
        self.settling: asyncio.Future[Outcome] | None = None

    async def run(self) -> None:
        """Steps 1 to 7 of docs/design.md §2, in the order they happen."""
        try:
            if self.policy.transactional:  # its connection and transaction, claimed and begun below
                self.transaction = self._transactional_run()
            # 1. The key, validated before anything touches the store.
            try:
                self.key = key_from_headers(self.scope["headers"])
            except MissingKey:
                if self.policy.required:
                    self.refusal = (problems.key_missing(), Outcome.KEY_MISSING)
                elif self.policy.transactional:
                    self.body_delivered = True  # nothing was buffered: the handler reads the real channel
                    return await self._run_keyless_transaction()
                else:
                    return await self.middleware.app(self.scope, self.receive, self.send)  # not ours: untouched
            except InvalidKey as error:
                self.refusal = (problems.key_invalid(str(error)), Outcome.KEY_INVALID)

            if self.middleware.tenant_from_app is not None:
                # 2. and 4. inside the app, once its own authentication has answered: it calls claim_for.
                if await self._read_body():
                    self.phase = Phase.WAITING
                    self.scope.setdefault("state", {})[PENDING_KEY] = self
                    await self._execute()
                return

            # 2. The tenant: none means the key cannot be scoped, and an unscoped key must never meet another's.
            if self.refusal is None:
                tenant = self.middleware.tenant(self.scope)  # type: ignore[operator]  # not a TenantFromApp here
                if tenant is not None and not isinstance(tenant, str):
                    tenant = await self._awaited_tenant(tenant)
                if tenant is None:
                    self.refusal = self._tenant_unknown()
                else:
                    self.tenant = tenant
            if self.refusal is not None:
                return await self._refuse(*self.refusal)

            # 3. The body, capped, and its fingerprint; 4. the claim, which decides what happens next.
            if await self._read_body() and await self._claim():
                # 5. and 6. The key is ours: run the handler, then record its answer or release the key.
                await self._execute()
        finally:
            self._report()
            # What refers back to this request goes, so that it is freed as it ends, not by the cycle collector.
            self.transaction = None
            self.scope.get("state", {}).pop(PENDING_KEY, None)

    async def claim_for(self, tenant: str | None) -> IdempotencyContext:
        """Steps 2 and 4 for a tenant the app tells from inside the request (``context.claim``): the refusals of
        step 1 wait for it, so that the app's own authentication answers first. Raises :class:`ClaimAnswered` when
        the answer went out without the handler (a refusal, a replay, a conflict)."""
        state = self.scope.setdefault("state", {})
        if state.pop(PENDING_KEY, None) is not self:
            raise RuntimeError("the claim of this request was taken already")
        if tenant is not None and not isinstance(tenant, str):
            raise TypeError(f"the tenant of a request must be a str or None, not {type(tenant).__name__}")
        if self.refusal is None and tenant is None and self.key is not None:
            self.refusal = self._tenant_unknown()
        if self.refusal is not None:
            await self._refuse(*self.refusal)
            raise ClaimAnswered
        self.tenant = tenant or ""
        if self.key is None:  # a keyless request on a transactional route: its transaction, no record
            if not await self._begin():
                raise ClaimAnswered
        elif not await self._claim():
            raise ClaimAnswered
        context = state.get(STATE_KEY)
        assert isinstance(context, IdempotencyContext)
        return context

    # -- 4. the claim -----------------------------------------------------------------------------------------

    async def _claim(self) -> bool:
        """Claim the key: True when it is ours (the handler may run), False when the request was answered (a
        replay, a conflict, a refusal; or, failing open, the handler ran unprotected)."""
        assert self.key is not None
        self.phase = Phase.CLAIMING
        self._notify_started()
        policy = self.policy
        if self.transaction is not None:
            claiming = self.transaction.claim(self.tenant, self.key, self.digest, lease=policy.lease, ttl=policy.ttl)
        else:
            claiming = self.store.claim(self.tenant, self.key, self.digest, lease=policy.lease, ttl=policy.ttl)
        started = time.perf_counter()
        task = start_eagerly(claiming, "idempotency claim")  # a cancellation must not lose a claim that landed
        try:
            claim = await outlasting(task)
        except asyncio.CancelledError:
            # Cancelled (a server shutting down, an outer timeout) while the claim was on its way: it may have
            # landed. A claim that turns out to be ours is released, so the key is not left to its lease.
            self.settling = asyncio.ensure_future(self._abandon(task))
            raise
        except (TypeError, ValueError):
            raise  # a store set up wrong (an engine in AUTOCOMMIT, say) says so, rather than as an outage
        except Exception as error:
            self.store_seconds += time.perf_counter() - started
            self.middleware.failures.failed("claim a key", error)
            if policy.fail_open:
                self._decide(Outcome.UNPROTECTED, None)
                await self.middleware.app(self.scope, self._receive_buffered, self._send_tracked)
                return False
            await self._refuse(problems.store_unavailable(self.middleware.retry_after), _store_failure(error))
            return False
        del task  # finished: not kept alive through the handler's run
        self.store_seconds += time.perf_counter() - started
        self.middleware.failures.succeeded()
        self.attempts = claim.attempts
        if claim.outcome is not ClaimOutcome.OWNED:
            await self._answer(claim)
            return False
        self.fence = claim.fence
        if policy.check_uuid7_age and self._key_outlived_retention():
            # No record is left to compare with: running now could repeat an operation whose record was purged.
            await self._release()
            if self.transaction is not None:
                await self.transaction.close()
            await self._refuse(problems.key_expired(int(policy.ttl)), Outcome.KEY_EXPIRED)
            return False
        self.lease = self.middleware.leases.hold(self.tenant, self.key, claim.fence, policy.lease)
        self.phase = Phase.RUNNING
        if self.transaction is None:
            self._set_context(IdempotencyContext(self.tenant, self.key))
        elif not await self._begin():
            return False
        return True

    async def _abandon(self, claiming: asyncio.Future[Claim]) -> Outcome:
        """The claim of a request that was cancelled: released once it is known to be ours."""
        try:
            claim = await claiming
        except Exception:
            return Outcome.STORE_ERROR  # the claim failed: nothing of it is left
        if claim.outcome is ClaimOutcome.OWNED:
            self.fence = claim.fence
            return await self._release()
        return Outcome.CANCELLED

    async def _answer(self, claim: Claim) -> None:
        """A claim that is not ours: a different request (422), one still running (409), or one completed: replayed
        (7.), or a 409 when its response was not stored in full."""
        if claim.outcome is ClaimOutcome.MISMATCH:
            await self._refuse(problems.key_reused(), Outcome.KEY_REUSED)
        elif claim.outcome is ClaimOutcome.IN_PROGRESS:
            await self._refuse(problems.in_progress(self.middleware.retry_after), Outcome.IN_PROGRESS)
        else:
            response = claim.response
            assert response is not None  # COMPLETED: the other outcome, OWNED, runs the handler
            if response.body is None:  # completed, but not stored in full (over the cap, or cut short)
                problem = problems.response_not_replayable(
                    response.status, response.body_size, self.policy.max_response_bytes
                )
                await self._refuse(problem, Outcome.NOT_REPLAYABLE)
            else:
                # 7. Replay.
                self._decide(Outcome.REPLAYED, response.status)
                await replay(response, self.send)

    # -- 5. and 6. running the handler, then recording or releasing -----------------------------------------

    async def _execute(self) -> None:
        """Run the handler with its response copied on the way out (plain mode) or held in its transaction."""
        try:
            if self.policy.transactional:
                await self._execute_in_transaction()
            else:
                await self._execute_plainly()
        except ClaimAnswered:
            pass  # the middleware answered from inside the app (claim_for): the handler did not run
        finally:
            self._drop_lease()

    async def _execute_plainly(self) -> None:
        """Settle as the response's final body message passes: before it reaches the client, and before anything the
        app runs after its response (background tasks). A response that never finished (an error, a cancelled
        request, a stream cut short) is settled all the same; a cancelled request does not wait for that."""
        self.recorder = ResponseRecorder(self._downstream(), max_body=self.policy.max_response_bytes)
        try:
            await self.middleware.app(self._app_scope(), self._receive_buffered, self._send_recorded)
        except asyncio.CancelledError:
            self._start_settling()
            raise
        except BaseException:
            await self._settle()
            raise
        await self._settle()

    async def _send_recorded(self, message: Message) -> None:
        """The handler's ``send``: copy each message, and settle before the final body message goes on."""
        if self.fence is None:  # the app answered before its tenant claimed the key (its own 401): untouched
            return await self._send_downstream(message)
        assert self.recorder is not None
        going, decide = self.recorder.record(message)
        if decide:
            await self._settle()
        if going is not None:
            await self.recorder.forward(going)

    async def _settle(self) -> None:
        """Record a final answer, release anything else, once, and report it before the final body goes out (while
        a server span still records).

        In a task of its own, waited for through ``outlasting``: a request cancelled while its outcome is being
        written (a server shutting down, an outer timeout) still finishes writing it, or the key would stay in
        progress and the handler run again once the lease lapsed. A final answer that started going out is recorded
        even when it was cut short: its effect has happened, so the retry must not run it again; such a record has
        no body, and a retry is told that the response cannot be replayed."""
        if self.fence is None or self.phase is Phase.ANSWERED:
            return  # nothing of ours to settle: never claimed, or already settled
        outcome = await outlasting(self._start_settling())
        self._decide(outcome, self.status)

    def _start_settling(self) -> asyncio.Future[Outcome]:
        if self.settling is None:
            self.phase = Phase.SETTLING
            self.settling = start_eagerly(self._record_or_release(), "idempotency settlement")
        return self.settling

    async def _record_or_release(self) -> Outcome:
        recorder = self.recorder
        assert recorder is not None
        assert self.key is not None
        assert self.fence is not None
        self._drop_lease()
        self.status = recorder.status
        if not self._is_final(recorder.status):
            return await self._release()
        started = time.perf_counter()
        response = recorder.stored_response()
        try:
            try:
                completed = await self.store.complete(self.tenant, self.key, self.fence, response)
            except StoreUnavailable:
                raise
            except Exception as refused:
                # The database refused the response itself (a header it cannot hold). The effect has happened: the
                # key completes all the same, without a response to replay, rather than run again after its lease.
                self.middleware.failures.failed("store a response (the key completes without it)", refused)
                completed = await self.store.complete(self.tenant, self.key, self.fence, response.unreplayable())
        except Exception as error:
            # The client has its response; the claim stays until its lease lapses, then a retry runs again.
            self.middleware.failures.failed("record a completed response", error)
            return _store_failure(error)
        finally:
            self.store_seconds += time.perf_counter() - started
        return Outcome.EXECUTED if completed else Outcome.FENCED_OUT

    async def _release(self) -> Outcome:
        """Free the key for the retry. Shielded: it must happen even when the request was cancelled."""
        assert self.key is not None
        assert self.fence is not None
        try:
            await asyncio.shield(self._timed(self.store.release(self.tenant, self.key, self.fence)))
        except Exception as error:
            self.middleware.failures.failed("release a key (it frees itself when its lease lapses)", error)
            return _store_failure(error)
        return Outcome.RELEASED

    # -- 5. and 6. in a transaction (transaction.py) ----------------------------------------------------------

    def _transactional_run(self) -> TransactionalRun:
        store = self.store
        assert isinstance(store, TransactionalStore)  # checked when the middleware was built
        return TransactionalRun(
            store,
            self._downstream(),
            max_body=self.policy.max_response_bytes,
            is_final=self._is_final,
            on_settled=self._on_transaction_settled,
        )

    async def _run_keyless_transaction(self) -> None:
        """A transactional route called without a key still gets its transaction, with no record in it (begun once
        the app has told its tenant, when that is the app's to tell)."""
        if self.middleware.tenant_from_app is not None:
            self.phase = Phase.WAITING
            self.scope.setdefault("state", {})[PENDING_KEY] = self
        elif not await self._begin():
            return
        await self._execute()

    async def _begin(self) -> bool:
        """Begin the handler's transaction and lend it (``request.state.idempotency.transaction``); False when the
        database could not be reached for it, and the request was answered (503)."""
        run = self.transaction
        assert run is not None
        try:
            await run.begin(self._lend)
        except StoreUnavailable:
            await self._answer_transaction(run, None)
            await run.close()
            return False
        return True

    async def _execute_in_transaction(self) -> None:
        """Run the handler in its transaction, then answer by how that transaction ended."""
        run = self.transaction
        assert run is not None
        try:
            await run.run(self.middleware.app, self._app_scope(), self._receive_buffered)
        except BaseException as error:
            if not await self._answer_transaction(run, error):
                raise  # from here, so its traceback holds no frame that holds it (tests/test_cycles.py)
            return
        await self._answer_transaction(run, None)

    async def _answer_transaction(self, run: TransactionalRun, raised: BaseException | None) -> bool:
        """Answer by how the transaction ended, ``raised`` being what the app raised. True when that answer (a 409
        or 503) replaces it; False when it is to go on as it is."""
        self.status = run.status
        if run.state in (State.COMMITTED, State.RECORDED, State.IDLE):
            return False  # what the app raised after the commit (a background task) undoes nothing
        if run.state is State.ROLLED_BACK and raised is None:
            return False  # a transient answer: released and reported when it settled
        # Nothing committed: free the key for the retry (unless the rollback's settling freed it already), then
        # answer as the transaction ended.
        released = None
        if self.fence is not None and run.state is not State.FENCED_OUT and not run.reported:
            released = await self._release()
        if run.state is State.FENCED_OUT:
            # A newer claim owns the key: our writes were rolled back, and the client hears what a retry would.
            await self._refuse(problems.in_progress(self.middleware.retry_after), Outcome.FENCED_OUT)
            return True
        if run.state is State.UNAVAILABLE:
            assert run.failure is not None
            self.middleware.failures.failed("run the handler's transaction", run.failure)
            await self._refuse(problems.store_unavailable(self.middleware.retry_after), _store_failure(run.failure))
            return True
        if run.state is State.REFUSED:
            # The database refused the transaction itself: a deferred constraint at COMMIT, or an error the handler
            # caught but that aborted the transaction. Nothing was committed; the key is free again. Or the
            # handler ended the transaction itself, and the record was refused (TransactionEnded says so).
            assert run.failure is not None
            self._decide(released or Outcome.RELEASED, run.status)
            if isinstance(run.failure, TransactionEnded):
                logger.error("idempotency: %s", run.failure)
                raise run.failure from raised
            logger.error(
                "idempotency: the handler's transaction could not commit (%s); nothing was committed. If the "
                "handler recovers from database errors, run the statements that may fail in a savepoint "
                "(asyncpg: async with connection.transaction(): ...; "
                "SQLAlchemy: async with session.begin_nested(): ...)",
                type(run.failure).__name__,
            )
            raise run.failure from raised
        assert raised is not None  # rolled back because the handler failed, was cancelled, or never finished
        if released is not None:
            self._decide(released, run.status)
        return False

    async def _on_transaction_settled(self, run: TransactionalRun) -> None:
        """Committed or rolled back, just before the held response goes out: free a released key, report."""
        self._drop_lease()
        self.status = run.status
        if self.fence is None:
            return  # no key, no record
        if run.state in (State.COMMITTED, State.RECORDED):
            self._decide(Outcome.EXECUTED, run.status)
        else:
            self._decide(await self._release(), run.status)

    def _lend(self, transaction: Transaction) -> None:
        self._set_context(IdempotencyContext(self.tenant, self.key, transaction))

    # -- the answer, decided once -----------------------------------------------------------------------------

    async def _refuse(self, problem: problems.Problem, outcome: Outcome) -> None:
        self._decide(outcome, problem.status)
        await problem.send(self.send)

    def _decide(self, outcome: Outcome, status: int | None) -> None:
        """The answer is known: report it now, before it goes out (a server span ends with the last body message).
        Once: the first decision stands."""
        if self.phase is Phase.ANSWERED:
            return
        self.phase = Phase.ANSWERED
        self.outcome, self.status = outcome, status
        self._emit()

    def _report(self) -> None:
        """On the way out: a request whose settlement goes on after a cancellation reports once that ends."""
        if self.phase is Phase.ANSWERED:
            return
        settling = self.settling
        if settling is not None and not settling.done():
            settling.add_done_callback(self._report_settled)
        elif settling is not None and not settling.cancelled() and settling.exception() is None:
            self._decide(settling.result(), self.status)
        elif self.fence is not None:
            self._decide(Outcome.STORE_ERROR, self.status)

    def _report_settled(self, settling: asyncio.Future[Outcome]) -> None:
        if not settling.cancelled() and settling.exception() is None:
            self._decide(settling.result(), self.status)

    def _emit(self) -> None:
        """Report the outcome to the ``on_event`` hook."""
        hook = self.middleware.on_event
        outcome = self.outcome
        if hook is None or outcome is None:
            return
        if hook is log_event and not logger.isEnabledFor(log_level(outcome)):
            return  # the default hook would drop this event: do not build it
        event = Event(
            outcome,
            self.scope["method"],
            self.path,
            self.route,
            self.tenant,
            hash_key(self.key),
            self.status,
            time.perf_counter() - self.started,
            self.store_seconds,
            self.attempts,
            self.reached_store,
        )
        try:
            hook(event)
        except Exception:
            logger.exception("idempotency on_event hook failed")

    # -- helpers --------------------------------------------------------------------------------------------

    def _key_outlived_retention(self) -> bool:
        """A UUIDv7 key carries its birth time: one older than the ttl may have had a record that expired."""
        assert self.key is not None
        born = uuid7_time(self.key)
        return born is not None and time.time() - born > self.policy.ttl

    def _is_final(self, status: int | None) -> bool:
        """A final outcome is recorded (and, in a transaction, committed); anything else releases the key."""
        if status is None or self.scope.get("state", {}).get(NOT_EXECUTED_KEY):
            return False
        return self.policy.records(status)

    async def _awaited_tenant(self, tenant: object) -> str | None:
        """What a tenant resolver gave, awaited if it is awaitable and checked: a ``str`` or None. A sync resolver's
        ``str`` or None needs no coroutine and skips this; anything else it returns comes here to be refused."""
        if inspect.isawaitable(tenant):
            tenant = await tenant
        if tenant is not None and not isinstance(tenant, str):
            raise TypeError(f"the tenant resolver must return a str or None, not {type(tenant).__name__}")
        return tenant

    def _tenant_unknown(self) -> tuple[problems.Problem, Outcome]:
        """The refusal of a keyed request whose tenant is unknown, in the words of the resolver configured."""
        resolver = self.middleware.tenant
        needs = requirement(resolver)
        if not self.middleware.tenant_unknown_logged:
            self.middleware.tenant_unknown_logged = True
            if isinstance(resolver, AuthorizationTenant):
                advice = (
                    "If your clients authenticate otherwise (an API-key header, cookies, a gateway), pass tenant= a "
                    "resolver that returns their account; to let requests without credentials share one namespace, "
                    'pass tenant=AuthorizationTenant(anonymous="public").'
                )
            else:
                advice = "It returned None for a keyed request: it is the app's to say whose request this is."
            logger.warning(
                "idempotency: a request with an Idempotency-Key got 400 idempotency_tenant_unknown because the "
                "tenant resolver %r could not tell whose key it is (%s). %s Logged once per middleware.",
                resolver,
                f"it needs {needs}" if needs else "it gave no tenant",
                advice,
            )
        return problems.tenant_unknown(needs), Outcome.TENANT_UNKNOWN

    async def _read_body(self) -> bool:
        """Buffer the request body and fingerprint the request; False when the request ended here (413, or the
        client left)."""
        limit = self.policy.max_request_bytes
        declared = self._header(b"content-length")
        if declared.isdigit() and int(declared) > limit:
            await self._refuse(problems.request_too_large(limit), Outcome.REQUEST_TOO_LARGE)
            return False
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                return False  # nothing ran, nothing was claimed
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._refuse(problems.request_too_large(limit), Outcome.REQUEST_TOO_LARGE)
                return False
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        self.body = b"".join(chunks)
        scope = self.scope
        self.digest = fingerprint(
            scope["method"], scope["path"], scope.get("query_string", b""), self._header(b"content-type"), self.body
        )
        return True

    async def _receive_buffered(self) -> Message:
        """The handler's ``receive``: the buffered body once, then the real channel (for disconnects)."""
        if not self.body_delivered:
            self.body_delivered = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        return await self.receive()

    def _downstream(self) -> Send:
        """Where the app's response goes on to: the client; through a guard where the app tells its tenant, since
        the middleware may answer from inside the app."""
        return self.send if self.middleware.tenant_from_app is None else self._send_downstream

    async def _send_downstream(self, message: Message) -> None:
        """What the app sends, on to the client, unless the middleware has answered already (from inside the app:
        what follows, an exception handler's answer to :class:`ClaimAnswered`, is dropped)."""
        if self.phase is Phase.ANSWERED and self.fence is None:
            return
        await self.send(message)

    async def _send_tracked(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        await self.send(message)

    def _header(self, name: bytes) -> bytes:
        for key, value in self.scope["headers"]:
            if key == name:
                return bytes(value)
        return b""

    def _set_context(self, context: IdempotencyContext) -> None:
        self.scope.setdefault("state", {})[STATE_KEY] = context

    def _app_scope(self) -> Scope:
        """The scope the handler sees: without the extensions that send a body around ``send`` (a file path), which
        the recorder could not capture. Starlette's FileResponse then streams the file through ``send``."""
        extensions = self.scope.get("extensions")
        if extensions and not WITHHELD_EXTENSIONS.isdisjoint(extensions):
            self.scope["extensions"] = {k: v for k, v in extensions.items() if k not in WITHHELD_EXTENSIONS}
        return self.scope

    def _drop_lease(self) -> None:
        if self.lease is not None:
            self.middleware.leases.drop(self.lease)
            self.lease = None

    async def _timed(self, operation: Awaitable[T]) -> T:
        started = time.perf_counter()
        try:
            return await operation
        finally:
            self.store_seconds += time.perf_counter() - started

    def _notify_started(self) -> None:
        self.reached_store = True
        started = self.middleware.on_started
        if started is not None:
            try:
                started(self.scope)
            except Exception:
                logger.exception("idempotency on_event.started hook failed")


def _store_failure(error: BaseException) -> Outcome:
    """An exhausted pool is its own outcome: the fix is a larger ``max_size``, not the database team."""
    return Outcome.POOL_EXHAUSTED if isinstance(error, PoolExhausted) else Outcome.STORE_ERROR
