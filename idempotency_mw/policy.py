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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.routing import Match, Mount, Route
from starlette.types import ASGIApp, Scope

DAY = 24 * 60 * 60
MiB = 1024 * 1024

# Outcomes below 500 that mean "nothing ran": the retry must be free to try again with the same key (Stripe's
# rule). 408/425/429 ask the client to retry, so they are transient by definition.
RELEASED_STATUSES = frozenset({401, 403, 404, 405, 408, 425, 429})


@dataclass(frozen=True, slots=True)
class Policy:
    """Settings for one route (or the whole app). Durations are in seconds."""

    required: bool = False  # a request without a key is refused (400) instead of passing through
    ttl: float = DAY  # how long a completed response is replayed
    lease: float = 60.0  # how long an in-progress claim holds without a heartbeat
    transactional: bool = False  # the record commits in the handler's own transaction (PostgresStore only)
    fail_open: bool = False  # store unreachable: run the handler without protection instead of 503
    max_request_bytes: int = MiB
    max_response_bytes: int = 8 * MiB
    released_statuses: frozenset[int] = RELEASED_STATUSES
    methods: frozenset[str] = frozenset({"POST", "PATCH"})

    def __post_init__(self) -> None:
        for name in ("ttl", "lease"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"idempotency {name} must be a positive number of seconds, got {value!r}")
        if self.lease >= self.ttl:
            raise ValueError(f"idempotency lease ({self.lease}s) must be shorter than ttl ({self.ttl}s)")
        for name in ("max_request_bytes", "max_response_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"idempotency {name} must be a whole number of bytes >= 0, got {value!r}")
        object.__setattr__(self, "released_statuses", frozenset(self.released_statuses))
        if any(not 100 <= s <= 599 for s in self.released_statuses):
            raise ValueError("idempotency released_statuses must be HTTP status codes (100-599)")
        methods = frozenset(m.upper() for m in self.methods)
        if not methods or any(not m.isalpha() for m in methods):
            raise ValueError(f"idempotency methods must be HTTP method names, got {sorted(self.methods)}")
        object.__setattr__(self, "methods", methods)

    def records(self, status: int) -> bool:
        """Whether a response with ``status`` is final, so stored and replayed (else: released)."""
        return status < 500 and status not in self.released_statuses

    def override(self, changes: Mapping[str, Any]) -> Policy:
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"unknown idempotency setting(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)


ENDPOINT_ATTRIBUTE = "__idempotency_policy__"
F = TypeVar("F", bound=Callable[..., Any])


def idempotent(**changes: Any) -> Callable[[F], F]:
    """Declare a route's policy next to its endpoint: ``@idempotent(required=True, transactional=True)``.

    Works on Starlette endpoints and FastAPI path operations (put it below the ``@app.post`` line, or above
    it: the attribute is read from the endpoint object either way). Names are the fields of :class:`Policy`.
    """
    Policy().override(changes)  # validate now: a typo fails at import, not at the first request

    def mark(endpoint: F) -> F:
        setattr(endpoint, ENDPOINT_ATTRIBUTE, dict(changes))
        return endpoint

    return mark


@dataclass(slots=True)
class PolicyResolver:
    """Find the policy for a request: decorated endpoints first, then path patterns, then the default."""

    default: Policy
    patterns: list[tuple[re.Pattern[str], Policy]] = field(default_factory=list)
    _routes: list[tuple[Route, Policy]] | None = None

    @classmethod
    def build(cls, default: Policy, routes: Mapping[str, Mapping[str, Any]]) -> PolicyResolver:
        patterns = [(re.compile(fnmatch.translate(p)), default.override(c)) for p, c in routes.items()]
        return cls(default, patterns)

    @property
    def methods(self) -> frozenset[str]:
        """Every method any policy covers: the cheap first test of each request."""
        found = set(self.default.methods)
        for _, policy in self.patterns:
            found |= policy.methods
        for _, policy in self._routes or ():
            found |= policy.methods
        return frozenset(found)

    def scan(self, app: ASGIApp | None) -> None:
        """Collect the decorated endpoints of a Starlette/FastAPI app, once, at its first request."""
        self._routes = [
            (route, self.default.override(getattr(route.endpoint, ENDPOINT_ATTRIBUTE)))
            for route in _walk_routes(getattr(app, "routes", ()))
            if hasattr(route.endpoint, ENDPOINT_ATTRIBUTE)
        ]

    def for_endpoint(self, endpoint: Any, path: str) -> Policy:
        """The policy of a route known by its endpoint and path template (for documentation, not requests)."""
        changes = getattr(endpoint, ENDPOINT_ATTRIBUTE, None)
        if changes is not None:
            return self.default.override(changes)
        for pattern, policy in self.patterns:
            if pattern.fullmatch(path):
                return policy
        return self.default

    def route_policies(self) -> list[Policy]:
        return [policy for _, policy in self._routes or ()]

    @property
    def scanned(self) -> bool:
        return self._routes is not None

    def resolve(self, scope: Scope) -> Policy:
        if self._routes:
            policy = _match_route(self._routes, scope)
            if policy is not None:
                return policy
        path = scope["path"]
        for pattern, policy in self.patterns:
            if pattern.fullmatch(path):
                return policy
        return self.default


def _walk_routes(routes: Iterable[Any], prefix: tuple[Mount, ...] = ()) -> Iterable[Any]:
    for route in routes:
        if isinstance(route, Mount):
            yield from _walk_routes(route.routes, (*prefix, route))
        elif hasattr(route, "endpoint"):
            route._idempotency_mounts = prefix  # the Mounts to match through, in order
            yield route


def _match_route(routes: list[tuple[Any, Policy]], scope: Scope) -> Policy | None:
    for route, policy in routes:
        child: Scope = scope
        for mount in route._idempotency_mounts:
            match, update = mount.matches(child)
            if match is not Match.FULL:
                break
            child = {**child, **update}
        else:
            match, _ = route.matches(child)
            if match is Match.FULL:
                return policy
    return None
