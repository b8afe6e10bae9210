"""A handler that runs in steps, each with a recovery point, so that a retry resumes where the last attempt stopped
(docs/design.md §10).

A transactional handler gets :class:`Steps` as ``request.state.idempotency.steps``. A *local* step runs a function
of the handler's in the lent transaction, then its result is committed with its writes as the request's recovery
point, and a new transaction begins for what follows. An *outside* step calls something outside the database (a
payment provider) with a key of its own that stays the same across attempts (the provider deduplicates its half); its
result is recorded with the next commit. A retry of a request that stopped between steps gets each recorded result
back instead of running its step again, so the handler, walking the same steps, ends with the answer a first run
would have given.

:class:`Steps` keeps the step bookkeeping of one attempt (which points there are, which results wait for the next
commit); the transactional run commits them (``_transactional.py``) and, at its end, asks where the request stands:
at a recovery point, it is never released, only left for the retry (its lease lapsed).
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import orjson

from idempotency_mw.store import RecoveryPoint

T = TypeVar("T")
MAX_STEP_NAME = 200  # characters: a name is a label in metrics and in the listing of stalled requests
MAX_RESULT_BYTES = 64 * 1024  # a step's result is what later steps need (ids, amounts), not a document


class StepNotResumable(Exception):
    """A retry found an unrepeatable outside step begun by an earlier attempt and its outcome unknown: calling it
    again could repeat it, and skipping it would guess. The request is answered 409 ``idempotency_step_not_resumable``
    and stays at its recovery point, listed by ``idempotency-mw stalled``, for an operator to finish."""

    def __init__(self, step: str) -> None:
        super().__init__(
            f"step {step!r} cannot be repeated and an earlier attempt began it without recording its outcome: check "
            "with the other side, then finish the request by hand (docs/operations.md, stalled requests)"
        )
        self.step = step


class StepsEnded(Exception):
    """The request's transaction ended before this step could run or commit (fenced out by a newer claim, the
    database unreachable or refusing the commit): the handler must stop; the middleware answers for it."""


class Committer(Protocol):
    """What commits a request's steps: its transactional run."""

    async def recovery_points(self) -> list[RecoveryPoint]:
        """The recovery points an earlier attempt committed, in order."""

    async def commit_step(self, points: list[RecoveryPoint]) -> None:
        """Commit the handler's writes with ``points``, then begin the next transaction; :class:`StepsEnded` when
        the request's transaction ended instead."""


class Phase(enum.Enum):
    UNREAD = "unread"  # the claim took the key over: an earlier attempt may have left recovery points, not read yet
    NONE = "none"  # no recovery point in this life of the key (yet)
    AT_POINT = "at a recovery point"  # at least one step committed, in this attempt or an earlier one
    NOT_RESUMABLE = "not resumable"  # an unrepeatable step of an earlier attempt has no recorded outcome


PHASES = {
    Phase.UNREAD: frozenset({Phase.NONE, Phase.AT_POINT}),
    Phase.NONE: frozenset({Phase.AT_POINT}),
    Phase.AT_POINT: frozenset({Phase.NOT_RESUMABLE}),
}


