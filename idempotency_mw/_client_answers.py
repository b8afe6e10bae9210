"""What the server's answers mean to the retrying client (``client.py``): which are worth another attempt, and after
how long (``Retry-After``); what a call ends with, a result or :class:`RetriesExhausted`; and a key's status, as the
app's ``key_status_route`` answers it."""

from __future__ import annotations

import email.utils
import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx

from idempotency_mw._wire import PROBLEM_HEADER, ProblemCode

RETRY_STATUSES = frozenset({408, 425, 429})  # plus every 5xx, and 409 "in progress"
_DELTA_SECONDS = re.compile(r"[0-9]+")
_CODES = frozenset(code.value for code in ProblemCode)


@dataclass(frozen=True, slots=True)
class IdempotentResult:
    """The answer to one logical call, and how it was obtained.

    ``key`` is the ``Idempotency-Key`` every attempt carried (None for requests sent without one), ``attempts``
    the number of HTTP attempts (1 means no retry), ``replayed`` whether the server answered from its record of an
    earlier attempt rather than by running the operation now. ``outcomes`` has one entry per attempt: the status
    code, or the name of the httpx exception that ended it. ``problem_code`` is the stable code of an error answer
    (see :func:`problem_code`), whatever its envelope. ``asked`` has one per question to the key's status route
    that the client asked instead of resending (``AskFirst``): the state it answered, or its status code when it
    answered none, or the name of the httpx exception that ended it.
    """

    response: httpx.Response
    key: str | None
    attempts: int
    replayed: bool
    outcomes: tuple[int | str, ...] = ()
    asked: tuple[int | str, ...] = ()

    @property
    def status_code(self) -> int:
        return self.response.status_code

    @property
    def headers(self) -> httpx.Headers:
        return self.response.headers

    @property
    def content(self) -> bytes:
        return self.response.content

    @property
    def text(self) -> str:
        return self.response.text

    def json(self, **kwargs: Any) -> Any:
        return self.response.json(**kwargs)

    @property
    def problem_code(self) -> str | None:
        return problem_code(self.response)


class RetriesExhausted(Exception):
    """The call did not get a final answer within its attempts or its deadline.

    The operation may or may not have taken effect. Try it again later with ``idempotency_key=err.key``: the
    server then either runs it (it never did) or replays the answer it recorded (it did). Exactly one of
    ``last_response`` and ``last_error`` is set: the outcome of the final attempt. ``reason`` is ``"attempts"`` or
    ``"deadline"``.
    """

    def __init__(
        self,
        message: str,
        *,
        key: str | None,
        attempts: int,
        last_response: httpx.Response | None,
        last_error: Exception | None,
        reason: str,
        outcomes: tuple[int | str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.key = key
        self.attempts = attempts
        self.last_response = last_response
        self.last_error = last_error
        self.reason = reason
        self.outcomes = outcomes


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` value: delay-seconds or an HTTP-date (RFC 9110 §10.2.3).

    None when absent or unreadable; a date in the past gives 0.
    """
    if value is None:
        return None
    value = value.strip()
    if _DELTA_SECONDS.fullmatch(value):
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):  # OverflowError: a zone offset of absurd size
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def should_retry(response: httpx.Response) -> bool:
    """Whether a response means "try again with the same key" rather than a final answer."""
    status = response.status_code
    if status in RETRY_STATUSES or 500 <= status <= 599:
        return True
    if status == 409:
        told = str(response.headers.get(PROBLEM_HEADER, "")).strip()
        if told in _CODES:  # the middleware's own answer, in whatever envelope: its code decides
            return told == ProblemCode.IN_PROGRESS
        return "retry-after" in response.headers or problem_code(response) == ProblemCode.IN_PROGRESS
    return False


def problem_code(response: httpx.Response) -> str | None:
    """The stable code of an error answer (status 400 and up), or None: the ``Idempotency-Problem`` header the
    middleware sends with each of its own answers, whatever their envelope; else (older servers, other APIs) the
    ``code`` of an RFC 9457 problem body, or of a Stripe-style ``{"error": {...}}`` envelope."""
    if response.status_code < 400:
        return None
    told = response.headers.get(PROBLEM_HEADER)
    if told is not None:
        return str(told).strip()
    if "json" not in response.headers.get("content-type", ""):
        return None
    try:
        body = response.json()
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    error = body.get("error")
    code = body.get("code", error.get("code") if isinstance(error, dict) else None)
    return code if isinstance(code, str) else None


STATES = frozenset({"absent", "in_progress", "completed"})


@dataclass(frozen=True, slots=True)
class KeyStatus:
    """A key's status for the caller's credentials, as the app's ``key_status_route`` answers it.

    ``state`` is ``absent`` (never seen, released after a failure, expired, or another tenant's), ``in_progress``,
    or ``completed``, with ``status``, the status it answered; ``first_seen`` and ``expires`` (UTC) while there is
    a record.
    """

    key: str
    state: str
    status: int | None
    first_seen: datetime | None
    expires: datetime | None

    @classmethod
    def of(cls, response: httpx.Response) -> KeyStatus:
        """The status in the route's answer; ValueError when the answer is not one."""
        try:
            body = response.json()
            key, state, status = body["key"], body["state"], body["status"]
            first_seen, expires = (_instant(body[name]) for name in ("first_seen", "expires"))
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"not a key status: {response.text[:200]!r}") from error
        if not isinstance(key, str) or state not in STATES or not (status is None or type(status) is int):
            raise ValueError(f"not a key status: {response.text[:200]!r}")
        return cls(key, state, status, first_seen, expires)


def _instant(value: object) -> datetime | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"not a time: {value!r}")
    return datetime.fromisoformat(value)
