"""The middleware's own error responses: RFC 9457 ``application/problem+json`` with a stable ``code``."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import orjson
from starlette.types import Send

from idempotency_mw._events import Notices, Outcome
from idempotency_mw._keys import ROUTE_TENANTS, KeyFunctionFailed, requirement, unknown_tenant_advice
from idempotency_mw._wire import ProblemCode
from idempotency_mw.store import Claim, ClaimOutcome

TYPE_BASE = "urn:idempotency-mw:problem:"


@dataclass(frozen=True, slots=True)
class Problem:
    status: int
    code: ProblemCode
    title: str
    detail: str
    retry_after: int | None = None

    def body(self) -> bytes:
        return orjson.dumps(
            {
                "type": TYPE_BASE + self.code,
                "title": self.title,
                "status": self.status,
                "detail": self.detail,
                "code": self.code,
            }
        )

    async def send(self, send: Send) -> None:
        body = self.body()
        headers = [
            (b"content-type", b"application/problem+json"),
            (b"content-length", str(len(body)).encode()),
        ]
        if self.retry_after is not None:
            headers.append((b"retry-after", str(self.retry_after).encode()))
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def key_missing() -> Problem:
    return Problem(
        400, ProblemCode.KEY_MISSING, "Idempotency-Key required", "This operation requires an Idempotency-Key header."
    )


def tenant_unknown(requirement: str | None = None) -> Problem:
    """``requirement``: what the configured tenant resolver needs (say "exactly one X-API-Key header")."""
    return Problem(
        400,
        ProblemCode.TENANT_UNKNOWN,
        "Idempotency-Key owner unknown",
        "This request carries an Idempotency-Key but no credentials the server can scope that key by, so it was "
        "not processed. Send it with " + (requirement if requirement else "the credentials this API expects") + ".",
    )


def key_invalid(reason: str) -> Problem:
    return Problem(400, ProblemCode.KEY_INVALID, "Invalid Idempotency-Key", reason + ".")


def key_reused() -> Problem:
    return Problem(
        422,
        ProblemCode.KEY_REUSED,
        "Idempotency-Key already used",
        "This Idempotency-Key was already used with a different request (method, path, query or "
        "body). Use a new key for a new request.",
    )


def in_progress(retry_after: int) -> Problem:
    return Problem(
        409,
        ProblemCode.IN_PROGRESS,
        "Request in progress",
        "A request with this Idempotency-Key is still being processed. Retry later with the same key "
        "to receive its response.",
        retry_after,
    )


def request_too_large(limit: int) -> Problem:
    return Problem(
        413,
        ProblemCode.REQUEST_TOO_LARGE,
        "Request body too large",
        f"Requests with an Idempotency-Key may carry at most {limit} bytes of body.",
    )


def store_unavailable(retry_after: int) -> Problem:
    return Problem(
        503,
        ProblemCode.STORE_UNAVAILABLE,
        "Idempotency store unavailable",
        "The idempotency store cannot be reached, so the request was not processed. Retry later with the same key.",
        retry_after,
    )


def response_not_replayable(status: int, size: int, limit: int) -> Problem:
    """A completed operation whose response was not stored in full: over the cap, or cut short mid-stream."""
    if size > limit:
        why = f"its response was larger than the {limit}-byte storage limit"
    else:
        why = "its response was cut short before it was complete (the client disconnected, or the handler failed)"
    return Problem(
        409,
        ProblemCode.NOT_REPLAYABLE,
        "Original response cannot be replayed",
        f"The original request with this Idempotency-Key completed with status {status}, but {why}, so it "
        "cannot be replayed. The operation was not run again.",
    )


def key_expired(max_age: int) -> Problem:
    return Problem(
        422,
        ProblemCode.KEY_EXPIRED,
        "Idempotency-Key too old",
        f"This Idempotency-Key carries a timestamp older than the {max_age}-second retention window, "
        "so a previous use can no longer be detected. Use a new key.",
    )


# -- the answers, with the outcome each reports -------------------------------------------------------------------

Refusal = tuple[Problem, Outcome]


def answer_to(claim: Claim, retry_after: int, max_response_bytes: int) -> Refusal:
    """The refusal of a claim that is not the request's, and that cannot be replayed: a different request (422), one
    still running (409), one completed whose response was not stored in full (409)."""
    if claim.outcome is ClaimOutcome.MISMATCH:
        return key_reused(), Outcome.KEY_REUSED
    if claim.outcome is ClaimOutcome.IN_PROGRESS:
        return in_progress(retry_after), Outcome.IN_PROGRESS
    response = claim.response
    assert response is not None  # COMPLETED, but not stored in full (over the cap, or cut short)
    return response_not_replayable(response.status, response.body_size, max_response_bytes), Outcome.NOT_REPLAYABLE


def tenant_unknown_to(resolver: object, notices: Notices) -> Refusal:
    """The refusal of a keyed request whose tenant is unknown, in the words of the ``resolver`` that could not tell
    it; the operator hears how to fix it once, not per request."""
    notices.once("tenant unknown", unknown_tenant_advice(resolver))
    return tenant_unknown(requirement(resolver)), Outcome.TENANT_UNKNOWN


def tenant_reserved(resolver: object, notices: Notices) -> Refusal:
    """The refusal of a tenant the resolver returned in the namespace kept for routes' own tenants: it could meet a
    route's records (a webhook's)."""
    notices.once(
        "tenant reserved",
        f"idempotency: the tenant resolver {resolver!r} returned a tenant starting with {ROUTE_TENANTS!r}, the "
        "namespace of the tenants routes name themselves (tenant= on a route): such a request is refused with "
        "400 idempotency_tenant_unknown. Logged once per middleware.",
        level=logging.ERROR,
    )
    return tenant_unknown(requirement(resolver)), Outcome.TENANT_UNKNOWN


def key_function_failed(error: KeyFunctionFailed, notices: Notices) -> Refusal:
    """A route's ``key_from`` raised: its caller gets 400; the operator hears of it once, with the traceback."""
    notices.once(
        "key function",
        "idempotency: a route's key_from function raised on a request body, which was answered 400 "
        "idempotency_key_invalid (make the function return None for bodies without a key). Logged once per "
        "middleware.",
        error=error.__cause__,
    )
    return key_invalid(str(error)), Outcome.KEY_INVALID
