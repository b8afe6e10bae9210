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

Each run ends in exactly one :class:`State`, which the middleware reads to choose the answer. When the transaction
did not commit, the handler's ``send`` raises :class:`NotCommitted`, so nothing that follows the response in the
app (a background task) runs for an effect that did not happen.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from idempotency_mw import problems
from idempotency_mw.capture import ResponseRecorder
from idempotency_mw.claims import OwnedClaim, store_failure
from idempotency_mw.eager import outlasting
from idempotency_mw.events import Outcome, logger
from idempotency_mw.failures import FailureLog
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
    COMMITTED = "committed"  # the effect and the record landed; the response goes out
    RECORDED = "recorded"  # an exception the app answered: its writes rolled back, its final answer recorded
    ROLLED_BACK = "rolled back"  # a transient answer, or a handler that failed or never finished: nothing landed
    FENCED_OUT = "fenced out"  # a newer claim owns the key: the record was refused, everything rolled back
    UNAVAILABLE = "unavailable"  # the database could not be reached to begin, write, commit or roll back
    REFUSED = "refused"  # the database refused the commit (a deferred constraint, a transaction left aborted)


DID_NOT_COMMIT = frozenset({State.FENCED_OUT, State.UNAVAILABLE, State.REFUSED})


class NotCommitted(Exception):
    """Raised out of the handler's ``send`` once its transaction failed to commit (see :class:`State`)."""


@dataclass(frozen=True, slots=True)
class Claimed:
    """The record a transaction completes: the claim of ``(tenant, key)`` under ``fence``."""

    tenant: str
    key: str
    fence: int


class Settlement:
    """What a transaction that completes a claim tells ``on_settled`` (``PostgresStore.settled``, which ``close()``
    waits on, and which wakes this process's waiters): the claim is settled once its completion is committed, or at
    once if it was fenced out (the key is another claim's now). A completion rolled back is not settled here: the
    middleware releases the key. Once committed, ``notice`` is the SQL that tells the waiters of other processes
    (``notify(tenant, key, fence)``, run after the COMMIT with the connection's reset)."""

    def __init__(
        self, on_settled: Callable[[str, str, int], None] | None, notify: Callable[[str, str, int], str]
    ) -> None:
        self._on_settled = on_settled
        self._notify = notify
        self._completed: tuple[str, str, int] | None = None
        self.notice = ""

    def completed(self, tenant: str, key: str, fence: int, done: bool) -> bool:
        """Note the outcome of the completion statement; returns ``done``."""
        if done:
            self._completed = (tenant, key, fence)
        elif self._on_settled is not None:
            self._on_settled(tenant, key, fence)
        return done

    def committed(self) -> None:
        if self._completed is not None:
            self.notice = self._notify(*self._completed)
            if self._on_settled is not None:
                self._on_settled(*self._completed)


