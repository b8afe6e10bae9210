"""The middleware's own error responses: RFC 9457 ``application/problem+json`` with a stable ``code``."""

from __future__ import annotations

from dataclasses import dataclass

import orjson
from starlette.types import Send

from idempotency_mw.wire import ProblemCode

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