class Steps:
    """The steps of one request (``request.state.idempotency.steps``), in the order the handler reaches them.

    Each step has a name, unique in the request; a result is anything JSON can hold (``orjson``), at most
    ``MAX_RESULT_BYTES`` as JSON. A step hands back its result as JSON gives it back (a tuple comes back a list), on
    the first run as on a resumed one, so that both build the same answer. Steps run one at a time.
    """

    def __init__(self, committer: Committer, downstream_key: Callable[[str], str], *, took_over: bool) -> None:
        self.phase = Phase.UNREAD if took_over else Phase.NONE
        self.resumed_from: str | None = None  # the last step an earlier attempt committed, once read
        self.unresumable: str | None = None  # the unrepeatable step an earlier attempt left without an outcome
        self._committer = weakref.ref(committer)  # the run holds its steps: no cycle between them
        self._downstream_key = downstream_key
        self._recorded: dict[str, RecoveryPoint] = {}  # committed, by this attempt or an earlier one
        self._pending: list[RecoveryPoint] = []  # outside steps' results, for the next commit
        self._reached: set[str] = set()  # the names this attempt has reached
        self._busy = False

    def _to(self, phase: Phase) -> None:
        if phase not in PHASES.get(self.phase, ()):
            raise RuntimeError(f"the steps of a request cannot go from {self.phase.value} to {phase.value}")
        self.phase = phase

    @property
    def pending(self) -> list[RecoveryPoint]:
        """The results of outside steps not committed yet (the request's completion records them too)."""
        return list(self._pending)

    async def local(self, name: str, run: Callable[[], Awaitable[T]]) -> T:
        """Run ``run()`` in the request's transaction (its writes through ``request.state.idempotency.connection``
        or the SQLAlchemy session), then commit them with this step's result as the request's recovery point, and
        begin a new transaction for what follows. A retry after the commit gets the recorded result back without
        calling ``run``. Writes belong inside a step (or after the last one): a write between two steps runs again
        on every resumed attempt."""
        found = await self._enter(name)
        if found is not None:
            return found[0]  # type: ignore[no-any-return]
        try:
            result, text = _as_json(name, await run())
            await self._commit_with(RecoveryPoint(name, self._position(), text))
            return result  # type: ignore[no-any-return]
        finally:
            self._busy = False

    async def _commit_with(self, point: RecoveryPoint) -> None:
        """Commit ``point`` with the points that waited for a commit (outside steps' results): the request is at a
        recovery point from here."""
        await self._commit().commit_step([*self._pending, point])
        for each in (*self._pending, point):
            self._recorded[each.step] = each
        self._pending.clear()
        if self.phase is not Phase.AT_POINT:
            self._to(Phase.AT_POINT)

    async def outside(self, name: str, call: Callable[[str], Awaitable[T]], *, repeatable: bool = True) -> T:
        """Call ``call(downstream_key)``, with a key for this step that every attempt of the request derives alike
        (:meth:`downstream_key`): send it as that call's own ``Idempotency-Key``. Its result is recorded with the next
        commit; a retry after that gets it back without calling again, and a retry before it calls again with the
        same key, which the other side deduplicates.

        ``repeatable=False`` is for a call the other side cannot deduplicate: its start is committed first, and a
        retry that finds it started without a recorded outcome raises :class:`StepNotResumable` (answered 409)
        rather than call it a second time or skip it."""
        found = await self._enter(name)
        if found is not None:
            return found[0]  # type: ignore[no-any-return]
        try:
            if not repeatable:  # its start is committed before the call, with whatever waits for a commit
                began = RecoveryPoint(name, self._position(), None)
                await self._commit_with(began)
                position = began.position
            else:
                position = self._position()
            result, text = _as_json(name, await call(self._downstream_key(name)))
            self._pending.append(RecoveryPoint(name, position, text))
            return result  # type: ignore[no-any-return]
        finally:
            self._busy = False

    def result(self, name: str) -> Any:
        """The result of step ``name``, reached by this attempt or recorded by an earlier one."""
        point = next((p for p in self._pending if p.step == name), None) or self._recorded.get(name)
        if point is None or point.result is None:
            raise LookupError(f"step {name!r} has no result: it has not run (or not finished) in this request")
        return orjson.loads(point.result)

    def downstream_key(self, name: str) -> str:
        """The key of outside step ``name``: ``IdempotencyContext.downstream_key(name)``, the same on every attempt."""
        return self._downstream_key(name)

    async def _enter(self, name: str) -> tuple[Any] | None:
        """Check ``name`` and read the recovery points once; the recorded result of a step already done, in a tuple
        (None: the step runs). Marks the steps busy when it returns None."""
        if not isinstance(name, str) or not name or len(name) > MAX_STEP_NAME:
            raise ValueError(f"a step's name is a non-empty string of at most {MAX_STEP_NAME} characters: {name!r}")
        if self._busy:
            raise RuntimeError("the steps of a request run one at a time: await each before the next begins")
        if name in self._reached:
            raise ValueError(f"step {name!r} is reached twice in this request: each step needs a name of its own")
        self._reached.add(name)
        if self.phase is Phase.UNREAD:
            self._busy = True
            try:
                for point in await self._commit().recovery_points():
                    self._recorded[point.step] = point
                    self.resumed_from = point.step
            finally:
                self._busy = False
            self._to(Phase.AT_POINT if self._recorded else Phase.NONE)
        if self.phase is Phase.NOT_RESUMABLE:
            raise RuntimeError("this request cannot be resumed: its handler must stop")
        recorded = self._recorded.get(name)
        if recorded is not None:
            if recorded.result is None:  # an unrepeatable step that began in an earlier attempt, outcome unknown
                self.unresumable = name
                self._to(Phase.NOT_RESUMABLE)
                raise StepNotResumable(name)
            return (orjson.loads(recorded.result),)
        self._busy = True
        return None

    def _commit(self) -> Committer:
        committer = self._committer()
        if committer is None:
            raise StepsEnded("the request has ended: no step can run in it")
        return committer

    def _position(self) -> int:
        """The next step's place in the request's order."""
        return 1 + max((p.position for p in (*self._recorded.values(), *self._pending)), default=0)


def _as_json(name: str, value: Any) -> tuple[Any, bytes]:
    """``value`` as JSON text, and as it reads back from it: what a resumed attempt will get."""
    try:
        text = orjson.dumps(value)
    except TypeError as error:
        raise TypeError(f"the result of step {name!r} must be what JSON can hold: {error}") from None
    if len(text) > MAX_RESULT_BYTES:
        raise ValueError(
            f"the result of step {name!r} is {len(text)} bytes as JSON; a step keeps at most {MAX_RESULT_BYTES} "
            "(the ids and amounts later steps need: keep documents in your own tables)"
        )
    return orjson.loads(text), text
