"""What the middleware does for a request: the global settings, per-route overrides, and the app's routes.

A :class:`Policy` is checked once, when it is built, so a bad setting fails at startup with a message rather than
on the first payment. Routes override fields of the app-wide policy either by path pattern
(``IdempotencyMiddleware(routes={"/v1/refunds": {"required": True}})``) or next to the endpoint with
:func:`idempotent`.

The app's routes as clients address them: every endpoint with its full path template, and which one a request
is for.

The templates label requests (``Event.route``) by route, never by raw path: a label per resource id, or per path a
scanner invents, would grow without bound. And a request that no route takes (the router answers 404 or 405, or
redirects it to a path with or without its trailing slash) runs nothing, so the middleware lets the router answer
it untouched: nothing is claimed or compared for it.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.endpoints import HTTPEndpoint
from starlette.routing import Mount, Route, WebSocketRoute, compile_path
from starlette.types import ASGIApp, Scope

DAY = 24 * 60 * 60
MiB = 1024 * 1024

# Outcomes below 500 that mean "nothing ran": the retry must be free to try again with the same key (Stripe's
# rule). 408/425/429 ask the client to retry, so they are transient by definition. 307 and 308 say "send this same
# request there" (the router's redirect_slashes answers them before any handler): the request they point to, with
# the same key, is the one that runs.
RELEASED_STATUSES = frozenset({307, 308, 401, 403, 404, 405, 408, 425, 429})

# The statuses a reused key may be answered with: the draft's 422 unless a route says otherwise. Any other would say
# something else to a client (a 404, a 412) or be retried by it (a 5xx, a 429).
REUSED_KEY_STATUSES = (422, 409, 400)


@dataclass(frozen=True, slots=True)
class Policy:
    """Settings for one route (or the whole app). Durations are in seconds."""

    required: bool = False  # a request without a key is refused (400) instead of passing through
    ttl: float = DAY  # how long a completed response is replayed
    lease: float = 30.0  # how long an in-progress claim holds without a heartbeat (renewed every third of it)
    transactional: bool = False  # the record commits in the handler's own transaction (PostgresStore only)
    fail_open: bool = False  # store unreachable: run the handler without protection instead of 503
    max_request_bytes: int = MiB
    max_response_bytes: int = 8 * MiB
    released_statuses: frozenset[int] = RELEASED_STATUSES
    methods: frozenset[str] = frozenset({"POST", "PATCH"})  # frozenset(): not covered, even with a key
    # The longest time your clients may keep retrying (or replaying) one operation. A ttl shorter than this
    # would let a late retry find no record and run the operation again, so it is refused at startup.
    retry_window: float | None = None
    # Refuse (422 idempotency_key_expired) a UUIDv7 key whose embedded time is older than the ttl and that has no
    # record: its record may have expired. Off by default: SDKs mint random keys in UUID shape, and one in 64 of
    # them reads as a UUIDv7 with a random, usually ancient, "birth time".
    check_uuid7_age: bool = False
    # Fields of a JSON or form body left out of the fingerprint ("sent_at", "meta.attempt_id": dotted names reach into
    # objects), for clients that stamp each attempt: a retry that changes only these is still the same request.
    fingerprint_exclude: frozenset[str] = frozenset()
    # Where the key comes from: None for the Idempotency-Key header; the name of another header; or a function of the
    # request body as the app reads it (the parsed JSON) that returns the key or None, for webhooks, whose providers
    # put the event's id in the body.
    key_from: str | Callable[[Any], Any] | None = None
    # Who owns the route's keys, when not the middleware's resolver (a provider's webhooks carry no credentials).
    tenant: Callable[[Scope], Any] | None = None
    # A duplicate that arrives while the original runs: "reject" answers it 409 with Retry-After; "wait" waits for the
    # original to settle, ``wait`` seconds at most, then replays its answer (or runs, if it was released), else 409.
    # For clients that ignore Retry-After (the official Stripe SDK does): they get their answer on the first retry.
    on_conflict: str = "reject"
    wait: float = 5.0
    # The keys the route takes, beyond the header's own rules: a regular expression a key must match whole (a UUID, a
    # minimum length), or a function of the key that says whether it is one. Any other key: 400 idempotency_key_invalid.
    key_format: str | Callable[[str], bool] | None = None
    # The status of a key used before with another request (idempotency_key_reused): 422, the IETF draft's; 409; or
    # 400, Stripe's. For apps whose own validation errors are 422: the code tells them apart, and so can the status.
    reused_key_status: int = 422
    # Observe only: claim, fingerprint and record as enforcing would, and report what enforcing would have answered
    # (``Event.observed``), while every request runs and is answered exactly as without the middleware. For a rollout:
    # observe app-wide, then enforce route by route (``{"observe": False}``).
    observe: bool = False
    # A 422 for a reused key names what changed (method, path, query, which body fields: the ``changed`` member), from
    # the request's parts stored with the claim as keyed digests. Refused where callers share a namespace (a route's
    # own tenant, a resolver's ``anonymous=``): there it would tell one caller about another's request.
    explain_mismatch: bool = False
    # Derived: the statuses whose responses are final, so stored and replayed (below 500, and not released); every
    # other answer releases the key.
    recorded: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("ttl", "lease", "wait", "retry_window"):
            value = getattr(self, name)
            if not ((value is None and name == "retry_window") or _seconds(value)):
                raise ValueError(f"idempotency {name} must be a positive number of seconds, got {value!r}")
        if self.retry_window is not None and self.retry_window > self.ttl:
            raise ValueError(
                f"idempotency ttl ({self.ttl}s) is shorter than the declared retry_window ({self.retry_window}s): "
                "a retry arriving after the record expired would run the operation again"
            )
        if self.fail_open and self.transactional:
            raise ValueError(
                "idempotency fail_open cannot be combined with transactional: the handler's transaction lives in "
                "the same PostgreSQL as the records, so when the store is down there is no transaction to run in "
                "(set fail_open=False on transactional routes)"
            )
        if self.lease >= self.ttl:
            raise ValueError(f"idempotency lease ({self.lease}s) must be shorter than ttl ({self.ttl}s)")
        for name in ("max_request_bytes", "max_response_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"idempotency {name} must be a whole number of bytes >= 0, got {value!r}")
        object.__setattr__(self, "released_statuses", frozenset(self.released_statuses))
        if any(not isinstance(s, int) or isinstance(s, bool) or not 100 <= s <= 599 for s in self.released_statuses):
            raise ValueError("idempotency released_statuses must be HTTP status codes (100-599)")
        if isinstance(self.methods, str | bytes):
            raise ValueError(
                f"idempotency methods must be a collection of method names, not the string {self.methods!r}"
            )
        methods = tuple(self.methods)  # read once: any iterable of names will do
        if any(not isinstance(m, str) or not m.isalpha() for m in methods):
            raise ValueError(f"idempotency methods must be HTTP method names, got {sorted(map(str, methods))}")
        object.__setattr__(self, "methods", frozenset(m.upper() for m in methods))  # empty: no route covered
        if isinstance(self.fingerprint_exclude, str | bytes) or any(
            not isinstance(name, str) or not name or "" in name.split(".") for name in self.fingerprint_exclude
        ):
            raise ValueError(
                "idempotency fingerprint_exclude must be a collection of field names (dotted for nested fields), got "
                f"{self.fingerprint_exclude!r}"
            )
        object.__setattr__(self, "fingerprint_exclude", frozenset(self.fingerprint_exclude))
        if isinstance(self.key_from, str):
            if not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", self.key_from):
                raise ValueError(f"idempotency key_from must be a header name or a function, got {self.key_from!r}")
        elif self.key_from is not None and not callable(self.key_from):
            raise ValueError(f"idempotency key_from must be a header name or a function, got {self.key_from!r}")
        if self.on_conflict not in ("reject", "wait"):
            raise ValueError(f'idempotency on_conflict is "reject" or "wait", got {self.on_conflict!r}')
        if self.tenant is not None and not callable(self.tenant):
            raise ValueError(
                f"idempotency tenant must be a resolver (a callable taking the scope), got {self.tenant!r}"
            )
        if isinstance(self.key_format, str):
            try:
                re.compile(self.key_format)
            except re.error as error:
                raise ValueError(
                    f"idempotency key_format is not a regular expression ({error}): {self.key_format!r}"
                ) from None
        elif self.key_format is not None and not callable(self.key_format):
            raise ValueError(
                f"idempotency key_format must be a regular expression or a function, got {self.key_format!r}"
            )
        reused = self.reused_key_status
        if not isinstance(reused, int) or isinstance(reused, bool) or reused not in REUSED_KEY_STATUSES:
            raise ValueError(
                f"idempotency reused_key_status is 422 (the IETF draft's), 409 or 400 (Stripe's), got {reused!r}"
            )
        object.__setattr__(self, "reused_key_status", int(reused))  # HTTPStatus.CONFLICT goes out as 409
        if not isinstance(self.observe, bool):
            raise ValueError(f"idempotency observe must be True or False, got {self.observe!r}")
        if not isinstance(self.explain_mismatch, bool):
            raise ValueError(f"idempotency explain_mismatch must be True or False, got {self.explain_mismatch!r}")
        if self.explain_mismatch and self.tenant is not None:
            raise ValueError(
                "idempotency explain_mismatch cannot be combined with a route's own tenant=: its callers (a provider's "
                "webhooks, under one tenant) share one namespace, so a caller who guessed another's key would learn "
                "which fields of that caller's request differ from its own (set explain_mismatch=False on that route)"
            )
        object.__setattr__(self, "recorded", frozenset(range(100, 500)) - self.released_statuses)

    def key_refusal(self, key: str) -> str | None:
        """Why the route does not take ``key`` (its ``key_format``), or None when it does."""
        check = self.key_format
        if check is None:
            return None
        if isinstance(check, str):
            return None if re.fullmatch(check, key) else f"this route's idempotency keys match the pattern '{check}'"
        return None if check(key) else "the idempotency key is not in the format this route takes"

    def records(self, status: int) -> bool:
        """Whether a response with ``status`` is final, so stored and replayed (else: released)."""
        return status in self.recorded

    def override(self, changes: Mapping[str, Any]) -> Policy:
        _check_names(changes)
        return dataclasses.replace(self, **changes)


def _check_names(changes: Mapping[str, Any]) -> None:
    unknown = set(changes) - {f.name for f in dataclasses.fields(Policy) if f.init}
    if unknown:
        raise TypeError(f"unknown idempotency setting(s): {', '.join(sorted(unknown))}")


ENDPOINT_ATTRIBUTE = "__idempotency_policy__"
F = TypeVar("F", bound=Callable[..., Any])


def idempotent(**changes: Any) -> Callable[[F], F]:
    """Declare a route's policy next to its endpoint: ``@idempotent(required=True, transactional=True)``.

    Works on Starlette endpoints and FastAPI path operations (put it below the ``@app.post`` line, or above
    it: the attribute is read from the endpoint object either way). Names are the fields of :class:`Policy`.
    """
    _check_names(changes)  # a typo fails at import; values are checked at startup, against the app's own defaults

    def mark(endpoint: F) -> F:
        setattr(endpoint, ENDPOINT_ATTRIBUTE, dict(changes))
        return endpoint

    return mark


class RouteTable:
    """What the middleware does for each request: the policy of the route it is for (decorated endpoints first,
    then path patterns, then the default), the route's template (events are labelled by it, never by raw path), and
    whether a route of the app takes it at all.

    Built from the settings; :meth:`scan` reads the app's routes once they are all declared (at startup, or the
    first request). :meth:`lookup` is cached by method and path, in a bounded cache: a scan of random paths cannot
    grow memory, and a request of a known route costs a dictionary look-up.
    """

    def __init__(self, default: Policy, routes: Mapping[str, Mapping[str, Any]]) -> None:
        self.default = default
        self.patterns = [(re.compile(fnmatch.translate(p)), default.override(c)) for p, c in routes.items()]
        self._pattern_settings = [(p, dict(c)) for p, c in routes.items()]  # as given: to name what one sets
        self.scanned = False
        self._declared: list[tuple[RouteEntry, re.Pattern[str], Policy]] = []
        self._routes: list[tuple[re.Pattern[str], str, frozenset[str] | None]] = []
        self._opaque: list[re.Pattern[str]] = []
        self._readable = False
        self.methods = self._methods()  # every method any policy covers: the cheap first test of a request
        self.observes = self._observes()  # whether any route only observes (``observe``)
        self.lookup = functools.lru_cache(maxsize=4096)(self._lookup)

    def _policies(self) -> Iterator[Policy]:
        yield self.default
        yield from (policy for _, policy in self.patterns)
        yield from (policy for _, _, policy in self._declared)

    def _methods(self) -> frozenset[str]:
        return frozenset(method for policy in self._policies() for method in policy.methods)

    def _observes(self) -> bool:
        return any(policy.observe for policy in self._policies())

    def scan(self, app: ASGIApp | None, check: Callable[[list[Policy]], None] | None = None) -> None:
        """Read the routes of a Starlette/FastAPI app: their ``@idempotent`` declarations and their templates.
        ``check`` may refuse the policies found (by raising); then nothing is kept, and the next scan fails again."""
        routes = getattr(app, "routes", None)
        entries = list(iter_routes(routes or ()))
        declared = [
            (entry, compile_path(entry.path)[0], self.default.override(getattr(entry.endpoint, ENDPOINT_ATTRIBUTE)))
            for entry in entries
            if hasattr(entry.endpoint, ENDPOINT_ATTRIBUTE)
        ]
        if check is not None:
            check([policy for _, _, policy in declared])
        self._declared = declared
        self._routes = [(compile_path(entry.path)[0], entry.path, entry.methods) for entry in entries]
        self._opaque = [re.compile(re.escape(prefix) + "(/.*)?") for prefix in iter_opaque(routes or ())]
        self._readable = routes is not None
        self.methods = self._methods()
        self.observes = self._observes()
        self.lookup.cache_clear()
        self.scanned = True

    def set_aside(self) -> list[str]:
        """What path patterns set that declared routes do not get, one line per route: a declaration starts from
        the app's settings, and no pattern applies to its route (the first pattern its path template matches is the
        one a request would have taken)."""
        lines = []
        for entry, _, _ in self._declared:
            declared = getattr(entry.endpoint, ENDPOINT_ATTRIBUTE)
            for (regex, _), (pattern, settings) in zip(self.patterns, self._pattern_settings, strict=True):
                if regex.fullmatch(entry.path):
                    if lost := {name: value for name, value in settings.items() if name not in declared}:
                        methods = "/".join(sorted(entry.methods or ())) or "any method"
                        named = ", ".join(f"{name}={value!r}" for name, value in lost.items())
                        lines.append(
                            f"{methods} {entry.path} declares its own settings (@idempotent), so the path pattern "
                            f"{pattern!r} of routes= does not apply to it: it does not get {named}. Repeat in its "
                            "declaration what it needs"
                        )
                    break
        return lines

    def for_endpoint(self, endpoint: Any, path: str) -> Policy:
        """The policy of a route known by its endpoint and path template (for documentation, not requests)."""
        changes = getattr(endpoint, ENDPOINT_ATTRIBUTE, None)
        if changes is not None:
            return self.default.override(changes)
        return self._by_pattern(path)

    def _lookup(self, method: str, path: str) -> RouteMatch:
        """A request's route, by its method and its path below the app's root path."""
        policy = self._by_pattern(path)
        for entry, regex, declared in self._declared:
            if entry.matches(method, path, regex):
                policy = declared
                break
        partial = None
        for regex, template, methods in self._routes:
            if regex.fullmatch(path):
                if methods is None or method in methods:
                    return RouteMatch(policy, template, True)
                partial = partial or template
        unknown = not self._readable or any(prefix.fullmatch(path) for prefix in self._opaque)
        return RouteMatch(policy, partial or UNMATCHED, None if unknown else False)

    def _by_pattern(self, path: str) -> Policy:
        for pattern, policy in self.patterns:
            if pattern.fullmatch(path):
                return policy
        return self.default


UNMATCHED = "<unmatched>"  # a request no route of the app matches (404s, probes, scans), or an app without routes


@dataclass(frozen=True, slots=True)
class RouteEntry:
    """One endpoint of the app as the client addresses it: full path template (mount and router prefixes
    included), methods, and the endpoint object that may carry an :func:`idempotent` declaration."""

    path: str
    methods: frozenset[str] | None  # None: any method (a plain ASGI endpoint)
    endpoint: Any

    def matches(self, method: str, path: str, regex: re.Pattern[str]) -> bool:
        return (self.methods is None or method in self.methods) and regex.fullmatch(path) is not None


def iter_routes(routes: Iterable[Any], prefix: str = "") -> Iterator[RouteEntry]:
    """Every HTTP endpoint below ``routes``, through Mounts and FastAPI's included routers (websocket routes take no
    HTTP request: the middleware lets every websocket through)."""
    for route, path in _route_paths(routes):
        if isinstance(route, Mount):
            yield from iter_routes(route.routes, prefix + route.path)
        elif isinstance(route, WebSocketRoute):
            continue
        elif (endpoint := getattr(route, "endpoint", None)) is not None and path is not None:
            methods = getattr(route, "methods", None) or _handled(endpoint)
            yield RouteEntry(prefix + path, frozenset(methods) if methods else None, endpoint)


HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")  # what an HTTPEndpoint dispatches on


def _handled(endpoint: Any) -> frozenset[str] | None:
    """The methods a class endpoint (Starlette's ``HTTPEndpoint``) answers, by the handlers it defines (HEAD by its
    GET); None for a plain ASGI endpoint, which may answer any."""
    if not (isinstance(endpoint, type) and issubclass(endpoint, HTTPEndpoint)):
        return None
    methods = {method for method in HTTP_METHODS if callable(getattr(endpoint, method.lower(), None))}
    return frozenset(methods | {"HEAD"} if "GET" in methods else methods)


def iter_opaque(routes: Iterable[Any], prefix: str = "") -> Iterator[str]:
    """The path templates under which the app routes requests by rules this module cannot read (a mounted app without
    a route table, a Host route, a route class of the app's own): ``prefix + "/{path:path}"``-style prefixes."""
    for route, path in _route_paths(routes):
        if isinstance(route, Mount):
            if route.routes:
                yield from iter_opaque(route.routes, prefix + route.path)
            else:
                yield prefix + route.path
        elif not isinstance(route, Route | WebSocketRoute) and (
            getattr(route, "endpoint", None) is None or path is None
        ):
            yield prefix


def _route_paths(routes: Iterable[Any]) -> Iterator[tuple[Any, str | None]]:
    routes = list(routes)
    try:  # FastAPI >= 0.160 keeps included routers as branches; this yields their routes with full paths
        from fastapi.routing import iter_route_contexts
    except ImportError:  # Starlette alone, or an older FastAPI whose included routes are flat
        yield from ((route, getattr(route, "path_format", None)) for route in routes)
        return
    for context in iter_route_contexts(routes):
        yield context.original_route, context.path_format


@dataclass(frozen=True, slots=True)
class RouteMatch:
    """Which route a request is for: the policy it asks for; its template (to label it); and whether a route takes
    it: False when the router answers it without running anything (404, 405, a trailing-slash redirect), None when
    that cannot be told (an app without a route table, or a path under a mounted app whose routes are not
    readable)."""

    policy: Policy
    template: str
    routed: bool | None


def _seconds(value: object) -> bool:
    """Whether ``value`` is a length of time: a finite number of seconds above 0 (not a bool; not nan or inf, which
    no timer or interval column takes)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
