"""Recovery points as the store keeps them (``sql/queries.sql``: record_steps, recovery_points, lapse, stalled;
``migrations/0005``): the arguments of the statement that writes them, the rows read back, and the requests stopped at
one that nobody resumes. A result is stored as its JSON text, or sealed by a store with a cipher, bound to its record
and step (``idempotency_mw.encryption``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from idempotency_mw.postgres._connector import Connector
from idempotency_mw.postgres._records import reachable
from idempotency_mw.postgres._sql import queries
from idempotency_mw.store import PlainResponseRefused, RecoveryPoint, StalledRequest, UnknownKeyId

if TYPE_CHECKING:
    from idempotency_mw.encryption import ResponseCipher


def point_arguments(
    tenant: str, key: str, fence: int, points: Iterable[RecoveryPoint], cipher: ResponseCipher | None
) -> tuple[Any, ...]:
    """The arguments of ``record_steps``: one array per column, one element per point."""
    steps: list[str] = []
    positions: list[int] = []
    done: list[bool] = []
    results: list[str | None] = []
    sealed: list[bytes | None] = []
    sealed_with: list[str | None] = []
    for point in points:
        steps.append(point.step)
        positions.append(point.position)
        done.append(point.result is not None)
        if point.result is None or cipher is None:
            results.append(None if point.result is None else point.result.decode())
            sealed.append(None)
            sealed_with.append(None)
        else:
            key_id, closed = cipher.seal_step(tenant, key, point.step, point.result)
            results.append(None)
            sealed.append(closed)
            sealed_with.append(key_id)
    return (tenant, key, fence, steps, positions, done, results, sealed, sealed_with)


def points_from_rows(rows: Iterable[Any], tenant: str, key: str, cipher: ResponseCipher | None) -> list[RecoveryPoint]:
    """The ``recovery_points`` rows as points, their results opened. A result stored plain under a store that seals
    is refused, as a plain response is, unless the cipher allows plain ones: a role that can write the table but
    holds no key could otherwise choose what a resumed request builds its answer on."""
    points = []
    for row in rows:
        step, result = row["step"], None
        if row["done"]:
            if row["sealed"] is not None:
                if cipher is None:
                    raise UnknownKeyId(row["sealed_with"], ())
                result = cipher.open_step(tenant, key, step, row["sealed_with"], bytes(row["sealed"]))
            elif cipher is not None and not cipher.allow_plain:
                raise PlainResponseRefused()
            else:
                result = row["result"].encode()
        points.append(RecoveryPoint(step, row["position"], result))
    return points


async def stalled_requests(
    connector: Connector, schema: str, seconds: float, *, lapsed_for: float = 0.0, limit: int = 100
) -> list[StalledRequest]:
    """Requests stopped at a recovery point whose lease lapsed at least ``lapsed_for`` seconds ago and that nobody
    has resumed, oldest lapse first, at most ``limit`` (``idempotency-mw stalled``; a store's ``connector``,
    ``schema`` and ``seconds``, its timeout). It reads every recovery point: an operator's command, not a request's."""
    sql = queries(schema)["stalled"]
    async with connector.session() as connection:
        with reachable(schema):
            rows = await connection.fetch(sql, float(lapsed_for), limit, timeout=seconds)
    return [StalledRequest(**dict(row)) for row in rows]
