"""One event per request the middleware handles: the hook behind metrics, logs and anything else.

Events carry the route and the outcome, never the key (only a short hash of it) and never a body.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import hmac
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import Scope

logger = logging.getLogger("idempotency_mw")


class Outcome(enum.Enum):
    EXECUTED = "executed"  # the handler ran and its response was recorded
    REPLAYED = "replayed"  # a stored response was sent again
    IN_PROGRESS = "in_progress"  # 409: the original is still running
    KEY_REUSED = "key_reused"  # 422: same key, different request
    KEY_INVALID = "key_invalid"  # 400: malformed key
    KEY_MISSING = "key_missing"  # 400: a required key was absent
    TENANT_UNKNOWN = "tenant_unknown"  # 400: a keyed request whose tenant the resolver could not determine
    KEY_EXPIRED = "key_expired"  # 422: a UUIDv7 key older than the retention window
    REQUEST_TOO_LARGE = "request_too_large"  # 413
    RELEASED = "released"  # the handler ran but the outcome was transient: the key is free again
    FENCED_OUT = "fenced_out"  # our lease was taken over; our completion was refused
    STORE_ERROR = "store_error"  # the store failed (503, or a record that could not be written)
    POOL_EXHAUSTED = "pool_exhausted"  # like store_error, but every connection of the store's pool was busy
    NOT_REPLAYABLE = "not_replayable"  # the original response was not stored in full (over the cap, or cut short)
    UNPROTECTED = "unprotected"  # fail-open: the handler ran without a record
    CANCELLED = (
        "cancelled"  # cancelled while its claim was on its way, before anything ran (a claim it made is released)
    )


@dataclass(frozen=True, slots=True)
class Event:
    outcome: Outcome
    method: str
    path: str  # the request path, as sent (for logs)
    route: str  # the route template it matched (``/v1/charges/{id}``), or ``<unmatched>``: a bounded label
    tenant: str
    key_hash: str  # first 12 hex digits of sha256(key): enough to correlate logs, useless to replay
    status: int | None  # the status sent to the client
    duration: float  # seconds spent in the middleware and the handler
    store_seconds: float  # seconds spent waiting on the store
    attempts: int = 0  # requests that came with this key before this one finished (0: the first)
    reached_store: bool = False  # the request got as far as the store (``on_event.started`` was called for it)


EventHook = Callable[[Event], None]


def hash_key(key: str | None) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12] if key else ""


# Keyed by the tenant secret where one is set, so that every instance tags a tenant alike; else by a secret of this
# process. Either way a tag cannot be turned back into an account id by hashing candidates.
_TAG_KEY = (os.environ.get("IDEMPOTENCY_TENANT_SECRET") or secrets.token_hex(32)).encode()


def tenant_tag(tenant: str) -> str:
    """A short tag of ``tenant`` for log lines: two tenants of one key tell apart, and the tenant is not shown."""
    if not tenant:
        return "-"
    return hmac.new(_TAG_KEY, tenant.encode(), hashlib.sha256).hexdigest()[:8]


def log_level(outcome: Outcome) -> int:
    """Store failures are logged once per outage, not per request (failures.py); a fenced-out worker is worth a line
    each."""
    return logging.WARNING if outcome is Outcome.FENCED_OUT else logging.DEBUG


def log_event(event: Event) -> None:
    """The default hook: a debug line per request, a warning for the outcomes an operator should see."""
    level = log_level(event.outcome)
    if logger.isEnabledFor(level):
        logger.log(
            level,
            "idempotency %s %s %s tenant=%s key=%s status=%s %.1fms",
            event.outcome.value,
            event.method,
            event.path,
            tenant_tag(event.tenant),
            event.key_hash,
            event.status,
            event.duration * 1000,
        )


class Report:
    """What one covered request's event will say, filled in as the request goes and sent once, as soon as its
    outcome is decided: before the answer goes out, while a server span still records."""

    __slots__ = (
        "_hook",
        "_started_hook",
        "attempts",
        "key",
        "method",
        "outcome",
        "path",
        "reached_store",
        "route",
        "started",
        "status",
        "store_seconds",
        "tenant",
    )  # fmt: skip

    def __init__(self, hook: EventHook | None, method: str, path: str, route: str) -> None:
        self._hook = hook
        self._started_hook = getattr(hook, "started", None)
        self.method, self.path, self.route = method, path, route
        self.started = time.perf_counter()
        self.outcome: Outcome | None = None
        self.status: int | None = None
        self.tenant = ""
        self.key: str | None = None
        self.store_seconds = 0.0  # waiting on the store
        self.attempts = 0  # requests with this key before this one finished
        self.reached_store = False

    @property
    def decided(self) -> bool:
        return self.outcome is not None

    def reach_store(self, scope: Scope) -> None:
        """The request reaches the store: the hook's ``started(scope)``, if it has one, hears of it (an in-flight
        gauge)."""
        self.reached_store = True
        if self._started_hook is not None:
            try:
                self._started_hook(scope)
            except Exception:
                logger.exception("idempotency on_event.started hook failed")

    def decide_after(self, settling: asyncio.Future[Outcome], status: int | None) -> None:
        """Decide once ``settling`` ends: a settlement (or an abandoned claim) that outlasts its cancelled request."""

        def decide(settled: asyncio.Future[Outcome]) -> None:
            if not settled.cancelled() and settled.exception() is None:
                self.decide(settled.result(), status)

        if settling.done():
            decide(settling)
        else:
            settling.add_done_callback(decide)

    def decide(self, outcome: Outcome, status: int | None) -> None:
        """The outcome is known: send the event now. Once: the first decision stands."""
        if self.outcome is not None:
            return
        self.outcome, self.status = outcome, status
        hook = self._hook
        if hook is None or (hook is log_event and not logger.isEnabledFor(log_level(outcome))):
            return  # nobody listens, or the default hook would drop this event: do not build it
        event = Event(
            outcome,
            self.method,
            self.path,
            self.route,
            self.tenant,
            hash_key(self.key),
            status,
            time.perf_counter() - self.started,
            self.store_seconds,
            self.attempts,
            self.reached_store,
        )
        try:
            hook(event)
        except Exception:
            logger.exception("idempotency on_event hook failed")
