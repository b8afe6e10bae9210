"""The Idempotency-Key middleware: its configuration, and which requests it covers.

:class:`IdempotencyMiddleware` checks its settings and the app's routes at startup, and hands each covered request
to an :class:`~idempotency_mw._request.IdempotentRequest`, which owns it from its key to its recorded (or released)
response (``_request.py``, docs/design.md §2).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from idempotency_mw import _environment as environment
from idempotency_mw._channels import ReplayHook
from idempotency_mw._claim import LeaseKeeper
from idempotency_mw._events import EventHook, FailureLog, Notices, log_event, logger
from idempotency_mw._fingerprint import FingerprintKeys, choose_fingerprint_keys
from idempotency_mw._keys import AuthorizationTenant, TenantFromApp, TenantResolver, shared_namespace
from idempotency_mw._observing import ObservingRequest
from idempotency_mw._policy import DAY, RELEASED_STATUSES, MiB, Policy, RouteMatch, RouteTable
from idempotency_mw._problems import Envelope, ProblemRenderer
from idempotency_mw._request import IdempotentRequest, SwitchedOffRequest, TenantFromAppRequest
from idempotency_mw.cutover import EarlierLookup
from idempotency_mw.store import Store, TransactionalStore

DISABLED_VARIABLE = "IDEMPOTENCY_MW_DISABLED"


class IdempotencyMiddleware:
    """Make covered requests (POST and PATCH by default) that carry an ``Idempotency-Key`` run at most once.

    ``app.add_middleware(IdempotencyMiddleware, store=PostgresStore(dsn))``. Every keyword below is also a
    field of :class:`~idempotency_mw.Policy`, except:

    - ``tenant``: maps the ASGI scope to the tenant that owns the key (sync or async), or to None when it cannot
      tell (the keyed request is then refused with 400); by default :class:`~idempotency_mw.AuthorizationTenant`, an
      HMAC of the ``Authorization`` header keyed by ``IDEMPOTENCY_TENANT_SECRET``. Or a tenant the app tells from
      inside the request (``idempotency_mw.fastapi.TenantDependency``).
    - ``routes``: per-path overrides, ``{"/v1/refunds*": {"required": True}}`` (``*`` matches anything).
    - ``on_event``: called with an :class:`~idempotency_mw.Event` when a keyed request ends; if it also has a
      ``started(scope)`` method, that is called when the request reaches the store (metrics use it for an in-flight
      gauge).
    - ``retry_after``: the ``Retry-After`` seconds sent with 409 and 503.
    - ``problem_renderer``: the app's own envelope for the middleware's answers (its 400s, 409s, 413, 422, 503):
      called (sync or async) with the :class:`~idempotency_mw.Problem` and the scope, it returns a Starlette
      ``Response`` with ``problem.status``. Whatever the body, the answer carries its code in the
      ``Idempotency-Problem`` header, and its ``Retry-After``; a renderer that fails gets the default
      ``application/problem+json`` sent in its place, logged once.
    - ``on_replay``: called (sync or async) with the scope and the stored response before a replay goes out; it may
      return another response to send in its place (an extra header), or None to send it as stored.
    - ``earlier``: for a switch from another idempotency package, what that package recorded for a request
      (``idempotency_mw.cutover``): asked on each fresh claim, for as long as its records live.
    - ``enabled``: False (or ``IDEMPOTENCY_MW_DISABLED=1`` in the environment), for tests or an emergency, says so in
      a warning as the middleware is built, and from then on answers nothing itself and claims and records nothing:
      every request runs as its handler would without the middleware, except that a transactional route still gets
      its transaction, and a handler's context (its tenant, key and ``downstream_key``) is still there.
    - ``observe``: True (app-wide, or per route: ``routes={"/v1/charges": {"observe": False}}``) claims, fingerprints
      and records as enforcing would, and reports what enforcing would have done (``Event.observed``), while every
      request runs and is answered as without the middleware: for a rollout, observe, then enforce route by route.
    - ``ttl`` and ``lease``, when not given, come from ``IDEMPOTENCY_TTL`` and ``IDEMPOTENCY_LEASE`` (seconds), else
      24 hours and 30 seconds.
    - ``fingerprint_keys``: the keys a request's fingerprint is stored under (``FingerprintKeys``, or its text
      ``id:key,id:key``); by default from ``IDEMPOTENCY_FINGERPRINT_KEYS``, else derived from the tenant secret, else
      from the store's response keys; with none the middleware is not built.
    """

    def __init__(
        self,
        app: ASGIApp,
        store: Store,
        *,
        tenant: TenantResolver | TenantFromApp | None = None,
        methods: tuple[str, ...] | frozenset[str] = ("POST", "PATCH"),
        required: bool = False,
        ttl: float | None = None,
        lease: float | None = None,
        transactional: bool = False,
        fail_open: bool = False,
        max_request_bytes: int = MiB,
        max_response_bytes: int = 8 * MiB,
        released_statuses: frozenset[int] = RELEASED_STATUSES,
        retry_window: float | None = None,
        check_uuid7_age: bool = False,
        key_format: str | Callable[[str], bool] | None = None,
        routes: Mapping[str, Mapping[str, Any]] | None = None,
        on_event: EventHook | None = log_event,
        retry_after: int = 1,
        fingerprint_exclude: Collection[str] = frozenset(),
        on_conflict: str = "reject",
        wait: float = 5.0,
        on_replay: ReplayHook | None = None,
        earlier: EarlierLookup | None = None,
        enabled: bool = True,
        fingerprint_keys: FingerprintKeys | str | None = None,
        reused_key_status: int = 422,
        problem_renderer: ProblemRenderer | None = None,
        observe: bool = False,
        explain_mismatch: bool = False,
    ) -> None:
        if tenant is None:
            tenant = AuthorizationTenant()  # fails here, with what to set, when no secret is configured
        if not (isinstance(tenant, TenantFromApp) or callable(tenant)):
            raise TypeError("tenant must be a callable taking the ASGI scope, or a TenantFromApp")
        if not isinstance(retry_after, int) or retry_after < 0:
            raise ValueError("retry_after must be a whole number of seconds >= 0")
        default = Policy(
            required=required,
            ttl=environment.seconds(environment.TTL, ttl, DAY),
            lease=environment.seconds(environment.LEASE, lease, 30.0),
            transactional=transactional,
            fail_open=fail_open,
            max_request_bytes=max_request_bytes,
            max_response_bytes=max_response_bytes,
            released_statuses=frozenset(released_statuses),
            methods=methods,  # type: ignore[arg-type]  # a collection; Policy checks and freezes it
            retry_window=retry_window,
            check_uuid7_age=check_uuid7_age,
            key_format=key_format,
            fingerprint_exclude=fingerprint_exclude,  # type: ignore[arg-type]  # a collection; Policy freezes it
            on_conflict=on_conflict,
            wait=wait,
            reused_key_status=reused_key_status,
            observe=observe,
            explain_mismatch=explain_mismatch,
        )
        self.app = app
        self.store = store
        self.tenant = tenant
        self.tenant_from_app = tenant if isinstance(tenant, TenantFromApp) else None
        self.fingerprint_keys = choose_fingerprint_keys(fingerprint_keys, tenant, store)
        self.routes = RouteTable(default, routes or {})
        self.failures = FailureLog(logger)  # store failures: the first in full, then a summary now and then
        self.notices = Notices()  # misconfigurations the operator hears of once
        self.envelope = Envelope(problem_renderer, self.notices)  # what the middleware's own answers go out in
        self.leases = LeaseKeeper(store, self.failures)  # renews the lease of every handler still running
        self.on_event = on_event
        self.on_started = getattr(on_event, "started", None)
        self.retry_after = retry_after
        self.on_replay = on_replay
        self.earlier = earlier
        self._check_policies([default, *(p for _, p in self.routes.patterns)])
        self.enabled = enabled and os.environ.get(DISABLED_VARIABLE, "").strip().lower() not in ("1", "true", "yes")
        if not self.enabled:
            why = f"{DISABLED_VARIABLE} is set" if enabled else "enabled=False"
            logger.warning(
                "idempotency: the Idempotency-Key middleware is DISABLED (%s): it answers and records nothing, every "
                "request runs as without it, and a retried request will run again. Never leave it so in production.",
                why,
            )
        self.off_or_observing = not self.enabled or self.routes.observes  # some requests take another path

    def _check_policies(self, policies: list[Policy]) -> None:
        """Refuse what these policies ask that the store or the tenant resolver cannot give."""
        if any(p.transactional for p in policies) and not isinstance(self.store, TransactionalStore):
            raise TypeError(
                f"transactional mode needs a store with database transactions (PostgresStore, or SQLAlchemyStore "
                f"from idempotency_mw.sqlalchemy), not {type(self.store).__name__}"
            )
        if any(p.on_conflict == "wait" for p in policies) and not callable(getattr(self.store, "watch", None)):
            raise TypeError(
                f'on_conflict="wait" needs a store that tells when a claim settles (Store.watch), which '
                f"{type(self.store).__name__} does not have"
            )
        shared = shared_namespace(self.tenant)
        if shared is not None and any(p.explain_mismatch and p.tenant is None for p in policies):
            raise ValueError(
                f"idempotency explain_mismatch cannot be combined with the tenant resolver {self.tenant!r}: it puts "
                f"every request it cannot tell apart in one namespace ({shared!r}, its anonymous=), where a caller who "
                "guessed another's key would learn which fields of that caller's request differ from its own. Turn "
                "explain_mismatch off, or give anonymous callers no namespace (anonymous=None: they get 400)"
            )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                return await self._lifespan(scope, receive, send)
            return await self.app(scope, receive, send)
        if not self.routes.scanned:  # no lifespan (a test transport): requests scan until a scan succeeds
            self._scan(scope)
        method = scope["method"]
        if method not in self.routes.methods:
            return await self.app(scope, receive, send)
        route = self.route_of(method, scope["path"], scope.get("root_path", ""))
        if method not in route.policy.methods or route.routed is False:
            # Not covered, or the router answers it itself (404, 405, a redirect): nothing runs, nothing to claim.
            return await self.app(scope, receive, send)
        if self.off_or_observing:  # one test for both, so that enforcing costs no more for either
            request = self._off_or_observing(route, scope, receive, send)
        elif self.tenant_from_app is not None and route.policy.tenant is None:
            request = TenantFromAppRequest(self, route, scope, receive, send)  # the app tells it from inside
        else:
            request = IdempotentRequest(self, route, scope, receive, send)
        await request.run()

    def _off_or_observing(self, route: RouteMatch, scope: Scope, receive: Receive, send: Send) -> IdempotentRequest:
        """The request of a middleware switched off (every route runs as without it), or of one where some route
        only observes (that route's requests report what enforcing would have done, and run as without it)."""
        if not self.enabled:
            return SwitchedOffRequest(self, route, scope, receive, send)
        if route.policy.observe:
            return ObservingRequest(self, route, scope, receive, send)
        if self.tenant_from_app is not None and route.policy.tenant is None:
            return TenantFromAppRequest(self, route, scope, receive, send)
        return IdempotentRequest(self, route, scope, receive, send)

    def route_of(self, method: str, path: str, root_path: str) -> RouteMatch:
        """The route a request is for: its policy, its template (``/v1/charges/{id}``, or ``<unmatched>``), and
        whether one takes it. Give the path and root path as the request arrived: the router rewrites
        ``scope["root_path"]`` on its way through a Mount. The root path is stripped as Starlette strips it: only as
        a whole segment (under ``/api``, ``/apikeys`` is the route ``/apikeys``)."""
        if root_path and path.startswith(root_path) and path[len(root_path) : len(root_path) + 1] in ("/", ""):
            path = path[len(root_path) :]
        return self.routes.lookup(method, path)

    def _scan(self, scope: Scope) -> None:
        """Read the app's routes, which are all declared by now: their ``@idempotent`` declarations, their templates
        (to label events by route), and, with a tenant the app tells, whether every covered route tells it."""
        app = scope.get("app", self.app)
        if self.tenant_from_app is not None:
            self.tenant_from_app.check(app, self._covers)
        self.routes.scan(app, check=self._check_policies)
        for line in self.routes.set_aside():
            self.notices.once(line, f"idempotency: {line}")
        self.off_or_observing = not self.enabled or self.routes.observes  # an endpoint may observe (@idempotent)

    def _covers(self, endpoint: Any, path: str, methods: frozenset[str] | None) -> bool:
        """Whether a route (its endpoint, path template and methods) takes requests this middleware covers."""
        policy = self.routes.for_endpoint(endpoint, path)
        if policy.tenant is not None:
            return False  # its tenant is its own: the app need not tell it
        return bool(policy.methods) if methods is None else not policy.methods.isdisjoint(methods)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Check the per-route policies at startup, so a bad one stops the server instead of the first payment."""
        first = await receive()
        if first["type"] == "lifespan.startup" and not self.routes.scanned:
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
