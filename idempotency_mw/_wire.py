"""What crosses the wire between a client and the middleware: header names, the key's length, and problem codes.

One home for each, shared by the middleware, the response recorder and the client (``client.py``), so they cannot
drift apart.
"""

from __future__ import annotations

import enum

KEY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"  # "true" on a replayed response
PROBLEM_HEADER = "Idempotency-Problem"  # the ProblemCode of every answer the middleware gives itself, whatever its body
EXPIRES_HEADER = "Idempotency-Expires"  # on a recorded answer, live or replayed: the record's expiry, an HTTP-date
MAX_KEY_LENGTH = 255  # characters of a key, after unquoting


class ProblemCode(enum.StrEnum):
    """The stable ``code`` of every answer the middleware gives itself (docs/design.md §5): in its problem+json body,
    and in its ``Idempotency-Problem`` header whatever the body (an app's own envelope)."""

    KEY_MISSING = "idempotency_key_missing"  # 400
    KEY_INVALID = "idempotency_key_invalid"  # 400
    TENANT_UNKNOWN = "idempotency_tenant_unknown"  # 400
    REQUEST_TOO_LARGE = "request_too_large"  # 413
    KEY_REUSED = "idempotency_key_reused"  # 422, or the route's reused_key_status (409, 400)
    KEY_EXPIRED = "idempotency_key_expired"  # 422
    IN_PROGRESS = "idempotency_request_in_progress"  # 409, with Retry-After
    NOT_REPLAYABLE = "idempotency_response_not_replayable"  # 409
    STORE_UNAVAILABLE = "idempotency_store_unavailable"  # 503, with Retry-After
    STEP_NOT_RESUMABLE = "idempotency_step_not_resumable"  # 409, without Retry-After: an operator finishes it
