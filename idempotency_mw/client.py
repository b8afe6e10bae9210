"""An httpx client that retries a write with the same ``Idempotency-Key`` until it gets a real answer.

Every retried call is at-least-once: after a timeout the client cannot tell "request lost" from "response lost".
Retrying is only safe if every attempt of one logical call carries the same key, so the server can run the effect
once and replay its answer to the others. This module makes that the only possible behaviour: the key is chosen
once per call, set once on one :class:`httpx.Request`, and that same request object is what every attempt sends.

```python
async with AsyncIdempotentClient(base_url="http://127.0.0.1:8000") as client:
    result = await client.post("/v1/payment_intents", data={"amount": "1000", "currency": "eur"})
    result.status_code, result.replayed, result.attempts, result.key
```
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any
from urllib.parse import quote

try:
    import httpx
except ImportError as error:  # httpx is an optional dependency of the package
    raise ImportError("idempotency_mw.client needs httpx: pip install 'idempotency-mw[client]'") from error

from idempotency_mw._client_answers import IdempotentResult, KeyStatus, RetriesExhausted
from idempotency_mw._client_answers import parse_retry_after as parse_retry_after  # this module's, before
from idempotency_mw._client_answers import problem_code as problem_code  # this module's, before
from idempotency_mw._client_answers import should_retry as should_retry  # this module's, before
from idempotency_mw._keys import InvalidKey, parse_key
from idempotency_mw._wire import KEY_HEADER, REPLAYED_HEADER, ProblemCode

__all__ = [
    "AskFirst",
    "AsyncIdempotentClient",
    "IdempotentClient",
    "IdempotentResult",
    "KeyStatus",
    "RetriesExhausted",
    "Retry",
]

logger = logging.getLogger("idempotency_mw.client")


KEYED_METHODS = frozenset({"POST", "PATCH"})  # get a fresh key unless the caller gives one
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})  # never carry a key: they change nothing
IDEMPOTENT_METHODS = SAFE_METHODS | {"PUT", "DELETE"}  # RFC 9110 §9.2.2: retried even without a key
RETRY_ERRORS = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)  # the request never left: nothing ran
STATUS_PATH = "/idempotency-keys/{key}"  # key_status_route's default
# What a question about a key does not carry of the request it asks about.
NOT_ASKED = frozenset(
    {"content-type", "content-length", "transfer-encoding", "content-encoding", "host", "idempotency-key"}
)

# An attempt left with less time than this before the deadline would only time out (timers may also fire a
# millisecond early), so it is not started.
_MIN_ATTEMPT_SECONDS = 0.01


@dataclass(frozen=True, slots=True)
class Retry:
    """How hard one logical call tries: at most ``attempts`` HTTP attempts, none started after ``deadline``.

    Between attempts the client waits a random time between 0 and ``backoff * 2**(n-1)`` (full jitter, so many
    clients that failed together do not retry together), never more than ``max_backoff``. A ``Retry-After`` from
    the server raises the wait to what it asked for, however long; a wait that would pass the deadline ends the
    call instead. Durations are in seconds.

    The defaults outlast the middleware's default lease (30 s): after a server crash its key stays "in progress"
    for up to one lease, and each 409 asks for a 1 s wait, so a call keeps retrying (at most once a second) until
    the key is free and the operation runs or replays.
    """

    attempts: int = 60
    deadline: float = 60.0
    backoff: float = 0.1
    max_backoff: float = 5.0

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"Retry.attempts must be a whole number >= 1, got {self.attempts!r}")
        for name in ("deadline", "backoff", "max_backoff"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value) or value < 0:
                raise ValueError(f"Retry.{name} must be a number of seconds >= 0, got {value!r}")
        if self.deadline <= 0:
            raise ValueError(f"Retry.deadline must be positive, got {self.deadline!r}")
        if self.max_backoff < self.backoff:
            raise ValueError(f"Retry.max_backoff ({self.max_backoff}) must be >= Retry.backoff ({self.backoff})")

    def delay(
        self, failures: int, retry_after: float | None = None, *, rand: Callable[[], float] | None = None
    ) -> float:
        """Seconds to wait after the ``failures``-th failed attempt (1 for the first), before the next one.

        ``rand`` draws the jitter, a number in [0, 1); ``random.random`` by default.
        """
        if failures < 1:
            raise ValueError("failures counts failed attempts and starts at 1")
        ceiling = min(self.max_backoff, self.backoff * 2.0 ** min(failures - 1, 60))
        wait = (random.random() if rand is None else rand()) * ceiling
        if retry_after is not None:
            wait = max(wait, retry_after)  # the server knows when it can answer; the deadline still applies
        return wait


@dataclass(frozen=True, slots=True)
class AskFirst:
    """Ask the server whether a request took effect before resending a body of ``min_body`` bytes or more.

    After an attempt whose outcome the client cannot know (no answer came: a timeout, a lost connection, after the
    request was sent) or that is still running (409 in progress), the client asks the app's status route
    (``key_status_route``, at the client's ``status_path``) instead of resending: while the request runs it waits
    and asks again; once it completed, or never took effect, it resends once (to get the replay, or to run it).
    A 404 from the status path means the app has no such route: the client resends as it would without, and asks
    no more. Questions count against ``Retry.attempts`` and the deadline.
    """

    min_body: int = 64 * 1024

    def __post_init__(self) -> None:
        if isinstance(self.min_body, bool) or not isinstance(self.min_body, int) or self.min_body < 0:
            raise ValueError(f"AskFirst.min_body must be a whole number of bytes >= 0, got {self.min_body!r}")


def validate_key(key: str) -> str:
    """Return a caller's key unchanged if the server reads it back as exactly that key; else raise ValueError.

    The server's own parser (``parse_key`` in ``idempotency_mw/_keys.py``) decides, so the two can never disagree: 1
    to 255 visible ASCII characters, no comma (proxies join repeated header fields with one, so ``a,b`` could be two
    keys), and no leading double quote (the server would read ``"abc"`` as the quoted string ``abc``).
    """
    if not isinstance(key, str):
        raise TypeError(f"idempotency_key must be a str, not {type(key).__name__}")
    try:
        parsed = parse_key(key.encode("ascii"))
    except UnicodeEncodeError:
        raise ValueError("an idempotency key is visible ASCII only: no non-ASCII characters") from None
    except InvalidKey as error:
        raise ValueError(f"invalid idempotency key {key!r}: {error}") from None
    if parsed != key:
        raise ValueError(
            f"invalid idempotency key {key!r}: the server would read it as {parsed!r} (a key must not start with a "
            "double quote, nor start or end with a space or tab)"
        )
    return key


def _key_path(path: str, key: str) -> str:
    """The path of ``key``'s status: ``path`` with the key in place of ``{key}``, percent-encoded whole (a ``/`` in a
    key included), as ``key_status_route`` reads it back."""
    encoded = quote(key, safe="")
    if encoded in (".", ".."):  # a dot segment, which URL resolution removes: the path above the route's
        encoded = encoded.replace(".", "%2E")
    return path.replace("{key}", encoded)


def _check_status_path(path: str) -> str:
    if not isinstance(path, str) or "{key}" not in path:
        raise ValueError(f"status_path must be a path with {{key}} in it (key_status_route's), got {path!r}")
    return path


def _key_status(answer: httpx.Response) -> KeyStatus:
    """The status route's answer read: HTTPStatusError for anything but a 200 (a 201 or 204 from a catch-all route
    is no status either), ValueError for a 200 that is not a status."""
    if answer.status_code != 200:
        raise httpx.HTTPStatusError(
            f"{answer.status_code} from {answer.request.url}, not a key status", request=answer.request, response=answer
        )
    return KeyStatus.of(answer)


def _request_of(error: httpx.TransportError) -> httpx.Request | None:
    """The request ``error`` was raised for: the call's own, or a later hop's (httpx builds one per redirect)."""
    try:
        return error.request
    except RuntimeError:  # none attached: nothing says which
        return None


def _check_headers(headers: Mapping[str, str] | None, where: str) -> None:
    if headers is not None and KEY_HEADER.lower() in httpx.Headers(headers):
        raise ValueError(
            f"{where} set an {KEY_HEADER} header; pass idempotency_key=... instead, so the client knows the key "
            "and keeps it across retries"
        )


class _Call:
    """One logical call's retry bookkeeping, shared by the sync and async clients (which only sleep differently).

    It owns the request, built once and never rebuilt, and the key fixed before the first attempt.
    """

    def __init__(self, retry: Retry, request: httpx.Request, key: str | None, *, asking: bool = False) -> None:
        self.retry = retry
        self.request = request
        self.key = key
        method = request.method.upper()
        self.retryable = key is not None or method in IDEMPOTENT_METHODS
        self.outcomes: list[int | str] = []
        self.deadline_at = time.monotonic() + retry.deadline
        self.timeouts: dict[str, float | None] = dict(request.extensions.get("timeout") or {})
        self.asking = asking  # asks the key's status before resending (AskFirst), while it can be had
        self.asked: list[int | str] = []  # the status route's answers
        self._unknown = False  # the last attempt may have run, or is running: ask before resending
        self._begun = 0  # attempts sent, or on their way
        self._never_left = 0  # of those, the ones known never to have reached the server (NOT_SENT)
        self._last: tuple[httpx.Response | None, Exception | None] = (None, None)  # the last attempt's outcome

    @property
    def attempts(self) -> int:
        return len(self.outcomes)

    def begin_attempt(self, request: httpx.Request | None = None) -> None:
        """Cap this attempt's timeouts (or a question's, ``request``) by what is left of the deadline, so that none
        outlives it."""
        if request is None:
            self._begun += 1
        remaining = max(self.deadline_at - time.monotonic(), _MIN_ATTEMPT_SECONDS)
        if self.timeouts and math.isfinite(remaining):
            (request or self.request).extensions["timeout"] = {
                name: remaining if value is None else min(value, remaining) for name, value in self.timeouts.items()
            }

    def answered(self, response: httpx.Response) -> float | None:
        """Seconds to wait before retrying, or None when ``response`` is the final answer."""
        self._check_key()
        self.outcomes.append(response.status_code)
        self._last = (response, None)
        if not (self.retryable and should_retry(response)):
            return None
        self._unknown = response.status_code == 409 and problem_code(response) == ProblemCode.IN_PROGRESS
        retry_after = parse_retry_after(response.headers.get("retry-after"))
        return self._next_delay(retry_after, response, None)

    def failed(self, error: httpx.TransportError) -> float | None:
        """Seconds to wait before retrying, or None when ``error`` must propagate as it is."""
        self._check_key()
        self.outcomes.append(type(error).__name__)
        self._last = (None, error)
        never_left = isinstance(error, NOT_SENT) and _request_of(error) is self.request  # not a redirect's hop
        if never_left:
            self._never_left += 1
        if not (self.retryable and isinstance(error, RETRY_ERRORS)):
            return None
        self._unknown = not never_left
        return self._next_delay(None, None, error)

    def asks(self) -> bool:
        """Whether to ask the key's status now rather than resend: the last attempt may have run, or is running."""
        return self.asking and self._unknown

    def question(self, http: httpx.Client | httpx.AsyncClient, path: str) -> httpx.Request:
        """The question about this call's key: a GET of its status, with the request's credentials, not its body."""
        assert self.key is not None
        headers = [(name, value) for name, value in self.request.headers.multi_items() if name not in NOT_ASKED]
        asked = http.build_request("GET", _key_path(path, self.key), headers=headers)
        self.begin_attempt(asked)
        return asked

    def told(self, answer: httpx.Response | None, error: httpx.TransportError | None) -> float | None:
        """What the status route said (``answer``, or the ``error`` that ended the question): seconds to wait before
        asking again (in progress; or no answer for now: a 5xx, a lost connection), or None to resend now
        (completed: the resend gets the replay; absent: nothing took effect; any other answer: no status to be had,
        and no more questions)."""
        if answer is None or should_retry(answer):
            self.asked.append(type(error).__name__ if answer is None else answer.status_code)
            return self._next_delay(None if answer is None else parse_retry_after(answer.headers.get("retry-after")))
        try:
            state = KeyStatus.of(answer).state if answer.status_code == 200 else None
        except ValueError:
            state = None
        self.asked.append(answer.status_code if state is None else state)
        if state == "in_progress":
            return self._next_delay(parse_retry_after(answer.headers.get("retry-after")))
        if state is None:  # 404: no status route here; or another refusal: no status to be had in this call
            self.asking = False
        self._unknown = False
        self._check_budget(0.0)  # the resend is a request like any other
        return None

    def result(self, response: httpx.Response) -> IdempotentResult:
        replayed = response.headers.get(REPLAYED_HEADER, "").strip().lower() == "true"
        return IdempotentResult(response, self.key, self.attempts, replayed, tuple(self.outcomes), tuple(self.asked))

    def _next_delay(
        self, retry_after: float | None, response: httpx.Response | None = None, error: Exception | None = None
    ) -> float:
        """The wait before the next request (an attempt or a question), or RetriesExhausted, naming the last
        attempt's outcome."""
        delay = self.retry.delay(self.attempts + len(self.asked), retry_after)
        self._check_budget(delay, response, error)
        logger.debug(
            "retrying %s %s after attempt %d (%s) in %.3fs",
            self.request.method,
            self.request.url.path,
            self.attempts,
            self.outcomes[-1],
            delay,
        )
        return delay

    def _check_budget(
        self, delay: float, response: httpx.Response | None = None, error: Exception | None = None
    ) -> None:
        """RetriesExhausted, naming the last attempt's outcome, unless one more request may start after ``delay``:
        one under ``Retry.attempts`` (attempts and questions alike), and with time for it before the deadline."""
        if response is None and error is None:
            response, error = self._last
        if self.attempts + len(self.asked) >= self.retry.attempts:
            raise self._exhausted("attempts", response, error)
        if time.monotonic() + delay + _MIN_ATTEMPT_SECONDS >= self.deadline_at:
            raise self._exhausted("deadline", response, error)

    def _exhausted(self, reason: str, response: httpx.Response | None, error: Exception | None) -> RetriesExhausted:
        why = "no attempts left" if reason == "attempts" else f"the {self.retry.deadline}s deadline would pass"
        resume = f"; retry later with idempotency_key={self.key!r}" if self.key is not None else ""
        exhausted = RetriesExhausted(
            f"{self.request.method} {self.request.url}: gave up after {self.attempts} attempt(s), {why} "
            f"(last: {self.outcomes[-1]}){resume}",
            key=self.key,
            attempts=self.attempts,
            last_response=response,
            last_error=error,
            reason=reason,
            outcomes=tuple(self.outcomes),
        )
        exhausted.__cause__ = error
        return exhausted

    def name_key(self, error: BaseException) -> None:
        """Note this call's key on an error the client raises as it is (a cancellation too): once an attempt may
        have gone out, it may have taken effect, and a caller whose key the client minted would otherwise resume
        under a new one. When every attempt is known never to have left, the note says so: nothing is to be found
        under the key. RetriesExhausted carries its key already."""
        if self.key is None or isinstance(error, RetriesExhausted):
            return
        if self._begun > self._never_left:
            told = f"an attempt may have taken effect: resume with idempotency_key={self.key!r}, not a new key"
        else:
            told = "no attempt reached the server: nothing took effect under it"
        error.add_note(f"{KEY_HEADER} of this call: {self.key} ({told})")

    def _check_key(self) -> None:
        # The request object is the only thing attempts send; this catches an event hook or auth flow that
        # rewrote its header, which would turn retries into new operations.
        if self.request.headers.get(KEY_HEADER) != self.key:
            raise RuntimeError(f"the {KEY_HEADER} header was changed between attempts; refusing to retry")


