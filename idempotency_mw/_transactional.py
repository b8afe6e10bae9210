"""Transactional mode: the handler's writes and the idempotency record commit in one database transaction.

:class:`TransactionalRun` takes one connection for the request: the key is claimed on it (committed at once, so a
concurrent duplicate sees the claim), then the handler's transaction begins on it. The response is held, and when
its final body message arrives the record is written (fenced) and the transaction commits; only then does the
response go out. So a client never sees an effect that could still roll back, and a crash anywhere before the
commit leaves neither the effect nor its record. Background tasks run after the final body message: after the
commit, outside the transaction, and their failure changes nothing.

Only a response the handler returns commits its writes. A response the app made of an exception (an
``HTTPException``, or any exception its exception handlers answer) is sent while that exception is being handled:
the transaction rolls back, as it would for the same exception anywhere else, and a final answer is recorded on its
own, so that the retry gets the same answer.

A handler may run in steps (``_steps.py``, docs/design.md §10), each committed with a recovery point: the run that
lends them is :class:`~idempotency_mw._stepped.SteppedRun`, which never releases a record at a recovery point.

A run keeps one :class:`State`, moved only along the transitions of ``STEPS``, and ends in one of the last seven;
:meth:`TransactionalRun.run` returns it (or lets what the app raised go on, once settled), and the middleware
answers by it. When the
transaction did not commit, the handler's ``send`` raises :class:`NotCommitted`, so nothing that follows the
response in the app (a background task) runs for an effect that did not happen.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import sys
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from idempotency_mw._channels import ResponseRecorder, expiry
from idempotency_mw._claim import OwnedClaim, outlasting, start_eagerly
from idempotency_mw._context import NOT_EXECUTED_KEY
from idempotency_mw._events import Outcome
from idempotency_mw._policy import Policy
from idempotency_mw.store import (
    Claim,
    ClaimOutcome,
    StoreUnavailable,
    Transaction,
    TransactionalStore,
    TransactionEnded,
)


class State(enum.Enum):
    IDLE = "idle"  # no transaction yet (the claim waits for the app's tenant): a response passes untouched
    OPEN = "open"  # the handler runs in its transaction; its response is held
    SETTLING = "settling"  # its response is complete: the record is being written and the transaction committed
    COMMITTED = "committed"  # the effect and the record landed; the response goes out
    RECORDED = "recorded"  # an exception the app answered: its writes rolled back, its final answer recorded
    ROLLED_BACK = "rolled back"  # a transient answer, or a handler that failed or never finished: nothing landed
    FENCED_OUT = "fenced out"  # a newer claim owns the key: the record was refused, everything rolled back
    UNAVAILABLE = "unavailable"  # the database could not be reached to begin, write, commit or roll back
    REFUSED = "refused"  # the database refused the commit (a deferred constraint, a transaction left aborted)
    NOT_RESUMABLE = "not resumable"  # an unrepeatable step of an earlier attempt has no outcome: rolled back, 409

    # Hashed by identity, in C: Enum's own __hash__ is Python code, and every transition looks states up (17 calls
    # of it per transactional request).
    __hash__ = object.__hash__


ENDS = frozenset(
    {State.COMMITTED, State.RECORDED, State.ROLLED_BACK, State.FENCED_OUT, State.UNAVAILABLE, State.REFUSED,
     State.NOT_RESUMABLE}
)  # fmt: skip
DID_NOT_COMMIT = frozenset({State.FENCED_OUT, State.UNAVAILABLE, State.REFUSED, State.NOT_RESUMABLE})
KEPT = frozenset({State.COMMITTED, State.RECORDED})  # the answer is recorded: a retry gets it again
STEPS = {
    State.IDLE: frozenset({State.OPEN, State.UNAVAILABLE}),
    State.OPEN: frozenset({State.SETTLING, *ENDS}),
    State.SETTLING: ENDS,
    State.ROLLED_BACK: frozenset({State.RECORDED, State.FENCED_OUT, State.UNAVAILABLE}),
    State.REFUSED: frozenset({State.FENCED_OUT}),  # a refused commit whose key a newer claim owns
}


class NotCommitted(Exception):
    """Raised out of the handler's ``send`` once its transaction failed to commit (see :class:`State`)."""


