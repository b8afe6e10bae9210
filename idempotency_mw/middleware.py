"""The Idempotency-Key middleware: the whole request flow, in the order it happens (docs/design.md §2).

``IdempotencyMiddleware`` holds the configuration and picks the requests it covers; ``IdempotentRequest`` owns one
covered request, from its key to its recorded (or released) response, and reads top to bottom in ``run``.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import inspect
import os
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any, TypeVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from idempotency_mw import problems
from idempotency_mw.body import BufferedBody, Read
from idempotency_mw.capture import ResponseRecorder, replay
from idempotency_mw.claims import OwnedClaim, store_failure
from idempotency_mw.context import (
    NOT_EXECUTED_KEY,
    PENDING_KEY,
    STATE_KEY,
    ClaimAnswered,
    IdempotencyContext,
)
from idempotency_mw.eager import outlasting, start_eagerly
from idempotency_mw.events import EventHook, Outcome, Report, log_event, logger
from idempotency_mw.failures import FailureLog
from idempotency_mw.fingerprint import KEYS_VARIABLE as FINGERPRINT_KEYS_VARIABLE
from idempotency_mw.fingerprint import FingerprintKeys, request_fingerprint
from idempotency_mw.keys import InvalidKey, KeyFunctionFailed, MissingKey, outlived, request_key
from idempotency_mw.leases import LeaseKeeper
from idempotency_mw.policy import DAY, RELEASED_STATUSES, MiB, Policy, PolicyResolver
from idempotency_mw.recording import PlainRun, run_unprotected
from idempotency_mw.routes import RouteMatch, RouteTemplates
from idempotency_mw.store import (
    Claim,
    ClaimOutcome,
    Store,
    StoredResponse,
    StoreUnavailable,
    TransactionalStore,
)
from idempotency_mw.tenants import (
    ROUTE_TENANTS,
    SECRET_VARIABLE,
    AuthorizationTenant,
    TenantFromApp,
    TenantResolver,
    requirement,
    resolve_tenant,
    unknown_tenant_advice,
)
from idempotency_mw.transaction import TransactionalRun
from idempotency_mw.waiting import claim_or_wait
from idempotency_mw.wire import handler_scope, header

T = TypeVar("T")

DISABLED_VARIABLE = "IDEMPOTENCY_MW_DISABLED"
OUTAGES = (StoreUnavailable, OSError)  # what fail_open fails open on: the store cannot be reached
# Sync or async: what it returns (or its coroutine returns) goes out in place of the stored response; None keeps it.
ReplayHook = Callable[[Scope, "StoredResponse"], "StoredResponse | Awaitable[StoredResponse | None] | None"]


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
    - ``on_replay``: called with the scope and the stored response before a replay goes out; it may return another
      response to send in its place (an extra header), or None to send it as stored (to count replays, say).
    - ``enabled``: False (or ``IDEMPOTENCY_MW_DISABLED=1`` in the environment), for tests or an emergency, says so in
      a warning as the middleware is built, and from then on answers nothing itself and claims and records nothing:
      every request runs as its handler would without the middleware, except that a transactional route still gets
      its transaction, and a handler's context (its tenant, key and ``downstream_key``) is still there.
    - ``fingerprint_keys``: the keys a request's fingerprint is stored under (a
      :class:`~idempotency_mw.fingerprint.FingerprintKeys`, or its text ``id:key,id:key``). By default those of
      ``IDEMPOTENCY_FINGERPRINT_KEYS``, else derived from the default tenant resolver's secret, else from the
      store's response keys; with none of those the middleware is not built (:func:`choose_fingerprint_keys`).
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
        fingerprint_exclude: Collection[str] = frozenset(),
        on_conflict: str = "reject",
        wait: float = 5.0,
        on_replay: ReplayHook | None = None,
        enabled: bool = True,
        fingerprint_keys: FingerprintKeys | str | None = None,
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
            fingerprint_exclude=fingerprint_exclude,  # type: ignore[arg-type]  # a collection; Policy freezes it
            on_conflict=on_conflict,
            wait=wait,
        )
        self.app = app
        self.store = store
        self.tenant = tenant
        self.fingerprint_keys = choose_fingerprint_keys(fingerprint_keys, tenant, store)
        self.tenant_from_app = tenant if isinstance(tenant, TenantFromApp) else None
        self.tenant_unknown_logged = False  # the operator hears of unscoped keyed requests once, not per request
        self.key_function_logged = False  # and of a key_from function that raises, once
        self.tenant_reserved_logged = False  # and of a resolver that returns a tenant of routes' namespace, once
        self.policies = PolicyResolver.build(default, routes or {})
        self.failures = FailureLog(logger)  # store failures: the first in full, then a summary now and then
        self.leases = LeaseKeeper(store, self.failures)  # renews the lease of every handler still running
        self.routes = RouteTemplates(app)  # until the routes are scanned (at startup, or the first request)
        self.on_event = on_event
        self.retry_after = retry_after
        self.on_replay = on_replay
        self._check_transactional(default, *(p for _, p in self.policies.patterns))
        self.enabled = enabled and os.environ.get(DISABLED_VARIABLE, "").strip().lower() not in ("1", "true", "yes")
        if not self.enabled:
            why = f"{DISABLED_VARIABLE} is set" if enabled else "enabled=False"
            logger.warning(
                "idempotency: the Idempotency-Key middleware is DISABLED (%s): it answers and records nothing, every "
                "request runs as without it, and a retried request will run again. Never leave it so in production.",
                why,
            )

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
        policy = self.policies.for_endpoint(endpoint, path)
        if policy.tenant is not None:
            return False  # its tenant is its own: the app need not tell it
        return bool(policy.methods) if methods is None else not policy.methods.isdisjoint(methods)

    def route_of(self, method: str, path: str, root_path: str) -> RouteMatch:
        """The route a request is for (its template, ``/v1/charges/{id}``, or ``<unmatched>``), and whether one takes
        it. Give the path and root path as the request arrived: the router rewrites ``scope["root_path"]`` on its
        way through a Mount."""
        if root_path and path.startswith(root_path):
            path = path[len(root_path) :]
        return self.routes.match(method, path)

    def tenant_unknown(self, resolver: object) -> tuple[problems.Problem, Outcome]:
        """The refusal of a keyed request whose tenant is unknown, in the words of the ``resolver`` that could not
        tell it; the operator hears how to fix it once, not per request."""
        if not self.tenant_unknown_logged:
            self.tenant_unknown_logged = True
            logger.warning(unknown_tenant_advice(resolver))
        return problems.tenant_unknown(requirement(resolver)), Outcome.TENANT_UNKNOWN

    def tenant_reserved(self, resolver: object, tenant: str) -> tuple[problems.Problem, Outcome]:
        """The refusal of a tenant the resolver returned in the namespace kept for routes' own tenants: it could meet
        a route's records (a webhook's). Logged once."""
        if not self.tenant_reserved_logged:
            self.tenant_reserved_logged = True
            logger.error(
                "idempotency: the tenant resolver %r returned a tenant starting with %r, the namespace of the tenants "
                "routes name themselves (tenant= on a route): such a request is refused with 400 "
                "idempotency_tenant_unknown. Logged once per middleware.",
                resolver,
                ROUTE_TENANTS,
            )
        return problems.tenant_unknown(requirement(resolver)), Outcome.TENANT_UNKNOWN

    def key_function_failed(self, error: KeyFunctionFailed) -> None:
        """A route's ``key_from`` raised: its caller gets 400; the operator hears of it once, with the traceback."""
        if not self.key_function_logged:
            self.key_function_logged = True
            logger.warning(
                "idempotency: a route's key_from function raised on a request body, which was answered 400 "
                "idempotency_key_invalid (make the function return None for bodies without a key). Logged once "
                "per middleware.",
                exc_info=error.__cause__,
            )

    async def replayed(self, scope: Scope, response: StoredResponse) -> StoredResponse:
        """The response a replay sends: as stored, or as the ``on_replay`` hook (sync or async) would have it. A hook
        that fails, or returns anything but a replayable :class:`StoredResponse` or None, is logged, and the response
        goes out as stored."""
        if self.on_replay is None:
            return response
        try:
            changed = self.on_replay(scope, response)
            if inspect.isawaitable(changed):
                changed = await changed
        except Exception:
            logger.exception("idempotency on_replay hook failed (the response is replayed as stored)")
            return response
        if changed is None:
            return response
        if not isinstance(changed, StoredResponse) or changed.body is None:
            logger.error(
                "idempotency on_replay hook returned %r, not a StoredResponse with a body, or None: the response is "
                "replayed as stored",
                type(changed).__name__ if not isinstance(changed, StoredResponse) else "a StoredResponse without body",
            )
            return response
        return changed

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


