"""Stripe's response conventions at the app's edge: ``Request-Id``, the ``Idempotency-Key`` echo, and Stripe's
envelope (and statuses) for the idempotency middleware's own answers.

Two pure-ASGI layers, one on each side of ``IdempotencyMiddleware``:

- :class:`StripeEdge` goes outside it. It names every request (``Request-Id: req_…``, kept in the scope) and turns
  the middleware's own answers, RFC 9457 problems, into the errors Stripe sends in the same situations: a key
  reused for another request is Stripe's 400 ``idempotency_error`` (the middleware says 422, as the IETF draft
  does), a request still in progress is a 409 ``idempotency_key_in_use`` with ``Stripe-Should-Retry: true``.
  Answers that already carry a ``Request-Id`` (the app's, replays included) pass through untouched.
- :class:`StampHeaders` goes inside it, so the headers it adds to the app's answers are part of what the
  middleware records. A replay is then the original answer byte for byte (plus ``Idempotent-Replayed: true``):
  the original's ``Request-Id`` included, which is what Stripe returns on a replay.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from examples.payments.wire import WWW_AUTHENTICATE, new_id

REQUEST_ID = "payments.request_id"  # the scope["state"] entry that holds the request's id
_REQUEST_ID = b"request-id"
_IDEMPOTENCY_KEY = b"idempotency-key"
_PROBLEM = b"application/problem+json"


@dataclass(frozen=True, slots=True)
class Translation:
    """How Stripe answers what the middleware answered with one of its problem codes."""

    status: int
    type: str
    code: str
    meaning: str  # what happened, as the OpenAPI schema tells clients (app._document)
    should_retry: bool | None = None  # Stripe-Should-Retry, which Stripe's client libraries obey


# The middleware's problem codes (idempotency_mw._problems) and Stripe's answer in the same situation.
TRANSLATIONS: dict[str, Translation] = {
    # Stripe: 400 idempotency_error for a key used with other parameters; the middleware: 422.
    "idempotency_key_reused": Translation(
        400, "idempotency_error", "idempotency_key_reused", "this Idempotency-Key was used with another request", False
    ),
    "idempotency_key_expired": Translation(
        400, "idempotency_error", "idempotency_key_expired", "a UUIDv7 Idempotency-Key older than its retention", False
    ),
    # Stripe: 409 idempotency_key_in_use while a request with the key runs; retrying later is the cure.
    "idempotency_request_in_progress": Translation(
        409,
        "idempotency_error",
        "idempotency_key_in_use",
        "a request with this Idempotency-Key is still running: retry after Retry-After seconds with the same key",
        True,
    ),
    # The original ran but its answer was not stored in full: retrying cannot help.
    "idempotency_response_not_replayable": Translation(
        409,
        "idempotency_error",
        "idempotency_response_not_replayable",
        "the request with this Idempotency-Key ran, but its answer cannot be replayed: do not retry",
        False,
    ),
    # A handler in steps (a payout) whose unrepeatable step began in an earlier attempt, its outcome unknown: it is
    # settled by hand (docs/operations.md, stalled requests), and retrying cannot help until it is.
    "idempotency_step_not_resumable": Translation(
        409,
        "idempotency_error",
        "idempotency_step_not_resumable",
        "a step of the request with this Idempotency-Key cannot be repeated and its outcome is unknown: do not retry",
        False,
    ),
    "idempotency_key_invalid": Translation(
        400, "invalid_request_error", "idempotency_key_invalid", "the Idempotency-Key is malformed", False
    ),
    "idempotency_key_missing": Translation(
        400, "invalid_request_error", "idempotency_key_missing", "this request needs an Idempotency-Key", False
    ),
    # A keyed request without credentials: Stripe's 401 (its body's type is invalid_request_error).
    "idempotency_tenant_unknown": Translation(
        401, "invalid_request_error", "api_key_invalid", "an Idempotency-Key sent without a valid API key", False
    ),
    "request_too_large": Translation(
        413, "invalid_request_error", "request_too_large", "the body is over the size limit of keyed requests", False
    ),
    # Nothing ran: the same request may be sent again.
    "idempotency_store_unavailable": Translation(
        503,
        "api_error",
        "idempotency_store_unavailable",
        "the idempotency store is unavailable, nothing ran: retry after Retry-After seconds with the same key",
        True,
    ),
}


def request_id(scope: Scope) -> str:
    """The request's ``Request-Id``: the one ``StripeEdge`` gave it, or a new one if it has none yet."""
    state: dict[str, Any] = scope.setdefault("state", {})
    value = state.get(REQUEST_ID)
    if not isinstance(value, str):
        value = state[REQUEST_ID] = new_id("req")
    return value


