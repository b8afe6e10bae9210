"""What a handler can learn about the idempotent request it is serving, and how an app that authenticates inside the
request hands the middleware its tenant."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from idempotency_mw.store import Transaction

if TYPE_CHECKING:
    import asyncpg
    from starlette.requests import HTTPConnection

    from idempotency_mw._steps import Steps

STATE_KEY = "idempotency"
PENDING_KEY = "idempotency_pending"
NOT_EXECUTED_KEY = "idempotency_not_executed"

_DOWNSTREAM_V1 = "idempotency-mw/downstream/v1"
_DOWNSTREAM_V2 = b"idempotency-mw/downstream/v2\0"
_LENGTH = struct.Struct(">Q")


@dataclass(frozen=True, slots=True)
class IdempotencyContext:
    """Set on ``request.state.idempotency`` for every request the middleware handles.

    ``transaction`` is the open transaction of a transactional route: write the effect through it and the
    idempotency record commits with it, or neither does. It is None on other routes.
    """

    tenant: str
    key: str | None  # None for a request without a key (or one whose key no tenant scopes)
    transaction: Transaction | None = None
    # A transactional route's run, which makes its steps: a weak reference, since the context stays in the request's
    # scope and the run refers back to the request (held strongly, the request would wait for the cycle collector).
    recovery: Callable[[], StepsSource | None] | None = None

    @property
    def steps(self) -> Steps:
        """The steps of a transactional request (docs/guide.md, "Requests with steps outside the database"): each
        commits with a recovery point, and a retry resumes after the last one. Switched off or observing, every step
        runs and none is recorded. LookupError on a route that is not transactional, or for a request without a key
        (while enforcing)."""
        if self.recovery is None:
            raise LookupError(
                "steps are for transactional routes: use @idempotent(transactional=True) or "
                "IdempotencyMiddleware(transactional=True), with a PostgresStore or SQLAlchemyStore"
            )
        run = self.recovery()
        if run is None:
            raise LookupError("the request has ended: its steps ran while it did")
        return run.steps(None if self.key is None else self.downstream_key)

    @property
    def connection(self) -> asyncpg.Connection | None:
        """The asyncpg connection of a transactional route's transaction (``PostgresStore``); None elsewhere. It
        refuses use once the request has ended."""
        lent: asyncpg.Connection | None = getattr(self.transaction, "lent", None)
        return lent

    def downstream_key(self, label: str) -> str:
        """A stable key (64 hex digits) for a side effect that cannot join the transaction (a payment provider's API).

        The same tenant, key and label always give the same value, so a retry of this request sends the
        provider the same ``Idempotency-Key`` and the provider deduplicates its half. Use one label per call.
        """
        if self.key is None:
            raise LookupError("this request carries no Idempotency-Key to derive a downstream key from")
        parts = (self.tenant, self.key, label)
        if not any("\0" in part for part in parts):
            # Without a NUL the NUL-joined parts read back one way only. Providers hold these values already: a
            # retry after an upgrade that derived another one would be charged twice, so they never change.
            return hashlib.sha256(b"\0".join(p.encode() for p in (_DOWNSTREAM_V1, *parts))).hexdigest()
        # A tenant or label holding a NUL could spell another request's joined parts: each part is length-prefixed
        # instead, under a prefix of its own, so it meets neither another such request nor one of the first kind.
        encoded = [part.encode() for part in parts]
        prefixed = b"".join(_LENGTH.pack(len(part)) + part for part in encoded)
        return hashlib.sha256(_DOWNSTREAM_V2 + prefixed).hexdigest()


class StepsSource(Protocol):
    """What makes a request's steps: its transactional run (``_transactional.py``)."""

    @property
    def resumed_from(self) -> str | None:
        """The last step an earlier attempt committed, when the request resumed after it."""

    def steps(self, downstream_key: Callable[[str], str] | None) -> Steps:
        """The request's steps, whose outside calls get their keys from ``downstream_key`` (None: it has no key)."""


def resumed_from(scope: MutableMapping[str, Any]) -> str | None:
    """The step a request resumed after (for its event), if its handler ran in steps."""
    context = scope.get("state", {}).get(STATE_KEY)
    recovery = context.recovery if isinstance(context, IdempotencyContext) else None
    run = None if recovery is None else recovery()
    return None if run is None else run.resumed_from


class ClaimAnswered(Exception):
    """Raised by :func:`claim` when the middleware has answered the request itself (a replay, a 409, a 422, a 400):
    the handler must not run. The middleware takes it back on its way out, and drops whatever the app sends after it
    (an exception handler's 500, say)."""


class PendingClaim(Protocol):
    """A covered request whose claim waits for the app to tell its tenant (``_request.TenantFromAppRequest``)."""

    async def claim_for(self, tenant: str | None) -> IdempotencyContext: ...


async def claim(request: HTTPConnection, tenant: str | None) -> IdempotencyContext | None:
    """Steps 2 and 4 of the request flow, for an app that authenticates inside the request: scope the key by
    ``tenant`` (None: unknown, refused with 400) and claim it, before the handler's body runs.

    With ``IdempotencyMiddleware(tenant=...)`` given a tenant the app resolves itself (:class:`TenantFromApp`;
    ``idempotency_mw.fastapi.TenantDependency`` does this as a FastAPI dependency), the middleware reads and checks
    the key and the body, then leaves the claim to this call, so that the app's own authentication answers first (its
    401, before any of the middleware's answers). When the key is not this request's to run (a replay, one still in
    progress, another request's, or a refusal), the middleware has answered and this raises :class:`ClaimAnswered`.
    A request the middleware does not cover gets None; a keyless one, its context (key None); one whose claim was
    taken already, its context.
    """
    state: dict[str, Any] = request.scope.setdefault("state", {})
    pending: PendingClaim | None = state.get(PENDING_KEY)
    if pending is not None:
        return await pending.claim_for(tenant)
    return idempotency_context(request)


def idempotency_context(request: HTTPConnection) -> IdempotencyContext | None:
    """The context of ``request``, or None when the middleware did not handle it."""
    state: dict[str, Any] = request.scope.get("state", {})
    context = state.get(STATE_KEY)
    return context if isinstance(context, IdempotencyContext) else None


def mark_not_executed(request: HTTPConnection) -> None:
    """Tell the middleware that this request was refused before anything ran (say, its parameters were invalid).

    The key is then released whatever the status, so the client may correct the request and retry with the same
    key: Stripe's rule for validation errors. ``idempotency_mw.fastapi.setup`` does this for FastAPI's own
    request validation errors.
    """
    request.scope.setdefault("state", {})[NOT_EXECUTED_KEY] = True
