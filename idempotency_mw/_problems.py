"""The middleware's own answers: what each one is (a :class:`Problem`, with a stable code), which one a claim that is
not the request's gets, and the envelope they go out in: RFC 9457 ``application/problem+json`` by default, or the
app's own (``problem_renderer=``). Whatever the body, an answer keeps its status, and carries its code in the
``Idempotency-Problem`` header and its ``Retry-After``, so a client reads them alike from any envelope."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.responses import Response
from starlette.types import Scope, Send

from idempotency_mw._events import Notices, Outcome
from idempotency_mw._keys import ROUTE_TENANTS, KeyFunctionFailed, requirement, unknown_tenant_advice
from idempotency_mw._parts import Changes, RequestParts, explain
from idempotency_mw._policy import Policy
from idempotency_mw._wire import PROBLEM_HEADER, ProblemCode
from idempotency_mw.store import Claim, ClaimOutcome

TYPE_BASE = "urn:idempotency-mw:problem:"
_PROBLEM_HEADER = PROBLEM_HEADER.lower().encode("latin-1")


@dataclass(frozen=True, slots=True)
class Problem:
    """An answer the middleware gives itself, before it is put in an envelope: what a ``problem_renderer`` is given.

    ``status`` is the HTTP status it goes out with; ``code`` its stable :class:`ProblemCode` (a ``str``); ``title``
    a short summary and ``detail`` what happened and what the client can do, in English; ``retry_after`` the seconds
    of its ``Retry-After`` header, or None when the client should not retry it unchanged; ``changed``, on a reused
    key's answer from a route with ``explain_mismatch``, what differs from the first request (docs/semantics.md).
    """

    status: int
    code: ProblemCode
    title: str
    detail: str
    retry_after: int | None = None
    changed: dict[str, Any] | None = None  # a reused key's, on a route that explains it: what differs

    def body(self) -> bytes:
        """The default body: RFC 9457 problem details, with the code (and a reused key's ``changed``) as extension
        members."""
        document: dict[str, Any] = {
            "type": TYPE_BASE + self.code,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
            "code": self.code,
        }
        if self.changed is not None:
            document["changed"] = self.changed
        return orjson.dumps(document)

    def headers(self) -> list[tuple[bytes, bytes]]:
        """What goes with the problem in any envelope: its code, and its ``Retry-After`` if it has one."""
        headers = [(_PROBLEM_HEADER, self.code.encode("latin-1"))]
        if self.retry_after is not None:
            headers.append((b"retry-after", str(self.retry_after).encode()))
        return headers

    async def send(self, send: Send) -> None:
        """Send it as ``application/problem+json``."""
        await _send(send, self, [(b"content-type", b"application/problem+json")], self.body())


ProblemRenderer = Callable[[Problem, Scope], "Response | Awaitable[Response]"]

# What the middleware sets itself on a rendered problem, in place of the renderer's: the code cannot be forged, the
# Retry-After is the problem's, and the length is the body's.
_OWN_HEADERS = frozenset({_PROBLEM_HEADER, b"retry-after", b"content-length"})


class Envelope:
    """What the middleware's problems go out in: ``application/problem+json``, or the app's own envelope, made by its
    ``problem_renderer`` (sync or async: the :class:`Problem` and the ASGI scope, to a Starlette ``Response``).

    A rendered problem goes out with the renderer's body and headers, under the problem's status, with the problem's
    ``Idempotency-Problem`` and ``Retry-After``. A renderer that raises, or whose answer cannot go out as the problem
    (not a ``Response``, a body not in memory, another status, a background task the middleware would not run), gets
    the default problem+json sent in its place, and the operator hears of it once: an answer is never lost to it.
    """

    def __init__(self, renderer: ProblemRenderer | None, notices: Notices) -> None:
        if renderer is not None and not callable(renderer):
            raise TypeError(
                f"problem_renderer must be a callable taking the Problem and the ASGI scope, got {renderer!r}"
            )
        self.renderer = renderer
        self.notices = notices

    async def send(self, problem: Problem, scope: Scope, send: Send) -> None:
        response = None if self.renderer is None else await self._render(self.renderer, problem, scope)
        if response is None:
            return await problem.send(send)
        headers = [(name, value) for name, value in response.raw_headers if name not in _OWN_HEADERS]
        await _send(send, problem, headers, bytes(response.body))

    async def _render(self, renderer: ProblemRenderer, problem: Problem, scope: Scope) -> Response | None:
        """The app's rendering of ``problem``, or None when it cannot go out (then the operator hears why, once)."""
        try:
            response = renderer(problem, scope)
            if inspect.isawaitable(response):
                response = await response
        except Exception as error:
            self.notices.once(
                "problem renderer raised",
                f"idempotency: the problem_renderer raised on a {problem.code} problem, which went out as "
                "application/problem+json instead, with its status and code. Logged once per middleware.",
                level=logging.ERROR,
                error=error,
            )
            return None
        why = _unsendable(response, problem)
        if why is not None:
            self.notices.once(
                "problem renderer answer",
                f"idempotency: the problem_renderer {why}, so the problem went out as application/problem+json "
                "instead. Logged once per middleware.",
                level=logging.ERROR,
            )
            return None
        return response


def _unsendable(response: object, problem: Problem) -> str | None:
    """Why the renderer's ``response`` cannot go out as ``problem``, or None when it can."""
    answered = f"answered {problem.code} with"
    if not isinstance(response, Response):
        return f"{answered} {type(response).__name__}, not a Starlette Response"
    if not isinstance(getattr(response, "body", None), bytes | memoryview):
        return (
            f"{answered} a {type(response).__name__}, whose body is not in memory (return a Response, a JSONResponse)"
        )
    if response.status_code != problem.status:
        return f"{answered} status {response.status_code}, not {problem.status} (give it status_code=problem.status)"
    if response.background is not None:
        return f"{answered} a response with a background task, which the middleware does not run"
    return None


async def _send(send: Send, problem: Problem, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    """``problem`` with ``headers`` (its content type) and ``body``, in whichever envelope they are."""
    headers = [*headers, (b"content-length", str(len(body)).encode()), *problem.headers()]
    await send({"type": "http.response.start", "status": problem.status, "headers": headers})
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


def key_reused(status: int = 422, changes: Changes | None = None) -> Problem:
    """``status``: the route's ``reused_key_status`` (422, the IETF draft's; 409; or 400, Stripe's). ``changes``: what
    differs from the first request with the key (``explain_mismatch``), said in the detail and in the ``changed``
    member; without them the detail names the parts that may differ."""
    if changes is None:
        what = " (method, path, query or body)."
    else:
        what = f": {changes.words()} from the first request with this key."
    return Problem(
        status,
        ProblemCode.KEY_REUSED,
        "Idempotency-Key already used",
        f"This Idempotency-Key was already used with a different request{what} Use a new key for a new request.",
        changed=None if changes is None else changes.member(),
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


def step_not_resumable(step: str) -> Problem:
    """A retry that found an unrepeatable outside step begun by an earlier attempt, its outcome unknown."""
    return Problem(
        409,
        ProblemCode.STEP_NOT_RESUMABLE,
        "Request cannot be resumed",
        f"An earlier attempt of the request with this Idempotency-Key began a step that cannot be repeated ({step}) "
        "and stopped before its outcome was recorded. It was not run again, nor skipped: the operation needs to be "
        "finished by the service's operators. Retrying with the same key gives this answer again.",
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


def answer_to(claim: Claim, retry_after: int, policy: Policy, parts: RequestParts | None = None) -> Refusal:
    """The refusal of a claim that is not the request's, and that cannot be replayed: a different request (422, or
    the route's ``reused_key_status``; it says what differs where the request has ``parts`` to compare with the
    record's), one still running (409), one completed whose response was not stored in full (409)."""
    if claim.outcome is ClaimOutcome.MISMATCH:
        return key_reused(policy.reused_key_status, explain(parts, claim.parts)), Outcome.KEY_REUSED
    if claim.outcome is ClaimOutcome.IN_PROGRESS:
        return in_progress(retry_after), Outcome.IN_PROGRESS
    response = claim.response
    assert response is not None  # COMPLETED, but not stored in full (over the cap, or cut short)
    refusal = response_not_replayable(response.status, response.body_size, policy.max_response_bytes)
    return refusal, Outcome.NOT_REPLAYABLE


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
