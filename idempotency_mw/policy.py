"""What the middleware does for a request: the global settings, and per-route overrides.

A :class:`Policy` is checked once, when it is built, so a bad setting fails at startup with a message rather than
on the first payment. Routes override fields of the app-wide policy either by path pattern
(``IdempotencyMiddleware(routes={"/v1/refunds": {"required": True}})``) or next to the endpoint with
:func:`idempotent`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.routing import compile_path
from starlette.types import ASGIApp, Scope

from idempotency_mw.routes import RouteEntry, iter_routes

DAY = 24 * 60 * 60
MiB = 1024 * 1024

# Outcomes below 500 that mean "nothing ran": the retry must be free to try again with the same key (Stripe's
# rule). 408/425/429 ask the client to retry, so they are transient by definition. 307 and 308 say "send this same
# request there" (the router's redirect_slashes answers them before any handler): the request they point to, with
# the same key, is the one that runs.
RELEASED_STATUSES = frozenset({307, 308, 401, 403, 404, 405, 408, 425, 429})


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

    def __post_init__(self) -> None:
        for name in ("ttl", "lease"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value <= 0:
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
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"idempotency {name} must be a whole number of bytes >= 0, got {value!r}")
        object.__setattr__(self, "released_statuses", frozenset(self.released_statuses))
        if any(not 100 <= s <= 599 for s in self.released_statuses):
            raise ValueError("idempotency released_statuses must be HTTP status codes (100-599)")
        if isinstance(self.methods, str | bytes):
            raise ValueError(
                f"idempotency methods must be a collection of method names, not the string {self.methods!r}"
            )
        methods = frozenset(m.upper() for m in self.methods)
        if any(not isinstance(m, str) or not m.isalpha() for m in methods):
            raise ValueError(f"idempotency methods must be HTTP method names, got {sorted(map(str, self.methods))}")
        object.__setattr__(self, "methods", methods)  # empty: the route is not covered at all
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
        if not isinstance(self.wait, int | float) or self.wait <= 0:
            raise ValueError(f"idempotency wait must be a positive number of seconds, got {self.wait!r}")
        if self.tenant is not None and not callable(self.tenant):
            raise ValueError(
                f"idempotency tenant must be a resolver (a callable taking the scope), got {self.tenant!r}"
            )

    def records(self, status: int) -> bool:
        """Whether a response with ``status`` is final, so stored and replayed (else: released)."""
        return status < 500 and status not in self.released_statuses

    def override(self, changes: Mapping[str, Any]) -> Policy:
        _check_names(changes)
        return dataclasses.replace(self, **changes)


def _check_names(changes: Mapping[str, Any]) -> None:
    unknown = set(changes) - {f.name for f in dataclasses.fields(Policy)}
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


@dataclass(slots=True)
class PolicyResolver:
    """Find the policy for a request: decorated endpoints first, then path patterns, then the default."""

    default: Policy
    patterns: list[tuple[re.Pattern[str], Policy]] = field(default_factory=list)
    _routes: list[tuple[RouteEntry, re.Pattern[str], Policy]] | None = None
    methods: frozenset[str] = frozenset()  # every method any policy covers: the cheap first test of a request

    def __post_init__(self) -> None:
        self._collect_methods()

    @classmethod
    def build(cls, default: Policy, routes: Mapping[str, Mapping[str, Any]]) -> PolicyResolver:
        patterns = [(re.compile(fnmatch.translate(p)), default.override(c)) for p, c in routes.items()]
        return cls(default, patterns)

    def _collect_methods(self) -> None:
        found = set(self.default.methods)
        for _, policy in self.patterns:
            found |= policy.methods
        for _, _, policy in self._routes or ():
            found |= policy.methods
        self.methods = frozenset(found)

    def scan(self, app: ASGIApp | None, check: Callable[[list[Policy]], None] | None = None) -> None:
        """Collect the decorated endpoints of a Starlette/FastAPI app: at startup, or else at its first request.

        ``check`` may refuse the policies found (by raising); then nothing is kept, and the next scan fails again.
        """
        routes = [
            (entry, compile_path(entry.path)[0], self.default.override(getattr(entry.endpoint, ENDPOINT_ATTRIBUTE)))
            for entry in iter_routes(getattr(app, "routes", ()))
            if hasattr(entry.endpoint, ENDPOINT_ATTRIBUTE)
        ]
        if check is not None:
            check([policy for _, _, policy in routes])
        self._routes = routes
        self._collect_methods()

    def for_endpoint(self, endpoint: Any, path: str) -> Policy:
        """The policy of a route known by its endpoint and path template (for documentation, not requests)."""
        changes = getattr(endpoint, ENDPOINT_ATTRIBUTE, None)
        if changes is not None:
            return self.default.override(changes)
        return self._by_pattern(path)

    @property
    def scanned(self) -> bool:
        return self._routes is not None

    def resolve(self, scope: Scope) -> Policy:
        path = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        for entry, regex, policy in self._routes or ():
            if entry.matches(scope["method"], path, regex):
                return policy
        return self._by_pattern(path)

    def _by_pattern(self, path: str) -> Policy:
        for pattern, policy in self.patterns:
            if pattern.fullmatch(path):
                return policy
        return self.default
