"""The transactional run of a handler that may run in steps (``_steps.py``, docs/design.md §10).

:class:`SteppedRun` is every transactional request's run: until its handler asks for steps, it is
:class:`~idempotency_mw._transactional.TransactionalRun` and costs nothing more. Each local step commits the handler's
writes with its recovery point, then a new transaction begins; a step's commit runs in a task of its own, so that a
request cancelled meanwhile lands it or not before the run ends. A record at a recovery point is never released: a run
that ends without its final answer leaves it there, its lease lapsed, so that the retry takes it over at once and
resumes (:class:`Points`). The run's state says how it ended, as for any transactional run.

A request the middleware does not enforce (switched off, observing) has an :class:`UnrecordedRun`: its steps all run,
none recorded. The handler's context holds its run weakly (``IdempotencyContext.recovery``).
"""

from __future__ import annotations

import asyncio
import enum
import secrets
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from idempotency_mw._claim import OwnedClaim, outlasting, start_eagerly, store_failure
from idempotency_mw._events import Outcome
from idempotency_mw._steps import Phase, Steps, StepsEnded
from idempotency_mw._transactional import State, TransactionalRun, wait_through_cancellation
from idempotency_mw.store import (
    RecoveringTransaction,
    RecoveryPoint,
    StoreUnavailable,
)

T = TypeVar("T")


class Points(enum.Enum):
    """Whether the request's record is at a recovery point (a step committed, in this attempt or an earlier one)."""

    NONE = "none"  # a fresh claim, or one whose recovery points were read and there were none
    UNKNOWN = "unknown"  # the claim took the key over, and no step asked for the points an earlier attempt left
    SOME = "some"  # at a recovery point: the record is never released, only left for the retry to resume