class _Base:
    """What both clients share: turning the caller's arguments into one resendable, keyed request, and whether its
    call asks the key's status before resending."""

    retry: Retry
    ask_first: AskFirst | None
    status_path: str
    _no_status_route = False  # a question was answered 404: the app has no status route, so none is asked again

    def _asks_first(self, request: httpx.Request, key: str | None) -> bool:
        ask = self.ask_first
        return (
            ask is not None and key is not None and not self._no_status_route and len(request.content) >= ask.min_body
        )

    def _heard(self, answer: httpx.Response | None) -> None:
        if answer is not None and answer.status_code == 404:
            self._no_status_route = True

    @staticmethod
    def _key_for(method: str, idempotency_key: str | None) -> str | None:
        """The one key of a logical call, chosen before its first attempt and never again."""
        if idempotency_key is not None:
            if method in SAFE_METHODS:
                raise ValueError(f"{method} changes nothing, so it carries no {KEY_HEADER}")
            return validate_key(idempotency_key)
        return str(uuid.uuid4()) if method in KEYED_METHODS else None

    @staticmethod
    def _attach_key(request: httpx.Request, key: str | None) -> None:
        if KEY_HEADER.lower() in request.headers:
            raise ValueError(
                f"the request already has an {KEY_HEADER} header (from headers=... or the client's headers); "
                "pass idempotency_key=... instead, so the client knows the key and keeps it across retries"
            )
        if key is not None:
            request.headers[KEY_HEADER] = key

    @staticmethod
    def _check_resendable(request: httpx.Request) -> None:
        if not isinstance(request.stream, httpx.ByteStream):
            raise ValueError(
                "a streaming request body (an iterator or generator as content) can be sent only once, so it "
                "cannot be retried; pass bytes, str, json=, data= or files= instead"
            )