class TransactionalRun:
    """One request's connection and transaction: its claim, its handler's writes and its record commit together.

    :meth:`claim` takes the connection and claims the key on it; :meth:`begin` begins the transaction, lent to the
    handler as ``transaction``; :meth:`run` runs the app with its response held, settles, and returns how the
    transaction ended. The claim and the beginning come before the app runs, or, when the app tells its tenant
    itself, from inside it (a dependency). ``outcome`` is the settlement's outcome and the answer's status, known
    before the held response goes out.
    """

    def __init__(self, store: TransactionalStore, policy: Policy, send: Send) -> None:
        self.state = State.IDLE
        self.failure: BaseException | None = None  # what the database said, for UNAVAILABLE and REFUSED
        self.outcome: tuple[Outcome, int | None] | None = None
        self.recorder = ResponseRecorder(send, max_body=policy.max_response_bytes, hold=True)
        self.transaction: Transaction | None = None  # the connection, once taken
        # The request was cancelled while its claim was on its way on the connection: the connection is the claim's
        # abandonment's to give back once the claim has ended (IdempotentRequest._abandon), never the run's under it.
        self.abandoned = False
        self._store = store
        self._policy = policy
        self._send_on = send
        self._owned: OwnedClaim | None = None
        self._claim: Claim | None = None
        self._loan: contextlib.AbstractAsyncContextManager[Transaction] | None = None  # ends: the connection back
        self._settling: asyncio.Future[None] | None = None
        self._freeing: asyncio.Future[Outcome] | None = None  # the key freed (_free), once, through a cancellation
        self.attempts = 0  # earlier claims of the key: one that took it over may be at a recovery point
        self.stepped = False  # the handler asked for its steps (_stepped.py)
        self.owner = ""  # the tenant as resolved (the record's may be a route's namespace of it)
        self._receive: Receive | None = None
        self._scope: Scope | None = None
        self._settled = asyncio.Event()  # set once an open transaction has settled
        self._outer_exception: BaseException | None = None  # being handled around the whole app, if anything
        self._answers_an_exception = False  # the response started while the app handled an exception

    def _to(self, state: State) -> None:
        if state not in STEPS.get(self.state, ()):
            raise RuntimeError(f"a transactional run cannot go from {self.state.value} to {state.value}")
        self.state = state
        if state in ENDS:
            self._settled.set()

    async def claim(
        self,
        tenant: str,
        key: str,
        fingerprint: bytes,
        *,
        lease: float,
        ttl: float,
        matching: tuple[bytes, ...] = (),
        request: str | None = None,
        parts: bytes | None = None,
    ) -> Claim:
        """Take this request's connection and claim the key on it. A claim that is not ours gives the connection
        back at once: the middleware answers without a transaction."""
        transaction = self.transaction or await self._lend()
        try:
            claim = await transaction.claim(
                tenant, key, fingerprint, lease=lease, ttl=ttl, matching=matching, request=request, parts=parts
            )
        except BaseException:
            await self.close()
            raise
        if claim.outcome is not ClaimOutcome.OWNED:
            await self.close()
        self.attempts = claim.attempts
        return claim

    async def begin(self, owned: OwnedClaim | None, owner: str = "") -> bool:
        """Begin the handler's transaction (on the claim's connection; a keyless request takes one now), for the
        claim ``owned`` (None: no key, no record) of the tenant ``owner`` (as resolved); False when the database could
        not be reached for it."""
        self._owned, self.owner = owned, owner
        try:
            transaction = self.transaction or await self._lend()
            await transaction.begin()
        except StoreUnavailable as error:
            self.failure = error
            self._to(State.UNAVAILABLE)
            await self.close()
            if owned is not None:
                await owned.release()  # nothing ran: the key is free for the retry
            return False
        self._to(State.OPEN)
        return True

    async def _lend(self) -> Transaction:
        loan = self._store.transaction()
        self.transaction = await loan.__aenter__()
        self._loan = loan
        return self.transaction

    async def close(self) -> None:
        """Give the connection back (once settled, or when it was never needed)."""
        self.transaction = None
        loan, self._loan = self._loan, None
        if loan is not None:
            await loan.__aexit__(None, None, None)

    async def _free(self, owned: OwnedClaim) -> Outcome:
        """Free the key of a run that did not complete, so that the retry runs afresh (``_stepped.py``: or resumes)."""
        return await owned.release()

    async def _steps_settle(self) -> State | None:
        """Before the completion: the state to roll back into instead of committing, or None (``_stepped.py``)."""
        return None

    async def _unfinished(self) -> State:
        """The state a transaction the handler left open rolls back into (``_stepped.py``)."""
        return State.ROLLED_BACK

    async def run(self, app: ASGIApp, scope: Scope, receive: Receive) -> State:
        """Run ``app`` with the response held until its transaction settles; return the state it ended in. What the
        app raised goes on once the run has settled (the state says whether anything committed)."""
        self._receive, self._scope = receive, scope
        self._outer_exception = sys.exception()
        try:
            try:
                await app(scope, self._receive_held, self._send)
            finally:
                await self._end()
            if self.state is State.ROLLED_BACK and not self.recorder.finished:
                raise RuntimeError("the handler returned without finishing its response")
        finally:
            await self._after()
        return self.state

    async def _after(self) -> None:
        """After the app, whatever it did: the claim settled, and the connection given back."""
        if self.outcome is None and self.state in (State.COMMITTED, State.RECORDED, State.ROLLED_BACK):
            # Settled, but the app cancelled its own send while it waited for that (a streaming response that
            # stopped on a disconnect), or raised before it answered: settle the claim now (a rolled-back key is
            # released).
            await self._settled_claim()
        elif self.state in DID_NOT_COMMIT - {State.FENCED_OUT} and self._owned is not None and self.outcome is None:
            released = await self._free_once(self._owned)  # nothing committed since the last recovery point, if any
            if self.state is State.REFUSED and released is Outcome.FENCED_OUT:
                # The completion failed because the key was no longer ours (a serialization failure under
                # REPEATABLE READ or SERIALIZABLE where a newer claim's response was stored first).
                self._to(State.FENCED_OUT)
            elif self.state is State.REFUSED:
                self.outcome = (released, self.recorder.status)
        if not self.abandoned:
            await self.close()

    async def _settled_claim(self) -> None:
        """Committed or rolled back, before the held response goes out: free a released key; the outcome. Once."""
        owned, status = self._owned, self.recorder.status
        if owned is None:  # no key, no record, nothing to report
            return
        owned.drop_lease()
        if self.state in (State.COMMITTED, State.RECORDED):
            self.outcome = (Outcome.EXECUTED, status)
        else:
            self.outcome = (await self._free_once(owned), status)

    async def _free_once(self, owned: OwnedClaim) -> Outcome:
        """Free the key (:meth:`_free`) in a task of its own, which a cancellation of the request does not stop: asked
        again after such a cancellation (``_after``), the run waits for the same task rather than free it twice."""
        if self._freeing is None:
            self._freeing = start_eagerly(self._free(owned), "idempotency release")
        return await outlasting(self._freeing)

    async def _receive_held(self) -> Message:
        """The app's ``receive``: a client that hangs up while the response is held is kept from the app until the
        transaction has settled. The client has seen nothing yet, and the commit, not the client, decides the
        outcome: told of the disconnect, Starlette's StreamingResponse would stop and run its background task for
        an effect that then rolls back."""
        assert self._receive is not None
        message = await self._receive()
        while message["type"] == "http.disconnect" and self.state is State.OPEN and self.recorder.status is not None:
            await self._settled.wait()
        return message

    async def _send(self, message: Message) -> None:
        state = self.state
        if state is State.IDLE:  # no transaction began (the app answered before telling its tenant): untouched
            await self._send_on(message)
            return
        if state in DID_NOT_COMMIT:
            raise NotCommitted(f"the handler's transaction did not commit ({state.value})")
        if message["type"] == "http.response.start":
            handling = sys.exception()  # an exception handler sends its response inside its ``except`` block
            self._answers_an_exception = handling is not None and handling is not self._outer_exception
        recorder = self.recorder
        going, decide = recorder.record(message)
        if decide:
            await self._settle()
        if going is not None:  # decided: a start that goes on now carries the record's expiry, if it was recorded
            owned = self._owned
            if owned is None or recorder.started or self.state not in KEPT:
                await recorder.forward(going)
            else:
                await recorder.forward(going, expiry(owned.expires_at))

    async def _settle(self) -> None:
        """The response is complete (or outgrew what may be held): decide, once, whether it may go out.

        Runs as its own task, shielded: a request cancelled while its record is being written still finishes
        writing it (or rolling back), so the key never stays in progress behind an answer that was decided.
        """
        if self._settling is None:
            self._to(State.SETTLING)
            self._settling = start_eagerly(self._commit_or_roll_back(), "idempotency settlement")
        await outlasting(self._settling)
        if self.state in DID_NOT_COMMIT:
            raise NotCommitted(f"the handler's transaction did not commit ({self.state.value})")
        if self.outcome is None:  # once: a response over the cap settles before its final body message
            await self._settled_claim()

    def _final(self, status: int | None) -> bool:
        """A final answer commits and is recorded; anything else rolls back and releases the key."""
        state = self._scope.get("state", {}) if self._scope is not None else {}
        return status is not None and not state.get(NOT_EXECUTED_KEY) and status in self._policy.recorded

    async def _commit_or_roll_back(self) -> None:
        transaction = self.transaction
        assert transaction is not None
        if not self._final(self.recorder.status):
            return await self._roll_back(State.ROLLED_BACK)
        if self._answers_an_exception:
            return await self._roll_back_and_record()
        owned = self._owned
        try:
            if self.stepped and (instead := await self._steps_settle()) is not None:
                return await self._roll_back(instead)
            if owned is not None and not await transaction.complete(
                owned.tenant, owned.key, owned.fence, self.recorder.stored_response()
            ):
                return await self._roll_back(State.FENCED_OUT)
            await transaction.commit()
        except StoreUnavailable as error:
            return await self._roll_back(State.UNAVAILABLE, error)
        except Exception as error:  # the database refused the record or the commit: nothing landed
            return await self._roll_back(State.REFUSED, error)
        self._to(State.COMMITTED)

    async def _roll_back_and_record(self) -> None:
        """Roll back the writes of a handler that raised, and record the final answer the app made of it, outside
        the transaction. If that cannot be recorded, the run ends rolled back: the key is released and the answer
        goes out as it is (the retry runs again, with nothing of this run's left)."""
        await self._roll_back(State.ROLLED_BACK)
        owned = self._owned
        if self.state is not State.ROLLED_BACK or owned is None:
            return
        try:
            recorded = await self._store.complete(owned.tenant, owned.key, owned.fence, self.recorder.stored_response())
        except Exception:
            return
        self._to(State.RECORDED if recorded else State.FENCED_OUT)

    async def _roll_back(self, state: State, failure: BaseException | None = None) -> None:
        """Roll back and end in ``state``; a database that cannot be reached for it ends in UNAVAILABLE."""
        assert self.transaction is not None
        self.failure = failure
        try:
            await self.transaction.rollback()
        except StoreUnavailable as error:
            if state is State.ROLLED_BACK:
                state, self.failure = State.UNAVAILABLE, error
        except Exception:  # a commit that failed has already ended the transaction: nothing is left to undo
            pass
        self._to(state)

    async def _end(self) -> None:
        """After the app: settle what it left open (a failure, or an unfinished response), and wait for a
        settlement under way, so the connection is never given back while a statement still runs on it."""
        unfinished = await self._unfinished() if self.stepped else State.ROLLED_BACK
        if self._settling is None and self.state is State.OPEN:
            self._settling = asyncio.ensure_future(self._roll_back(unfinished))
        if self._settling is not None:
            await wait_through_cancellation(self._settling)