class SteppedRun(TransactionalRun):
    """A transactional run whose handler may run in steps (:meth:`steps`). Until it asks for them, nothing here is
    set up: a request that never does costs what any transactional request costs."""

    _steps: Steps | None = None  # the handler's steps, once it asks for them
    _stepping: asyncio.Future[Any] | None = None  # a step's commit (or read), which outlasts a cancellation
    _points: Points | None = None  # once known beyond what the claim tells

    @property
    def points(self) -> Points:
        """Whether the record is at a recovery point: a claim that took the key over may be (read when a step first
        asks), a fresh one is not."""
        if self._points is None:
            return Points.UNKNOWN if self.attempts else Points.NONE
        return self._points

    @property
    def unresumable(self) -> str | None:
        """The step that made the request not resumable (state NOT_RESUMABLE)."""
        return None if self._steps is None else self._steps.unresumable

    def steps(self, downstream_key: Callable[[str], str] | None) -> Steps:
        """The handler's steps (``IdempotencyContext.steps``), made when it first asks for them; their outside calls
        get their keys from ``downstream_key``, the context's."""
        if self._owned is None or downstream_key is None:
            raise LookupError("this request carries no Idempotency-Key: its handler cannot run in steps")
        return self._made(downstream_key, took_over=self.points is Points.UNKNOWN)

    def _made(self, downstream_key: Callable[[str], str], *, took_over: bool) -> Steps:
        if not isinstance(self.transaction, RecoveringTransaction):
            raise LookupError(f"{type(self.transaction).__name__} keeps no recovery points: steps need PostgresStore")
        if self._steps is None:
            self._steps = Steps(self, downstream_key, took_over=took_over)
            self.stepped = True
        return self._steps

    @property
    def resumed_from(self) -> str | None:
        """The last step an earlier attempt committed, when this one resumed after it."""
        return None if self._steps is None else self._steps.resumed_from

    async def recovery_points(self) -> list[RecoveryPoint]:
        """The recovery points of earlier attempts (none for a fresh claim, without asking the database)."""
        if self.points is not Points.UNKNOWN:
            return []
        return await self._step(self._read_points())

    async def commit_step(self, points: list[RecoveryPoint]) -> None:
        """Commit the handler's writes with ``points`` and begin the next transaction (:class:`StepsEnded` when the
        transaction ended instead: the run's state says how)."""
        await self._step(self._commit_step(points))

    async def _step(self, work: Coroutine[Any, Any, T]) -> T:
        """``work`` on the request's transaction, in a task of its own: a request cancelled meanwhile still lands
        it, or not, before the run ends (``_end`` waits for it)."""
        if self.state is not State.OPEN or (self._stepping is not None and not self._stepping.done()):
            work.close()
            raise StepsEnded(f"the request's transaction is {self.state.value}: no step can run in it")
        self._stepping = start_eagerly(work, "idempotency step")
        return await outlasting(self._stepping)

    async def _read_points(self) -> list[RecoveryPoint]:
        owned = self._owned
        assert owned is not None
        try:
            points = await self._recovering().recovery_points(owned.tenant, owned.key, owned.fence)
        except StoreUnavailable as error:
            await self._roll_back(State.UNAVAILABLE, error)
            raise StepsEnded("the database could not be reached to read the recovery points") from error
        self._points = Points.SOME if points else Points.NONE
        return points

    async def _write_points(self, points: list[RecoveryPoint]) -> bool:
        """Write ``points`` in the request's transaction; False when a newer claim owns the key."""
        owned = self._owned
        assert owned is not None
        return await self._recovering().record_steps(owned.tenant, owned.key, owned.fence, points)

    async def _commit_step(self, points: list[RecoveryPoint]) -> None:
        transaction = self._recovering()
        try:
            if not await self._write_points(points):
                await self._roll_back(State.FENCED_OUT)
                raise StepsEnded("a newer claim owns the key: this attempt's steps are not its to commit")
            await transaction.commit()
        except StepsEnded:
            raise
        except StoreUnavailable as error:
            await self._roll_back(State.UNAVAILABLE, error)
            raise StepsEnded("the database could not be reached to commit a step") from error
        except Exception as error:  # the database refused the points or the commit: nothing of this step landed
            await self._roll_back(State.REFUSED, error)
            raise StepsEnded(f"the database refused to commit a step ({type(error).__name__})") from error
        self._points = Points.SOME
        try:
            await transaction.begin()
        except StoreUnavailable as error:
            self.failure = error
            self._to(State.UNAVAILABLE)
            raise StepsEnded("the database could not be reached to begin the next step") from error

    def _recovering(self) -> RecoveringTransaction:
        transaction = self.transaction
        assert isinstance(transaction, RecoveringTransaction)
        return transaction

    async def _free(self, owned: OwnedClaim) -> Outcome:
        """Free the key of a run that did not complete: released, so that the retry runs afresh; or, at a recovery
        point, left there with its lease lapsed, so that the retry resumes at once. A claim that took the key over
        and never read the points tries the release first, which refuses a record at a recovery point."""
        if self.points is not Points.SOME:
            released = await owned.release()
            if self.points is Points.NONE or released is not Outcome.FENCED_OUT:
                return released
        owned.drop_lease()
        transaction = self.transaction
        if not isinstance(transaction, RecoveringTransaction):
            return Outcome.STORE_ERROR  # given back already: the lease lapses on its own
        try:
            lapsed = await asyncio.shield(transaction.lapse(owned.tenant, owned.key, owned.fence))
        except Exception as error:  # the lease lapses on its own, and the retry resumes then
            return store_failure(error)
        return Outcome.STOPPED if lapsed else Outcome.FENCED_OUT

    async def _steps_settle(self) -> State | None:
        """Before the completion: not resumable (the handler answered :class:`StepNotResumable` itself), or the
        results of outside steps since the last commit written with it (fenced)."""
        steps, owned = self._steps, self._owned
        if steps is None or owned is None:
            return None
        if steps.phase is Phase.NOT_RESUMABLE:
            return State.NOT_RESUMABLE
        pending = steps.pending
        if pending and not await self._recovering().record_steps(owned.tenant, owned.key, owned.fence, pending):
            return State.FENCED_OUT
        return None

    async def _unfinished(self) -> State:
        """A step's commit under way lands, or not, first; then what the handler left open rolls back."""
        if self._stepping is not None:
            await wait_through_cancellation(self._stepping)
        if self._steps is not None and self._steps.phase is Phase.NOT_RESUMABLE:
            return State.NOT_RESUMABLE
        return State.ROLLED_BACK


class UnrecordedRun(SteppedRun):
    """The transactional run of a request the middleware does not enforce (switched off, or a route that observes):
    its handler runs as without the middleware. Its steps all run, in order: a local one commits its writes (with no
    recovery point) and a new transaction begins, as when enforcing, so that the handler's writes land as it laid
    them out; an outside one calls with the request's downstream key, or, for a request without a key, a key of its
    own drawn for that call (nothing to derive one from: the other side sees a new call, as without the
    middleware). Nothing is read back, skipped or recorded."""

    def steps(self, downstream_key: Callable[[str], str] | None) -> Steps:
        return self._made(downstream_key or _drawn_key, took_over=False)

    async def _write_points(self, points: list[RecoveryPoint]) -> bool:
        return True  # nothing is recorded


def _drawn_key(name: str) -> str:
    """A key for one outside call of a request without a key: 64 hex digits, as ``downstream_key`` gives."""
    return secrets.token_hex(32)