def choose_fingerprint_keys(given: FingerprintKeys | str | None, tenant: object, store: object) -> FingerprintKeys:
    """The keys request fingerprints are stored under: ``given``; else ``IDEMPOTENCY_FINGERPRINT_KEYS``; else keys
    derived from the default tenant resolver's secret (or ``IDEMPOTENCY_TENANT_SECRET``, where the app resolves its
    tenants otherwise); else from the store's response keys. Never none: an unkeyed digest of a request is inverted
    by a dictionary in seconds by anyone who can read the table, so without any secret the middleware is not built.
    """
    if isinstance(given, str):
        return FingerprintKeys.parse(given)
    if given is not None:
        if not isinstance(given, FingerprintKeys):
            raise TypeError(f"fingerprint_keys must be FingerprintKeys or its text, not {type(given).__name__}")
        return given
    found = FingerprintKeys.from_env()
    if found is not None:
        return found
    if isinstance(tenant, AuthorizationTenant):
        return FingerprintKeys.derived("tenant-secret", tenant.derive)
    if os.environ.get(SECRET_VARIABLE):
        return FingerprintKeys.derived("tenant-secret", AuthorizationTenant().derive)
    cipher = getattr(store, "cipher", None)
    if cipher is not None:
        return FingerprintKeys.derived("response-key", cipher.derive)
    raise ValueError(
        "the idempotency middleware stores each request's fingerprint keyed under a server secret, so that nobody "
        "who reads the table can tell what a request held by hashing guesses, and it has none: set "
        f"{FINGERPRINT_KEYS_VARIABLE} to id:key (a random key of at least 32 characters, the same on every "
        'instance: python -c "import secrets; print(secrets.token_hex(32))"), or pass '
        f"fingerprint_keys=FingerprintKeys(...), or set {SECRET_VARIABLE}, or give the store a cipher "
        "(PostgresStore(..., cipher=ResponseCipher.from_env()))"
    )