class TransactionalRun:
    """One request's connection and transaction: its claim, its handler's writes and its record commit together.

    :meth:`claim` takes the connection and claims the key on it; :meth:`begin` begins the transaction and lends it
    to the handler (``lend``); :meth:`run` runs the app with its response held, settles, and answers by how the
    transaction ended. The claim and the beginning come before the app runs, or, when the app tells its tenant
    itself, from inside it (a dependency). ``is_final(status)`` says whether an answer is final (recorded,
    committed) or transient (rolled back). ``owned`` is the claim once it is the request's; ``decide(outcome,
    status)`` reports the outcome, ``refuse(problem, outcome)`` answers in its place (409, 503).
    """

    def __init__(
        self,
        store: TransactionalStore,
        send: Send,
        *,
        max_body: int,
        is_final: Callable[[int | None], bool],
        decide: Callable[[Outcome, int | None], None],
        refuse: Callable[[problems.Problem, Outcome], Awaitable[None]],
        retry_after: int,
        failures: FailureLog,
    ) -> None:
        self._state = State.IDLE
        self.failure: BaseException | None = None  # what the database said, for UNAVAILABLE and REFUSED
        self.recorder = ResponseRecorder(send, max_body=max_body, hold=True)
        self.owned: OwnedClaim | None = None
        self._store = store
        self._send_on = send
        self._is_final = is_final
        self._decide = decide
        self._refuse = refuse
        self._retry_after = retry_after
        self._failures = failures
        self._connection = contextlib.AsyncExitStack()  # gives the connection back when the run ends
        self._transaction: Transaction | None = None
        self._claimed: Claimed | None = None
        self._settling: asyncio.Task[None] | None = None
        self._reported = False
        self._receive: Receive | None = None
        self._left_open = asyncio.Event()  # set once an open transaction has settled
        self._outer_exception: BaseException | None = None  # being handled around the whole app, if anything
        self._answered_an_exception = False  # the response started while the app handled an exception

    @property
    def state(self) -> State:
        return self._state

    @state.setter
    def state(self, state: State) -> None:
        self._state = state
        if state not in (State.IDLE, State.OPEN):
            self._left_open.set()

    @property
    def status(self) -> int | None:
        return self.recorder.status

    async def claim(
        self, tenant: str, key: str, fingerprint: bytes, *, lease: float, ttl: float, matching: tuple[bytes, ...] = ()
    ) -> Claim:
        """Take this request's connection and claim the key on it. A claim that is not ours gives the connection
        back at once: the middleware answers without a transaction."""
        transaction = self._transaction or await self._lend()
        try:
            claim = await transaction.claim(tenant, key, fingerprint, lease=lease, ttl=ttl, matching=matching)
        except BaseException:
            await self.close()
            raise
        if claim.outcome is ClaimOutcome.OWNED:
            self._claimed = Claimed(tenant, key, claim.fence)
        else:
            await self.close()
        return claim

    async def begin(self, lend: Callable[[Transaction], None]) -> bool:
        """Begin the handler's transaction (on the claim's connection; a keyless request takes one now) and hand it
        to the handler through ``lend``; False when the database could not be reached for it, and the request was
        answered (503)."""
        try:
            transaction = self._transaction or await self._lend()
            await transaction.begin()
        except StoreUnavailable as error:
            self.state, self.failure = State.UNAVAILABLE, error
            await self._answer(None)
            await self.close()
            return False
        lend(transaction)
        self.state = State.OPEN
        return True

    async def _lend(self) -> Transaction:
        try:
            self._transaction = await self._connection.enter_async_context(self._store.transaction())
        except StoreUnavailable as error:
            self.state, self.failure = State.UNAVAILABLE, error
            raise
        return self._transaction

    async def close(self) -> None:
        """Give the connection back (once settled, or when it was never needed)."""
        self._transaction = None
        await self._connection.aclose()

    async def run(self, app: ASGIApp, scope: Scope, receive: Receive) -> None:
        """Run ``app`` with the response held until its transaction settles, then answer by how it ended: what the
        app raised goes on, unless the transaction did not commit and a 409 or 503 answers in its place."""
        self._receive = receive
        self._outer_exception = sys.exception()
        try:
            try:
                try:
                    await app(scope, self._receive_held, self._send)
                finally:
                    await self._end()
                if not self._reported and self.state in (State.COMMITTED, State.RECORDED, State.ROLLED_BACK):
                    # Settled, but the app cancelled its own send while it waited for that (a streaming response that
                    # stopped on a disconnect): report it now, so a rolled-back key is still released.
                    await self._settled()
                if self.state is State.ROLLED_BACK and not self.recorder.finished:
                    raise RuntimeError("the handler returned without finishing its response")
            except BaseException as error:
                if not await self._answer(error):
                    raise  # from here, so its traceback holds no frame that holds it (tests/test_cycles.py)
                return
            await self._answer(None)
        finally:
            await self.close()

    async def _answer(self, raised: BaseException | None) -> bool:
        """Answer by how the transaction ended, ``raised`` being what the app raised. True when that answer (a 409
        or 503) replaces it; False when it is to go on as it is."""
        state = self.state
        if state in (State.COMMITTED, State.RECORDED, State.IDLE) or (state is State.ROLLED_BACK and raised is None):
            return False  # settled and reported (what the app raised after the commit, a background task, undoes
            # nothing), or the app answered before any transaction began
        # Nothing committed: free the key for the retry, unless the rollback's settling freed it already.
        released = None
        if self.owned is not None and state is not State.FENCED_OUT and not self._reported:
            released = await self.owned.release()
            if state is State.REFUSED and released is Outcome.FENCED_OUT:
                # The completion failed because the key was no longer ours (a serialization failure under
                # REPEATABLE READ or SERIALIZABLE where a newer claim's response was stored first).
                state = self.state = State.FENCED_OUT
        if state is State.FENCED_OUT:
            # A newer claim owns the key: our writes were rolled back, and the client hears what a retry would.
            await self._refuse(problems.in_progress(self._retry_after), Outcome.FENCED_OUT)
            return True
        if state is State.UNAVAILABLE:
            assert self.failure is not None
            self._failures.failed("run the handler's transaction", self.failure)
            await self._refuse(problems.store_unavailable(self._retry_after), store_failure(self.failure))
            return True
        if released is not None:
            self._decide(released, self.status)
        if state is State.REFUSED:
            # The database refused the transaction: a deferred constraint at COMMIT, an error the handler caught but
            # that aborted it, or the handler ended it itself (TransactionEnded says so). Nothing was committed.
            assert self.failure is not None
            logger.error("idempotency: %s", _refusal(self.failure))
            raise self.failure from raised
        assert raised is not None  # rolled back because the handler failed, was cancelled, or never finished
        return False

    async def _settled(self) -> None:
        """Committed or rolled back, just before the held response goes out: free a released key, report. Once."""
        self._reported = True
        owned = self.owned
        if owned is not None:  # else no key, no record
            owned.drop_lease()
            committed = self.state in (State.COMMITTED, State.RECORDED)
            self._decide(Outcome.EXECUTED if committed else await owned.release(), self.status)

    async def _receive_held(self) -> Message:
        """The app's ``receive``: a client that hangs up while the response is held is kept from the app until the
        transaction has settled. The client has seen nothing yet, and the commit, not the client, decides the
        outcome: told of the disconnect, Starlette's StreamingResponse would stop and run its background task for
        an effect that then rolls back."""
        assert self._receive is not None
        message = await self._receive()
        while message["type"] == "http.disconnect" and self.state is State.OPEN and self.recorder.status is not None:
            await self._left_open.wait()
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
            self._answered_an_exception = handling is not None and handling is not self._outer_exception
        going, decide = self.recorder.record(message)
        if decide:
            await self._settle()
        if going is not None:
            await self.recorder.forward(going)

    async def _settle(self) -> None:
        """The response is complete (or outgrew what may be held): decide, once, whether it may go out.

        Runs as its own task, shielded: a request cancelled while its record is being written still finishes
        writing it (or rolling back), so the key never stays in progress behind an answer that was decided.
        """
        if self._settling is None:
            self._settling = asyncio.ensure_future(self._commit_or_roll_back())
        await outlasting(self._settling)
        if self.state in DID_NOT_COMMIT:
            raise NotCommitted(f"the handler's transaction did not commit ({self.state.value})")
        if not self._reported:  # once: a response over the cap settles before its final body message
            await self._settled()

    async def _commit_or_roll_back(self) -> None:
        assert self._transaction is not None
        if not self._is_final(self.recorder.status):
            await self._roll_back(State.ROLLED_BACK)
        elif self._answered_an_exception:
            await self._roll_back_and_record()
        else:
            try:
                claimed = self._claimed
                if claimed is not None and not await self._transaction.complete(
                    claimed.tenant, claimed.key, claimed.fence, self.recorder.stored_response()
                ):
                    await self._roll_back(State.FENCED_OUT)
                    return
                await self._transaction.commit()
            except StoreUnavailable as error:
                await self._roll_back(State.UNAVAILABLE, error)
                return
            except Exception as error:  # the database refused the record or the commit: nothing landed
                await self._roll_back(State.REFUSED, error)
                return
            self.state = State.COMMITTED

    async def _roll_back_and_record(self) -> None:
        """Roll back the writes of a handler that raised, and record the final answer the app made of it, outside
        the transaction. If that cannot be recorded, the run ends rolled back: the key is released and the answer
        goes out as it is (the retry runs again, with nothing of this run's left)."""
        await self._roll_back(State.ROLLED_BACK)
        claimed = self._claimed
        if self.state is not State.ROLLED_BACK or claimed is None:
            return
        try:
            recorded = await self._store.complete(
                claimed.tenant, claimed.key, claimed.fence, self.recorder.stored_response()
            )
        except Exception:
            return
        self.state = State.RECORDED if recorded else State.FENCED_OUT

    async def _roll_back(self, state: State, failure: BaseException | None = None) -> None:
        """Roll back and end in ``state``; a database that cannot be reached for it ends in UNAVAILABLE."""
        assert self._transaction is not None
        self.state, self.failure = state, failure
        try:
            await self._transaction.rollback()
        except StoreUnavailable as error:
            if state is State.ROLLED_BACK:
                self.state, self.failure = State.UNAVAILABLE, error
        except Exception:  # a commit that failed has already ended the transaction: nothing is left to undo
            pass

    async def _end(self) -> None:
        """After the app: settle what it left open (a failure, or an unfinished response), and wait for a
        settlement under way, so the connection is never given back while a statement still runs on it."""
        if self._settling is None and self.state is State.OPEN:
            self._settling = asyncio.ensure_future(self._roll_back(State.ROLLED_BACK))
        if self._settling is not None:
            await _wait_through_cancellation(self._settling)