def idempotency_key(scope: Scope) -> bytes | None:
    """The ``Idempotency-Key`` header as the client sent it, to echo back."""
    for name, value in scope["headers"]:
        if name == _IDEMPOTENCY_KEY:
            return bytes(value)
    return None


def stamped(headers: Iterable[tuple[bytes, bytes]], scope: Scope) -> list[tuple[bytes, bytes]]:
    """``headers`` plus ``Request-Id`` and the ``Idempotency-Key`` echo, where they are not there yet."""
    headers = list(headers)
    present = {name.lower() for name, _ in headers}
    if _REQUEST_ID not in present:
        headers.append((_REQUEST_ID, request_id(scope).encode()))
    key = idempotency_key(scope)
    if key is not None and _IDEMPOTENCY_KEY not in present:
        headers.append((_IDEMPOTENCY_KEY, key))
    return headers


class StampHeaders:
    """Inside ``IdempotencyMiddleware``: add ``Request-Id`` and the key echo to the app's answers, so that they are
    recorded with them and a replay carries the original's."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def stamp(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": stamped(message.get("headers", ()), scope)}
            await send(message)

        await self.app(scope, receive, stamp)


class StripeEdge:
    """Outside ``IdempotencyMiddleware``: name the request, and answer the middleware's own refusals as Stripe would.

    Only answers that are ``application/problem+json`` with one of the middleware's codes (``TRANSLATIONS``) are
    rewritten; their status, ``Retry-After`` and ``WWW-Authenticate`` follow Stripe. Everything else passes through,
    gaining a ``Request-Id`` and the key echo only if it lacks them (the app's answers and replays have both).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id(scope)  # named before anything runs, so every layer and handler sees the same id
        held: Message | None = None
        chunks: list[bytes] = []

        async def edge(message: Message) -> None:
            nonlocal held
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                if dict(headers).get(b"content-type", b"").startswith(_PROBLEM):
                    held = message  # a problem: decide once its body is complete
                    return
                message = {**message, "headers": stamped(headers, scope)}
            elif message["type"] == "http.response.body" and held is not None:
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    for part in _answer(held, b"".join(chunks), scope):
                        await send(part)
                return
            await send(message)

        await self.app(scope, receive, edge)


def _answer(start: Message, body: bytes, scope: Scope) -> list[Message]:
    """The middleware's problem in Stripe's envelope; any other problem+json answer unchanged (but stamped)."""
    try:
        problem = orjson.loads(body)
    except orjson.JSONDecodeError:
        problem = None
    code = problem.get("code") if isinstance(problem, dict) else None
    translation = TRANSLATIONS.get(code) if isinstance(code, str) else None
    if translation is None or not isinstance(problem, dict):
        return [
            {**start, "headers": stamped(start.get("headers", ()), scope)},
            {"type": "http.response.body", "body": body},
        ]
    error = {"type": translation.type, "code": translation.code, "message": str(problem.get("detail", ""))}
    envelope = orjson.dumps({"error": error})
    kept = [(k, v) for k, v in start.get("headers", ()) if k.lower() == b"retry-after"]
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(envelope)).encode()),
        *kept,
    ]
    if translation.should_retry is not None:
        headers.append((b"stripe-should-retry", b"true" if translation.should_retry else b"false"))
    if translation.status == 401:
        headers.append((b"www-authenticate", WWW_AUTHENTICATE.encode()))
    return [
        {"type": "http.response.start", "status": translation.status, "headers": stamped(headers, scope)},
        {"type": "http.response.body", "body": envelope},
    ]
