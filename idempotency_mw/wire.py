"""What crosses the wire between a client and the middleware: header names, the key's length, problem codes, and
the ASGI extensions a response could use to send its body around the middleware.

One home for each, shared by the middleware, the response recorder and the client (``client.py``), so they cannot
drift apart.
"""

from __future__ import annotations

import enum

from starlette.types import Scope

KEY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"  # "true" on a replayed response
MAX_KEY_LENGTH = 255  # characters of a key, after unquoting

# ASGI extensions that send a response's body around ``send`` (a file by its path), where it could not be recorded:
# the middleware does not offer them to the handler, and the recorder marks a response that used one unreplayable.
WITHHELD_EXTENSIONS = frozenset({"http.response.pathsend", "http.response.zerocopysend"})


def header(scope: Scope, name: bytes) -> bytes:
    """A request header's first value, by its lower-cased name (as ASGI servers pass it), or ``b""``."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return b""


def handler_scope(scope: Scope) -> Scope:
    """The scope a covered handler sees: without the extensions that would send its body around the recorder. A
    Starlette FileResponse then streams its file through ``send``."""
    extensions = scope.get("extensions")
    if extensions and not WITHHELD_EXTENSIONS.isdisjoint(extensions):
        scope["extensions"] = {k: v for k, v in extensions.items() if k not in WITHHELD_EXTENSIONS}
    return scope


class ProblemCode(enum.StrEnum):
    """The stable ``code`` of every problem+json answer the middleware gives itself (docs/design.md §5)."""

    KEY_MISSING = "idempotency_key_missing"  # 400
    KEY_INVALID = "idempotency_key_invalid"  # 400
    TENANT_UNKNOWN = "idempotency_tenant_unknown"  # 400
    REQUEST_TOO_LARGE = "request_too_large"  # 413
    KEY_REUSED = "idempotency_key_reused"  # 422
    KEY_EXPIRED = "idempotency_key_expired"  # 422
    IN_PROGRESS = "idempotency_request_in_progress"  # 409, with Retry-After
    NOT_REPLAYABLE = "idempotency_response_not_replayable"  # 409
    STORE_UNAVAILABLE = "idempotency_store_unavailable"  # 503, with Retry-After
