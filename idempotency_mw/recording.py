"""Plain mode: the handler's response goes out as it comes, copied on the way (``capture.py``), and the request
settles as its final body message passes.

That is before the message reaches the client, and before anything the app runs after its response (background
tasks): so a retry that arrives as soon as the client has its answer finds it recorded, and a background task that
fails changes nothing. A response that never finished (an error, a cancelled request, a stream cut short) is
settled all the same. Transactional mode has its own run, which holds the response until the commit
(``transaction.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from idempotency_mw.capture import ResponseRecorder
from idempotency_mw.eager import outlasting, start_eagerly
from idempotency_mw.events import Outcome


class PlainRun:
    """One request's handler in plain mode.

    ``settle(recorder)`` records the final answer or releases the key and returns the outcome; ``on_settled(outcome,
    status)`` reports it. Until :meth:`claimed` (the app may tell its tenant from inside, after answering on its own:
    its 401), what the app sends passes untouched and nothing settles.
    """

    def __init__(
        self,
        send: Send,
        *,
        max_body: int,
        settle: Callable[[ResponseRecorder], Coroutine[Any, Any, Outcome]],
        on_settled: Callable[[Outcome, int | None], None],
    ) -> None:
        self.recorder = ResponseRecorder(send, max_body=max_body)
        self.settling: asyncio.Future[Outcome] | None = None
        self._send_on = send
        self._settle_with = settle
        self._on_settled = on_settled
        self._claimed = False
        self._settled = False

    def claimed(self) -> None:
        """The key is this request's: its answer settles from now on."""
        self._claimed = True

    async def run(self, app: ASGIApp, scope: Scope, receive: Receive) -> None:
        """Run ``app``; a request cancelled meanwhile (a client that hung up, a server shutting down) does not wait for
        its settlement, which goes on in a task of its own."""
        try:
            await app(scope, receive, self._send)
        except asyncio.CancelledError:
            if self._claimed:
                self.start_settling()
            raise
        except BaseException:
            await self._settle()
            raise
        await self._settle()

    async def _send(self, message: Message) -> None:
        """The handler's ``send``: copy each message, and settle before the final body message goes on."""
        if not self._claimed:
            return await self._send_on(message)
        going, decide = self.recorder.record(message)
        if decide:
            await self._settle()
        if going is not None:
            await self.recorder.forward(going)

    async def _settle(self) -> None:
        """Settle once, and report the outcome before the final body goes out (while a server span still records).

        In a task of its own, waited for through ``outlasting``: a request cancelled while its outcome is being
        written still finishes writing it, or the key would stay in progress and the handler run again once the
        lease lapsed. A final answer that started going out is recorded even when it was cut short: its effect has
        happened, so the retry must not run it again; such a record has no body, and a retry is told that the
        response cannot be replayed."""
        if not self._claimed or self._settled:
            return
        outcome = await outlasting(self.start_settling())
        if not self._settled:
            self._settled = True
            self._on_settled(outcome, self.recorder.status)

    def start_settling(self) -> asyncio.Future[Outcome]:
        if self.settling is None:
            self.settling = start_eagerly(self._settle_with(self.recorder), "idempotency settlement")
        return self.settling


async def run_unprotected(
    app: ASGIApp, scope: Scope, receive: Receive, send: Send, on_settled: Callable[[Outcome, int | None], None]
) -> None:
    """Failing open (a route's ``fail_open``, the store down): the handler runs without a record; ``on_settled``
    hears of it however it ends."""
    status: int | None = None

    async def send_on(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        await send(message)

    try:
        await app(scope, receive, send_on)
    finally:
        on_settled(Outcome.UNPROTECTED, status)