class IdempotentClient(_Base):
    """A synchronous client (``httpx.Client``) that retries each call with one ``Idempotency-Key``.

    Keyword arguments other than those listed go to ``httpx.Client``. ``headers`` may not carry an
    ``Idempotency-Key``: one fixed key for every call would make every call after the first a replay.
    """

    def __init__(
        self,
        base_url: str | httpx.URL = "",
        *,
        retry: Retry | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | httpx.Timeout | None = 5.0,
        transport: httpx.BaseTransport | None = None,
        ask_first: AskFirst | None = None,
        status_path: str = STATUS_PATH,
        **kwargs: Any,
    ) -> None:
        _check_headers(headers, "the client's headers")
        self.retry = retry if retry is not None else Retry()
        self.ask_first = ask_first
        self.status_path = _check_status_path(status_path)
        self._http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout, transport=transport, **kwargs)

    def request(
        self,
        method: str,
        url: str | httpx.URL,
        *,
        idempotency_key: str | None = None,
        auth: Any = httpx.USE_CLIENT_DEFAULT,
        follow_redirects: Any = httpx.USE_CLIENT_DEFAULT,
        **kwargs: Any,
    ) -> IdempotentResult:
        """Send one logical call, retrying transient failures with the same key; see :class:`Retry`.

        Returns the first final answer (any status that is not worth retrying, 400 and 422 included); raises
        :class:`RetriesExhausted` when attempts or the deadline run out. ``kwargs`` go to ``httpx.Client.request``.
        """
        method = method.upper()
        key = self._key_for(method, idempotency_key)
        request = self._http.build_request(method, url, **kwargs)
        if kwargs.get("files"):
            request.read()  # buffered once, with one multipart boundary, so every attempt sends the same bytes
        self._check_resendable(request)
        self._attach_key(request, key)
        call = _Call(self.retry, request, key, asking=self._asks_first(request, key))
        try:
            for _ in range(self.retry.attempts):
                call.begin_attempt()
                try:
                    response = self._http.send(request, auth=auth, follow_redirects=follow_redirects)
                except httpx.TransportError as error:
                    delay = call.failed(error)
                    if delay is None:
                        raise
                else:
                    delay = call.answered(response)
                    if delay is None:
                        return call.result(response)
                time.sleep(delay)
                while call.asks():  # AskFirst: the key's status, rather than the body again
                    try:
                        answer, lost = self._http.send(call.question(self._http, self.status_path), auth=auth), None
                    except httpx.TransportError as failure:
                        answer, lost = None, failure
                    self._heard(answer)
                    if (delay := call.told(answer, lost)) is None:
                        break
                    time.sleep(delay)
        except BaseException as error:  # an attempt that may have run: whoever reads this needs the key
            call.name_key(error)
            raise
        raise AssertionError("unreachable: the last attempt either returns or raises RetriesExhausted")

    def key_status(self, key: str, **kwargs: Any) -> KeyStatus:
        """The status of ``key`` for this client's credentials, from the app's ``key_status_route`` at
        ``status_path``: one GET, not retried. Raises ``httpx.HTTPStatusError`` for any answer but 200 (404: the app
        has no such route) and ValueError for one that is not a status. ``kwargs`` go to ``httpx.Client.get``."""
        return _key_status(self._http.get(_key_path(self.status_path, validate_key(key)), **kwargs))

    def get(self, url: str | httpx.URL, **kwargs: Any) -> IdempotentResult:
        return self.request("GET", url, **kwargs)

    def post(self, url: str | httpx.URL, **kwargs: Any) -> IdempotentResult:
        return self.request("POST", url, **kwargs)

    def patch(self, url: str | httpx.URL, **kwargs: Any) -> IdempotentResult:
        return self.request("PATCH", url, **kwargs)

    def put(self, url: str | httpx.URL, **kwargs: Any) -> IdempotentResult:
        return self.request("PUT", url, **kwargs)

    def delete(self, url: str | httpx.URL, **kwargs: Any) -> IdempotentResult:
        return self.request("DELETE", url, **kwargs)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> IdempotentClient:
        self._http.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._http.__exit__(exc_type, exc, traceback)