SERIALIZATION_FAILURES = frozenset({"40001", "40P01"})  # serialization_failure, deadlock_detected


def refusal(failure: BaseException) -> str:
    """Why the database refused a handler's transaction, and what to do about it, for the log."""
    if isinstance(failure, TransactionEnded):
        return str(failure)
    if _sqlstate(failure) in SERIALIZATION_FAILURES:
        return (
            f"the handler's transaction conflicted with another and could not commit ({type(failure).__name__}); "
            "nothing was committed, the key is released, and the client's retry runs it afresh"
        )
    if _sqlstate(failure) == INSUFFICIENT_PRIVILEGE and "idempotency_" in str(failure):
        return (
            f"the handler's transaction could not commit ({failure}): the store writes the record in it, as the role "
            "the handler switched to (SET ROLE for row-level security). Grant that role SELECT, UPDATE ON "
            "idempotency_records and SELECT, INSERT, UPDATE ON idempotency_responses (and on "
            "idempotency_recovery_points too, for handlers in steps), in the store's schema; or RESET ROLE before the "
            "handler returns. Nothing was committed"
        )
    return (
        f"the handler's transaction could not commit ({type(failure).__name__}); nothing was committed. If the "
        "handler recovers from database errors, run the statements that may fail in a savepoint (asyncpg: async with "
        "connection.transaction(): ...; SQLAlchemy: async with session.begin_nested(): ...)"
    )


INSUFFICIENT_PRIVILEGE = "42501"


def _sqlstate(error: BaseException | None) -> str | None:
    """The SQLSTATE of a database error, asyncpg's own or wrapped by SQLAlchemy (its ``orig``, or the cause)."""
    while error is not None:
        code = getattr(error, "sqlstate", None)
        if isinstance(code, str):
            return code
        error = getattr(error, "orig", None) or error.__cause__
    return None


async def wait_through_cancellation(task: asyncio.Future[Any]) -> None:
    """Wait for ``task`` to finish even if this task is cancelled meanwhile (what it raised is its owner's to read);
    then re-raise the cancellation."""
    cancelled = False
    while not task.done():
        try:
            await outlasting(task)
        except asyncio.CancelledError:
            cancelled = True
        except Exception:
            pass
    if cancelled:
        raise asyncio.CancelledError
