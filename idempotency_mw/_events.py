"""One event per request the middleware handles, the hook behind metrics, logs and anything else; and what the
operator is told of the store's failures and of misconfigurations.

Events carry the route and the outcome, never the key (only a short hash of it) and never a body.

Store failures in the log: the first one in full, then a summary now and then, until the store answers again.

A database that is down fails every request. One traceback per request would bury the log (200 requests made
12,600 lines) and say nothing new after the first; the metrics already count every failure. So a
:class:`FailureLog` logs the first failure with its traceback and the store's own explanation (unreachable, pool
exhausted: raise ``max_size``, not migrated: run ``idempotency-mw migrate``), then one line per ``interval``
with how many more failed, and one line when the store answers again.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import hmac
import logging
import os
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger("idempotency_mw")


class Outcome(enum.Enum):
    __hash__ = object.__hash__  # by identity, in C (Enum's own is Python code): outcomes key the log levels

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
    STOPPED = "stopped"  # a step had committed: left at its recovery point (never released), the retry resumes there
    NOT_RESUMABLE = "not_resumable"  # 409: an unrepeatable step of an earlier attempt has no recorded outcome


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
    resumed_from: str | None = None  # the last step an earlier attempt committed, when this one resumed after it
    # Observe only (``observe=True``): ``outcome`` is what enforcing would have done, and the request ran and was
    # answered as without the middleware (``status`` is its own). Count it apart: a would-be replay is no replay.
    observed: bool = False


EventHook = Callable[[Event], None]


def hash_key(key: str | None) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12] if key else ""


@functools.cache
def _tag_key() -> bytes:
    """The key of tenant tags: the tenant secret where one is set, so that every instance tags a tenant alike; else a
    secret of this process. Either way a tag cannot be turned back into an account id by hashing candidates. Read at
    the first tag, not at import: an app may set the secret after importing the package."""
    return (os.environ.get("IDEMPOTENCY_TENANT_SECRET") or secrets.token_hex(32)).encode()


def tenant_tag(tenant: str) -> str:
    """A short tag of ``tenant`` for log lines: two tenants of one key tell apart, and the tenant is not shown."""
    if not tenant:
        return "-"
    return hmac.new(_tag_key(), tenant.encode(), hashlib.sha256).hexdigest()[:8]


# Store failures are logged once per outage, not per request (FailureLog); a fenced-out worker is worth a line each.
LOG_LEVELS = {outcome: logging.DEBUG for outcome in Outcome} | {
    Outcome.FENCED_OUT: logging.WARNING,
    Outcome.NOT_RESUMABLE: logging.ERROR,  # an operator has to finish the request (idempotency-mw stalled)
}
# Observing: a line at INFO where enforcing would have answered otherwise than the app did (a replay, a 409, a 422, a
# refusal, a 503), which is what a rollout waits to see; at DEBUG where it would have done the same.
OBSERVED_LOG_LEVELS = (
    {outcome: logging.INFO for outcome in Outcome}
    | {outcome: logging.DEBUG for outcome in (Outcome.EXECUTED, Outcome.RELEASED, Outcome.CANCELLED)}
    | {Outcome.FENCED_OUT: logging.WARNING}
)


def log_event(event: Event) -> None:
    """The default hook: a debug line per request, a warning for the outcomes an operator should see; an observed
    request's line says so, and what enforcing would have done."""
    level = (OBSERVED_LOG_LEVELS if event.observed else LOG_LEVELS)[event.outcome]
    if logger.isEnabledFor(level):
        tag = tenant_tag(event.tenant)
        logger.log(
            level,
            "idempotency %s%s %s %s tenant=%s key=%s status=%s %.1fms",
            "observed, not enforced: would be " if event.observed else "",
            event.outcome.value,
            event.method,
            event.path,
            tag,
            event.key_hash,
            event.status,
            event.duration * 1000,
            extra={  # the same as fields, for JSON logging (python-json-logger, structlog's stdlib bridge)
                "idempotency_outcome": event.outcome.value,
                "idempotency_method": event.method,
                "idempotency_route": event.route,
                "idempotency_path": event.path,
                "idempotency_tenant_tag": tag,
                "idempotency_key_hash": event.key_hash,
                "idempotency_status": event.status,
                "idempotency_duration_ms": round(event.duration * 1000, 3),
                "idempotency_attempts": event.attempts,
                **({"idempotency_observed": True} if event.observed else {}),
            },
        )


class Notices:
    """What the operator hears once per middleware, not once per request: a misconfiguration that answers every
    affected request the same way (a tenant resolver that cannot tell tenants, a route's key function that raises)."""

    def __init__(self) -> None:
        self._said: set[str] = set()

    def once(
        self, topic: str, message: str, *, level: int = logging.WARNING, error: BaseException | None = None
    ) -> None:
        """Log ``message`` the first time ``topic`` comes up (with ``error``'s traceback, if given)."""
        if topic not in self._said:
            self._said.add(topic)
            logger.log(level, message, exc_info=error)


class FailureLog:
    def __init__(
        self, logger: logging.Logger, *, interval: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._logger = logger
        self._interval = interval
        self._clock = clock
        self.failing = False  # since the first failure, until a call goes through again
        self._failing_since: float | None = None
        self._summary_due = 0.0
        self._total = 0  # failures since the first one of this outage
        self._recent: Counter[str] = Counter()  # failures since the last line, by what failed and why

    def failed(self, what: str, error: BaseException) -> None:
        """The store failed to ``what`` ("claim a key", "renew a lease", ...) with ``error``."""
        now = self._clock()
        self._total += 1
        if self._failing_since is None:
            self.failing = True
            self._failing_since, self._summary_due = now, now + self._interval
            self._logger.error(
                "idempotency store failed to %s: %s (further failures are summarised every %gs until it recovers)",
                what,
                _explain(error),
                self._interval,
                exc_info=error,
            )
            return
        self._recent[f"{what}: {_explain(error)}"] += 1
        if now >= self._summary_due:
            self._summary_due = now + self._interval
            recent, self._recent = self._recent, Counter()
            self._logger.warning(
                "idempotency store still failing after %.1fs: %d more failure(s) in the last %gs (%s)",
                now - self._failing_since,
                sum(recent.values()),
                self._interval,
                "; ".join(f"{count} x {kind}" for kind, count in recent.most_common(3)),
            )

    def succeeded(self) -> None:
        """A store call went through: if the store was failing, say it recovered."""
        if self._failing_since is None:
            return
        self._logger.warning(
            "idempotency store answers again after %.1fs and %d failure(s)",
            self._clock() - self._failing_since,
            self._total,
        )
        self.failing = False
        self._failing_since, self._total, self._recent = None, 0, Counter()


def _explain(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