class AsyncIdempotentClient(_Base):
    """The asynchronous twin of :class:`IdempotentClient`, on ``httpx.AsyncClient``."""

    def __init__(
        self,
        base_url: str | httpx.URL = "",
        *,
        retry: Retry | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | httpx.Timeout | None = 5.0,
        transport: httpx.AsyncBaseTransport | None = None,
        ask_first: AskFirst | None = None,
        status_path: str = STATUS_PATH,
        **kwargs: Any,
    ) -> None:
        _check_headers(headers, "the client's headers")
        self.retry = retry if retry is not None else Retry()
        self.ask_first = ask_first
        self.status_path = _check_status_path(status_path)
        self._http = httpx.AsyncClient(
            base_url=base_url, headers=headers, timeout=timeout, transport=transport, **kwargs
        )

    async def request(
        self,
        method: str,
        url: str | httpx.URL,
        *,
        idempotency_key: str | None = None,
        auth: Any = httpx.USE_CLIENT_DEFAULT,
        follow_redirects: Any = httpx.USE_CLIENT_DEFAULT,
        **kwargs: Any,
    ) -> IdempotentResult:
        """Send one logical call, retrying transient failures with the same key; see :class:`Retry`.

        Returns the first final answer (any status that is not worth retrying, 400 and 422 included); raises
        :class:`RetriesExhausted` when attempts or the deadline run out. ``kwargs`` go to
        ``httpx.AsyncClient.request``.
        """
        method = method.upper()
        key = self._key_for(method, idempotency_key)
        request = self._http.build_request(method, url, **kwargs)
        if kwargs.get("files"):
            await request.aread()  # buffered once, with one multipart boundary, so every attempt sends the same bytes
        self._check_resendable(request)
        self._attach_key(request, key)
        call = _Call(self.retry, request, key, asking=self._asks_first(request, key))
        try:
            for _ in range(self.retry.attempts):
                call.begin_attempt()
                try:
                    response = await self._http.send(request, auth=auth, follow_redirects=follow_redirects)
                except httpx.TransportError as error:
                    delay = call.failed(error)
                    if delay is None:
                        raise
                else:
                    delay = call.answered(response)
                    if delay is None:
                        return call.result(response)
                await asyncio.sleep(delay)
                while call.asks():  # AskFirst: the key's status, rather than the body again
                    try:
                        answer, lost = (
                            await self._http.send(call.question(self._http, self.status_path), auth=auth),
                            None,
                        )
                    except httpx.TransportError as failure:
                        answer, lost = None, failure
                    self._heard(answer)
                    if (delay := call.told(answer, lost)) is None:
                        break
                    await asyncio.sleep(delay)
        except BaseException as error:  # an attempt that may have run: whoever reads this needs the key
            call.name_key(error)
            raise
        raise AssertionError("unreachable: the last attempt either returns or raises RetriesExhausted")

    async def key_status(self, key: str, **kwargs: Any) -> KeyStatus:
        """The status of ``key``: :meth:`IdempotentClient.key_status`, asynchronously."""
        return _key_status(await self._http.get(_key_path(self.status_path, validate_key(key)), **kwargs))

    async def get(self, url: str | httpx.URL, **kwargs: Any) -> IdempotentResult:
        return await self.request("GET", url, **kwargs)

    async def post(self, url: str | httpx.URL, **kwargs: Any) -> IdempotentResult:
        return await self.request("POST", url, **kwargs)

    async def patch(self, url: str | httpx.URL, **kwargs: Any) -> IdempotentResult:
        return await self.request("PATCH", url, **kwargs)

    async def put(self, url: str | httpx.URL, **kwargs: Any) -> IdempotentResult:
        return await self.request("PUT", url, **kwargs)

    async def delete(self, url: str | httpx.URL, **kwargs: Any) -> IdempotentResult:
        return await self.request("DELETE", url, **kwargs)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncIdempotentClient:
        await self._http.__aenter__()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await self._http.__aexit__(exc_type, exc, traceback)
