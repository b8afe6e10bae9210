"""Recovery points (docs/design.md §10) in a transaction lent on a SQLAlchemy engine: what
:class:`~idempotency_mw.sqlalchemy.SQLAlchemyTransaction` does for a handler that runs in steps.

The session works in a savepoint of the request's transaction. A step flushes it, writes its points, and ends the
session's savepoint (``session.commit()``, which in this mode never commits the transaction itself), so that once the
transaction commits and the next begins, the session's next statement opens a savepoint in the new one. Its objects
stay loaded (``expire_on_commit=False``).
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any, Protocol

from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from idempotency_mw.postgres._lending import FENCED_OUT
from idempotency_mw.postgres._records import Records, caused_by, run_unprepared
from idempotency_mw.postgres._recovery import point_arguments, points_from_rows
from idempotency_mw.store import RecoveryPoint, StoreNotMigrated, StoreUnavailable


class Lent(Protocol):
    """What the steps use of a transaction lent on a SQLAlchemy engine (``SQLAlchemyTransaction``, whose module
    imports this one): its connection and session, the store's statements, and its guards of our statements."""

    connection: AsyncConnection
    session: AsyncSession
    lost: bool
    _records: Records
    _explicit: bool

    def _reachable(self, schema: str | None = None) -> AbstractContextManager[None]: ...

    def _deadline(self) -> AbstractAsyncContextManager[None]: ...

    async def _end_session(self) -> None: ...

    async def _refuse_if_ended(self) -> None: ...

    async def _refuse_if_unmarked(self) -> None: ...


async def recovery_points(lent: Lent, tenant: str, key: str, fence: int) -> list[RecoveryPoint]:
    """The points of the record's current life, read in the lent transaction before the handler's writes."""
    records = lent._records
    with lent._reachable(records.schema):
        async with lent._deadline():
            result = await lent.connection.exec_driver_sql(records.sql["recovery_points"], (tenant, key, fence))
    return points_from_rows(result.mappings().all(), tenant, key, records.cipher)


async def record_steps(lent: Lent, tenant: str, key: str, fence: int, points: list[RecoveryPoint]) -> bool:
    """The session flushed, the points written (fenced: False when fenced out), and the session's savepoint ended."""
    await lent._refuse_if_ended()  # first: a flush outside the transaction would commit on its own
    await lent._end_session()
    records = lent._records
    args = (*point_arguments(tenant, key, fence, points, records.cipher), True)  # marked (SQLAlchemyTransaction.begin)
    try:
        with lent._reachable(records.schema):
            async with lent._deadline():
                result = await lent.connection.exec_driver_sql(records.sql["record_steps"], args)
    except sa_exc.DBAPIError as error:
        if not caused_by(error, FENCED_OUT):
            raise
        return False  # another claim's point of a step, or the record deleted meanwhile
    if result.rowcount != len(points):
        await lent._refuse_if_unmarked()  # the points would land in a transaction the handler began
        return False
    with lent._reachable():
        await lent.session.commit()  # its savepoint only: the transaction commits with the step
    return True


async def lapse(lent: Lent, tenant: str, key: str, fence: int) -> bool:
    """Outside a transaction, on the driver's connection (as the claim runs): the lease lapsed now."""
    if lent.lost or lent.connection.invalidated:
        raise StoreUnavailable("the connection of the handler's transaction was lost")
    raw = await lent.connection.get_raw_connection()
    driver: Any = raw.driver_connection  # asyncpg's Connection
    records = lent._records
    try:
        with lent._reachable(records.schema):
            row = await run_unprepared(
                driver, records.sql["lapse"], (tenant, key, fence), records.timeout, False, lent._explicit
            )
    except StoreNotMigrated:
        raise
    finally:
        records.settled(tenant, key, fence)
    return bool(row is not None and row["lapsed"] == 1)
