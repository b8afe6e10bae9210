"""Plain mode: the handler's response goes out as it comes, copied on the way (``_channels.py``), and the claim
settles as its final body message passes.

That is before the message reaches the client, and before anything the app runs after its response (background
tasks): so a retry that arrives as soon as the client has its answer finds it recorded, and a background task that
fails changes nothing. A response that never finished (an error, a cancelled request, a stream cut short) is settled
all the same. Transactional mode has its own run, which holds the response until the commit (``_transactional.py``).
"""

from __future__ import annotations

import asyncio
import enum

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from idempotency_mw._channels import Added, ResponseRecorder, expiry
from idempotency_mw._claim import OwnedClaim, outlasting, start_eagerly
from idempotency_mw._context import NOT_EXECUTED_KEY
from idempotency_mw._events import Outcome
from idempotency_mw._policy import Policy


class State(enum.IntEnum):
    """Where a plain run is, in the only order its states come: each moves on to the next."""

    PASSING = 1  # no claim yet (the app tells its tenant from inside), or none (failing open): sent as it is
    RUNNING = 2  # the claim is the request's: the response is copied on its way out
    SETTLING = 3  # the answer is being recorded, or the key released
    SETTLED = 4  # ``outcome`` says how


class PlainRun:
    """One request's handler in plain mode. Until :meth:`claimed` (the app may tell its tenant from inside, after
    answering on its own: its 401), or for good when it fails open, what the app sends passes untouched and nothing
    settles. ``outcome`` is how the
    claim settled and the answer's status, known before the final body message goes on; ``settling`` is the
    settlement, which outlasts a cancellation of the request."""

    def __init__(self, policy: Policy, send: Send) -> None:
        self.state = State.PASSING
        self.recorder = ResponseRecorder(send, max_body=policy.max_response_bytes)
        self.outcome: tuple[Outcome, int | None] | None = None
        self.settling: asyncio.Future[Outcome] | None = None
        self._policy = policy
        self._send_on = send
        self._owned: OwnedClaim | None = None
        self._scope: Scope | None = None

    def _to(self, state: State) -> None:
        if state != self.state + 1:
            raise RuntimeError(f"a plain run cannot go from {self.state.name} to {state.name}")
        self.state = state

    def claimed(self, owned: OwnedClaim) -> None:
        """The key is this request's (``owned``): its answer settles from now on."""
        self._owned = owned
        self._to(State.RUNNING)

    async def run(self, app: ASGIApp, scope: Scope, receive: Receive) -> None:
        """Run ``app``, and settle however it ends; a request cancelled meanwhile (a client that hung up, a server
        shutting down) does not wait for its settlement, which goes on in a task of its own (``settling``)."""
        self._scope = scope
        try:
            await app(scope, receive, self._send)
        except asyncio.CancelledError:
            if self.state is State.RUNNING:
                self._start_settling()
            raise
        except BaseException:
            await self._settle()
            raise
        await self._settle()

    async def _send(self, message: Message) -> None:
        """The handler's ``send``: copy each message, and settle before the final body message goes on."""
        if self.state is State.PASSING:
            if message["type"] == "http.response.start":
                self.recorder.status = message["status"]  # recorded nowhere: for the request's event
            return await self._send_on(message)
        recorder = self.recorder
        going, decide = recorder.record(message)
        if decide:
            await self._settle()
        if going is not None:
            await recorder.forward(going, () if recorder.started else self._expiry())

    def _expiry(self) -> Added:
        """The record's expiry, for the response start to carry, when the answer is recorded: settled as completed
        (a response whose first body message is its last), or, streamed, with a status that will be recorded."""
        owned, outcome = self._owned, self.outcome
        if owned is None or self._policy.observe:  # observing adds nothing to what the app sends
            return ()
        if outcome is not None:  # settled
            return expiry(owned.expires_at) if outcome[0] is Outcome.EXECUTED else ()
        state = self._scope.get("state", {}) if self._scope is not None else {}
        if self.recorder.status in self._policy.recorded and not state.get(NOT_EXECUTED_KEY):
            return expiry(owned.expires_at)
        return ()

    async def _settle(self) -> None:
        """Settle once: in a task of its own, waited for through ``outlasting``, so that a request cancelled while
        its outcome is being written still finishes writing it (or the key would stay in progress and the handler
        run again once the lease lapsed). A final answer that started going out is recorded even when it was cut
        short: its effect has happened, so the retry must not run it again; such a record has no body, and a retry
        is told that the response cannot be replayed."""
        if self.state is State.RUNNING:
            self._start_settling()
        elif self.state is not State.SETTLING:
            return
        assert self.settling is not None
        outcome = await outlasting(self.settling)
        if self.state is State.SETTLING:
            self._to(State.SETTLED)
            self.outcome = (outcome, self.recorder.status)

    def _start_settling(self) -> None:
        self._to(State.SETTLING)
        self.settling = start_eagerly(self._record_or_release(), "idempotency settlement")

    async def _record_or_release(self) -> Outcome:
        """Record a final answer; release the key for anything else."""
        owned, status = self._owned, self.recorder.status
        assert owned is not None
        state = self._scope.get("state", {}) if self._scope is not None else {}
        if status not in self._policy.recorded or state.get(NOT_EXECUTED_KEY):
            return await owned.release()
        return await owned.complete(self.recorder.stored_response())