class Phase(enum.Enum):
    """Where a covered request is; it only moves forward. What it ends with is its :class:`Outcome`, decided once."""

    STARTED = "started"  # key, tenant and body being read; nothing asked of the store yet
    WAITING = "waiting"  # its tenant is the app's to tell: the app runs, and claims from inside (claim_for)
    CLAIMING = "claiming"  # the claim is on its way to the store
    RUNNING = "running"  # the key is ours: the handler runs, its lease renewed
    SETTLING = "settling"  # its answer is being recorded, or its key released
    ANSWERED = "answered"  # the outcome is decided, and reported


class IdempotentRequest:
    """One covered request, from its key to its recorded (or released) response."""

    def __init__(
        self, middleware: IdempotencyMiddleware, policy: Policy, route: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        self.middleware = middleware
        self.store = middleware.store
        self.policy = policy
        self.scope = scope
        self.receive = receive
        self.send = send
        self.phase = Phase.STARTED
        self.report = Report(middleware.on_event, scope["method"], scope["path"], route)
        self.key: str | None = None
        self.tenant = ""  # whose record: the tenant, or the route's own tenant in a namespace of its own
        self.owner = ""  # the tenant as resolved: what the handler's context and the events carry
        self.legacy_tenant: str | None = None  # a route's tenant as stored before routes had a namespace
        self.body = BufferedBody(receive, policy.max_request_bytes)
        self.digest = b""  # the request's fingerprint, unkeyed: never stored, nor sent to the store
        self.digests: tuple[bytes, ...] = ()  # as stored, under each fingerprint key, the current one first
        self.owned: OwnedClaim | None = None  # the claim, once it is this request's
        self.refusal: tuple[problems.Problem, Outcome] | None = None  # a bad key, answered once the tenant is known
        self.plain: PlainRun | None = None  # the handler's run in plain mode (recording.py)
        self.transaction: TransactionalRun | None = None  # or its connection and transaction (transaction.py)
        self.abandoning: asyncio.Future[Outcome] | None = None  # the claim of a request cancelled as it claimed
        self.disabled = False  # the middleware is switched off: nothing is claimed, the handler runs as without it

    async def run(self) -> None:
        """Steps 1 to 7 of docs/design.md §2, in the order they happen."""
        if not self.middleware.enabled:
            return await self._run_disabled()
        try:
            # 1. The key, validated before anything touches the store (unless it is in the body: a webhook's).
            if callable(self.policy.key_from) and not await self._read_body():
                return
            try:
                payload = lambda: self.body.payload(header(self.scope, b"content-type"))  # noqa: E731
                self.key = self.report.key = request_key(self.scope["headers"], self.policy.key_from, payload)
            except MissingKey:
                if self.policy.required:
                    self.refusal = (problems.key_missing(), Outcome.KEY_MISSING)
                elif self.policy.transactional:
                    self.body.delivered = not self.body.read  # unread: the handler reads the real channel
                    return await self._run_keyless_transaction()
                else:  # not ours: untouched
                    receive = self.body.receive if self.body.read else self.receive
                    return await self.middleware.app(self.scope, receive, self.send)
            except InvalidKey as error:
                if isinstance(error, KeyFunctionFailed):
                    self.middleware.key_function_failed(error)
                self.refusal = (problems.key_invalid(str(error)), Outcome.KEY_INVALID)

            if self._tenant_from_app():
                # 2. and 4. inside the app, once its own authentication has answered: it calls claim_for.
                if await self._read_body():
                    self._wait_for_the_app()
                    await self._execute()
                return

            # 2. The tenant: none means the key cannot be scoped, and an unscoped key must never meet another's.
            # A route's own tenant (a provider's webhooks) keeps its records apart from every tenant of the resolver.
            if self.refusal is None:
                resolver = self.policy.tenant or self.middleware.tenant
                tenant = await resolve_tenant(resolver, self.scope)  # type: ignore[arg-type]  # not a TenantFromApp
                if tenant is None:
                    self.refusal = self.middleware.tenant_unknown(resolver)
                elif self.policy.tenant is not None:
                    self.owner = self.report.tenant = tenant
                    self.tenant, self.legacy_tenant = ROUTE_TENANTS + tenant, tenant
                elif tenant.startswith(ROUTE_TENANTS):
                    self.refusal = self.middleware.tenant_reserved(resolver, tenant)
                else:
                    self.tenant = self.owner = self.report.tenant = tenant
            if self.refusal is not None:
                return await self._refuse(*self.refusal)

            # 3. The body, capped, and its fingerprint; 4. the claim, which decides what happens next.
            if await self._read_body() and await self._claim():
                # 5. and 6. The key is ours: run the handler, then record its answer or release the key.
                await self._execute()
        finally:
            self._report()
            # What refers back to this request goes, so that it is freed as it ends, not by the cycle collector.
            self.transaction = self.plain = None
            self.scope.get("state", {}).pop(PENDING_KEY, None)

    async def _run_disabled(self) -> None:
        """The off switch: nothing is claimed, recorded or answered here. The handler runs as it would without the
        middleware, with its context (the key and tenant read leniently: ``downstream_key`` gives what it gives when
        enabled), and a transactional route still gets its transaction, committed when its answer is final."""
        self.disabled = True
        try:
            if callable(self.policy.key_from):  # over the cap, or cut short: no key; the handler gets it as sent
                await self.body.read_all(header(self.scope, b"content-length"))
            payload = lambda: self.body.payload(header(self.scope, b"content-type"))  # noqa: E731
            with contextlib.suppress(MissingKey, InvalidKey):
                if self.body.read or not callable(self.policy.key_from):
                    self.key = request_key(self.scope["headers"], self.policy.key_from, payload)
            self.body.delivered = not self.body.buffered
            if self._tenant_from_app():  # the app tells the tenant (claim_for), then the handler runs
                self._wait_for_the_app()
                return await self._execute()
            resolver = self.policy.tenant or self.middleware.tenant
            tenant = await resolve_tenant(resolver, self.scope)  # type: ignore[arg-type]  # not a TenantFromApp
            self._scope_to(tenant)
            self.owner = self.tenant
            if self.policy.transactional:
                self._start_run()
                if await self._begin():
                    await self._execute()
                return
            self._set_context(IdempotencyContext(self.owner, self.key))
            await self.middleware.app(self.scope, self.body.receive, self.send)
        finally:
            self.transaction = self.plain = None
            self.scope.get("state", {}).pop(PENDING_KEY, None)

    def _scope_to(self, tenant: str | None) -> None:
        """Disabled: the tenant the context carries; without one the key scopes nothing, and the context has none."""
        self.tenant = tenant or ""
        if tenant is None:
            self.key = None

    async def claim_for(self, tenant: str | None) -> IdempotencyContext:
        """Steps 2 and 4 for a tenant the app tells from inside the request (``context.claim``): the refusals of
        step 1 wait for it, so that the app's own authentication answers first. Raises :class:`ClaimAnswered` when
        the answer went out without the handler (a refusal, a replay, a conflict)."""
        state = self.scope.setdefault("state", {})
        if state.pop(PENDING_KEY, None) is not self:
            raise RuntimeError("the claim of this request was taken already")
        if tenant is not None and not isinstance(tenant, str):
            raise TypeError(f"the tenant of a request must be a str or None, not {type(tenant).__name__}")
        if self.disabled:  # nothing to claim: the context, and a transactional route's transaction
            self._scope_to(tenant)
            self.owner = self.tenant
            if self.policy.transactional:
                if not await self._begin():
                    raise ClaimAnswered
            else:
                self._set_context(IdempotencyContext(self.owner, self.key))
            context = state.get(STATE_KEY)
            assert isinstance(context, IdempotencyContext)
            return context
        if self.refusal is None and tenant is None and self.key is not None:
            self.refusal = self.middleware.tenant_unknown(self.middleware.tenant)
        if self.refusal is not None:
            await self._refuse(*self.refusal)
            raise ClaimAnswered
        self.tenant = self.owner = self.report.tenant = tenant or ""
        claimed = await self._begin() if self.key is None else await self._claim()  # keyless: no record
        if not claimed:
            raise ClaimAnswered
        context = state.get(STATE_KEY)
        assert isinstance(context, IdempotencyContext)
        return context

    def _tenant_from_app(self) -> bool:
        """Whether the app tells this request's tenant from inside (the route names no tenant of its own)."""
        return self.middleware.tenant_from_app is not None and self.policy.tenant is None

    def _wait_for_the_app(self) -> None:
        self.phase = Phase.WAITING
        self.scope.setdefault("state", {})[PENDING_KEY] = self

    # -- 4. the claim -----------------------------------------------------------------------------------------

    async def _claim(self) -> bool:
        """Claim the key: True when it is ours (the handler may run), False when the request was answered (a
        replay, a conflict, a refusal; or, failing open, the handler ran unprotected)."""
        assert self.key is not None
        self.phase = Phase.CLAIMING
        self.report.reach_store(self.scope)
        policy = self.policy
        if policy.transactional:
            self._start_run()  # the claim is taken on the connection its transaction then uses
        claimer: Store | TransactionalRun = self.transaction or self.store
        started = time.perf_counter()
        if policy.on_conflict == "wait":
            claiming = claim_or_wait(lambda: self._claim_from(claimer), self.store.watch, policy.wait)
        else:
            claiming = self._claim_from(claimer)
        # A task of its own: a cancellation must not lose a claim that landed.
        task = start_eagerly(claiming, "idempotency claim")
        try:
            claim = await outlasting(task)
        except asyncio.CancelledError:
            # Cancelled (a server shutting down, an outer timeout) while the claim was on its way: it may have
            # landed. A claim that turns out to be ours is released, so the key is not left to its lease.
            self.abandoning = asyncio.ensure_future(self._abandon(task, self.transaction))
            raise
        except (TypeError, ValueError):
            raise  # a store set up wrong (an engine in AUTOCOMMIT, say) says so, rather than as an outage
        except Exception as error:
            self.report.store_seconds += time.perf_counter() - started
            self.middleware.failures.failed("claim a key", error)
            if policy.fail_open and isinstance(error, OUTAGES):  # never a record that is there but does not open
                await run_unprotected(self.middleware.app, self.scope, self.body.receive, self.send, self._decide)
                return False
            await self._refuse(problems.store_unavailable(self.middleware.retry_after), store_failure(error))
            return False
        del task  # finished: not kept alive through the handler's run
        self.report.store_seconds += time.perf_counter() - started
        self.report.attempts = claim.attempts
        self.middleware.failures.succeeded()
        if claim.outcome is not ClaimOutcome.OWNED:
            await self._answer(claim)
            return False
        self.owned = self._own(claim)
        if policy.check_uuid7_age and outlived(self.key, policy.ttl):
            # No record is left to compare with: running now could repeat an operation whose record was purged.
            await self.owned.release()
            if self.transaction is not None:
                await self.transaction.close()
            await self._refuse(problems.key_expired(int(policy.ttl)), Outcome.KEY_EXPIRED)
            return False
        self.phase = Phase.RUNNING
        if self.transaction is not None:
            return await self._begin()
        self._start_run()
        assert self.plain is not None
        self.plain.claimed()
        self._set_context(IdempotencyContext(self.owner, self.key))
        return True

    async def _claim_from(self, claimer: Store | TransactionalRun) -> Claim:
        """The claim, by ``claimer``. A record of a different request whose fingerprint is a bare SHA-256 was
        written before fingerprints were keyed: when it is this request's own digest, it is the same request after
        all (a retry in flight across the upgrade), and the claim is taken again with it."""
        assert self.key is not None
        policy, current, *previous = self.policy, *self.digests
        claim = await claimer.claim(
            self.tenant, self.key, current, lease=policy.lease, ttl=policy.ttl, matching=tuple(previous)
        )
        if claim.outcome is ClaimOutcome.MISMATCH and claim.unkeyed is not None and claim.unkeyed == self.digest:
            matching = (*previous, self.digest)
            claim = await claimer.claim(
                self.tenant, self.key, current, lease=policy.lease, ttl=policy.ttl, matching=matching
            )
        if claim.outcome is ClaimOutcome.OWNED and claim.attempts == 0 and self.legacy_tenant is not None:
            claim = await self._claim_legacy(claimer, claim)
        return claim

    async def _claim_legacy(self, claimer: Store | TransactionalRun, fresh: Claim) -> Claim:
        """A fresh claim of a route's own tenant: a record written before routes' tenants had a namespace of their
        own is under the bare tenant. If one is live (an event delivered before the upgrade, redelivered after), the
        fresh claim is released, and the request is claimed there instead, so it is still the same request."""
        assert self.key is not None
        assert self.legacy_tenant is not None
        found = await self.store.inspect(self.legacy_tenant, self.key)
        if found is None or found.expires_at <= time.time():
            return fresh
        await self.store.release(self.tenant, self.key, fresh.fence)
        if self.transaction is not None:
            await self.transaction.close()  # the fresh claim's connection: the legacy claim takes another
        self.tenant, self.legacy_tenant = self.legacy_tenant, None
        policy, current, *previous = self.policy, *self.digests
        return await claimer.claim(
            self.tenant, self.key, current, lease=policy.lease, ttl=policy.ttl, matching=tuple(previous)
        )

    async def _abandon(self, claiming: asyncio.Future[Claim], transaction: TransactionalRun | None) -> Outcome:
        """The claim of a request that was cancelled: released once it is known to be ours, and the connection a
        transactional claim ran on given back then (not whenever the run is garbage-collected)."""
        try:
            try:
                claim = await claiming
            except Exception:
                return Outcome.STORE_ERROR  # the claim failed: nothing of it is left
            if claim.outcome is not ClaimOutcome.OWNED:
                return Outcome.CANCELLED
            return await self._own(claim).release()
        finally:
            if transaction is not None:
                await transaction.close()

    def _own(self, claim: Claim) -> OwnedClaim:
        """The claim is ours: renew its lease (``leases.py``) until it settles."""
        assert self.key is not None
        middleware = self.middleware
        return OwnedClaim(
            self.store,
            self.tenant,
            self.key,
            claim.fence,
            lease=self.policy.lease,
            leases=middleware.leases,
            failures=middleware.failures,
            report=self.report,
        )

    async def _answer(self, claim: Claim) -> None:
        """A claim that is not ours: a different request (422), one still running (409), or one completed: replayed
        (7.), or a 409 when its response was not stored in full."""
        if claim.outcome is ClaimOutcome.MISMATCH:
            return await self._refuse(problems.key_reused(), Outcome.KEY_REUSED)
        if claim.outcome is ClaimOutcome.IN_PROGRESS:
            return await self._refuse(problems.in_progress(self.middleware.retry_after), Outcome.IN_PROGRESS)
        response = claim.response
        assert response is not None  # COMPLETED: the other outcome, OWNED, runs the handler
        if response.body is None:  # completed, but not stored in full (over the cap, or cut short)
            problem = problems.response_not_replayable(
                response.status, response.body_size, self.policy.max_response_bytes
            )
            return await self._refuse(problem, Outcome.NOT_REPLAYABLE)
        # 7. Replay.
        response = await self.middleware.replayed(self.scope, response)
        self._decide(Outcome.REPLAYED, response.status)
        await replay(response, self.send)

    # -- 5. and 6. running the handler, then recording or releasing -----------------------------------------

    def _start_run(self) -> None:
        """The handler's run: plain (``recording.py``), or its connection and transaction (``transaction.py``)."""
        if self.transaction is not None or self.plain is not None:
            return
        if self.policy.transactional:
            store = self.store
            assert isinstance(store, TransactionalStore)  # checked when the middleware was built
            self.transaction = TransactionalRun(
                store,
                self._downstream(),
                max_body=self.policy.max_response_bytes,
                is_final=self._is_final,
                decide=self._decide,
                refuse=self._refuse,
                retry_after=self.middleware.retry_after,
                failures=self.middleware.failures,
            )
        else:
            self.plain = PlainRun(
                self._downstream(),
                max_body=self.policy.max_response_bytes,
                settle=self._record_or_release,
                on_settled=self._decide,
            )

    async def _execute(self) -> None:
        """Run the handler with its response recorded on the way out (plain mode) or held in its transaction."""
        self._start_run()
        try:
            run = self.transaction or self.plain
            assert run is not None
            await run.run(self.middleware.app, handler_scope(self.scope), self.body.receive)
        except ClaimAnswered:
            pass  # the middleware answered from inside the app (claim_for): the handler did not run
        finally:
            if self.owned is not None:
                self.owned.drop_lease()

    async def _record_or_release(self, recorder: ResponseRecorder) -> Outcome:
        """Record a final answer, release the key for anything else (``recording.py`` calls it, once)."""
        self.phase = Phase.SETTLING
        owned = self.owned
        assert owned is not None
        if not self._is_final(recorder.status):
            return await owned.release()
        return await owned.complete(recorder.stored_response())

    async def _run_keyless_transaction(self) -> None:
        """A transactional route called without a key still gets its transaction, with no record in it (begun once
        the app has told its tenant, when that is the app's to tell)."""
        self._start_run()
        if self._tenant_from_app():
            self._wait_for_the_app()
        elif not await self._begin():
            return
        await self._execute()

    async def _begin(self) -> bool:
        """Begin the handler's transaction and lend it (``request.state.idempotency.transaction``); False when the
        request was answered instead (503)."""
        run = self.transaction
        assert run is not None
        run.owned = self.owned
        return await run.begin(lambda lent: self._set_context(IdempotencyContext(self.owner, self.key, lent)))

    # -- the answer, decided once -----------------------------------------------------------------------------

    async def _refuse(self, problem: problems.Problem, outcome: Outcome) -> None:
        self._decide(outcome, problem.status)
        await problem.send(self.send)

    def _decide(self, outcome: Outcome, status: int | None) -> None:
        """The answer is known: report it now, before it goes out (a server span ends with the last body message).
        Once: the first decision stands."""
        self.phase = Phase.ANSWERED
        self.report.decide(outcome, status)

    def _report(self) -> None:
        """On the way out: a request whose settlement (or abandoned claim) goes on after a cancellation reports once
        that ends."""
        if self.phase is Phase.ANSWERED:
            return
        settling = self.abandoning or (self.plain.settling if self.plain is not None else None)
        status = self.plain.recorder.status if self.plain is not None else None
        if settling is not None:
            self.report.decide_after(settling, status)
        elif self.owned is not None:
            self._decide(Outcome.STORE_ERROR, status)

    # -- helpers --------------------------------------------------------------------------------------------

    def _is_final(self, status: int | None) -> bool:
        """A final outcome is recorded (and, in a transaction, committed); anything else releases the key."""
        if status is None or self.scope.get("state", {}).get(NOT_EXECUTED_KEY):
            return False
        return self.policy.records(status)

    async def _read_body(self) -> bool:
        """Buffer the request body and fingerprint the request; False when the request ended here (413, or the
        client left: nothing ran, nothing was claimed)."""
        if self.body.read:
            return True
        read = await self.body.read_all(header(self.scope, b"content-length"))
        if read is Read.TOO_LARGE:
            await self._refuse(problems.request_too_large(self.policy.max_request_bytes), Outcome.REQUEST_TOO_LARGE)
        if read is not Read.WHOLE:
            return False
        self.digest = request_fingerprint(self.scope, self.body.body, self.policy.fingerprint_exclude)
        self.digests = self.middleware.fingerprint_keys.digests(self.digest)
        return True

    def _downstream(self) -> Send:
        """Where the app's response goes on to: the client; through a guard where the app tells its tenant, since
        the middleware may answer from inside the app."""
        return self.send if self.middleware.tenant_from_app is None else self._send_downstream

    async def _send_downstream(self, message: Message) -> None:
        """What the app sends, on to the client, unless the middleware has answered already from inside the app: what
        follows (an exception handler's answer to :class:`ClaimAnswered`) is dropped."""
        if self.phase is Phase.ANSWERED and self.owned is None:
            return
        await self.send(message)

    def _set_context(self, context: IdempotencyContext) -> None:
        self.scope.setdefault("state", {})[STATE_KEY] = context