SERIALIZATION_FAILURES = frozenset({"40001", "40P01"})  # serialization_failure, deadlock_detected


def _refusal(failure: BaseException) -> str:
    if isinstance(failure, TransactionEnded):
        return str(failure)
    if _sqlstate(failure) in SERIALIZATION_FAILURES:
        return (
            f"the handler's transaction conflicted with another and could not commit ({type(failure).__name__}); "
            "nothing was committed, the key is released, and the client's retry runs it afresh"
        )
    return (
        f"the handler's transaction could not commit ({type(failure).__name__}); nothing was committed. If the "
        "handler recovers from database errors, run the statements that may fail in a savepoint (asyncpg: async with "
        "connection.transaction(): ...; SQLAlchemy: async with session.begin_nested(): ...)"
    )


def _sqlstate(error: BaseException | None) -> str | None:
    """The SQLSTATE of a database error, asyncpg's own or wrapped by SQLAlchemy (its ``orig``, or the cause)."""
    while error is not None:
        code = getattr(error, "sqlstate", None)
        if isinstance(code, str):
            return code
        error = getattr(error, "orig", None) or error.__cause__
    return None


async def _wait_through_cancellation(task: asyncio.Task[None]) -> None:
    """Wait for ``task`` to finish even if this task is cancelled meanwhile; then re-raise the cancellation."""
    cancelled = False
    while not task.done():
        try:
            await outlasting(task)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
