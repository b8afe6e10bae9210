"""Recovery points as the store keeps them (``sql/queries.sql``: record_steps, recovery_points, lapse, stalled;
``migrations/0005``): the arguments of the statement that writes them, the rows read back, and the requests stopped at
one that nobody resumes. A result is stored as its JSON text, or sealed by a store with a cipher, bound to its record
and step (``idempotency_mw.encryption``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol

from idempotency_mw.postgres._connector import Connector
from idempotency_mw.postgres._records import reachable
from idempotency_mw.postgres._sql import queries
from idempotency_mw.store import (
    PlainResponseRefused,
    RecoveryPoint,
    SealedResponseError,
    StalledRequest,
    UnknownKeyId,
)

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


class Tables(Protocol):
    """What the operator's commands here read of a store (``PostgresStore``, whose package imports this module): its
    connections, schema, statement timeout and cipher."""

    @property
    def connector(self) -> Connector: ...

    @property
    def schema(self) -> str: ...

    @property
    def timeout(self) -> float: ...

    @property
    def cipher(self) -> ResponseCipher | None: ...


async def stalled_requests(store: Tables, *, lapsed_for: float = 0.0, limit: int = 100) -> list[StalledRequest]:
    """Requests stopped at a recovery point whose lease lapsed at least ``lapsed_for`` seconds ago and that nobody
    has resumed, oldest lapse first, at most ``limit`` (``idempotency-mw stalled``). It reads every recovery point:
    an operator's command, not a request's."""
    sql = queries(store.schema)["stalled"]
    async with store.connector.session() as connection:
        with reachable(store.schema):
            rows = await connection.fetch(sql, float(lapsed_for), limit, timeout=store.timeout)
    return [StalledRequest(**dict(row)) for row in rows]


PointCursor = tuple[str, str, datetime, str]  # (tenant, key, life, step): where a re-sealing batch ended
_START: PointCursor = ("", "", datetime.fromtimestamp(0, UTC), "")


@dataclass(frozen=True, slots=True)
class ResealedResults:
    """One batch of re-sealing step results (:func:`reseal_step_results`): how many were re-sealed under the current
    key, those that could not be opened (``(tenant, key, why)``, left as they are), and where the next batch starts
    (None once every result was looked at)."""

    resealed: int
    unreadable: list[tuple[str, str, str]]
    after: PointCursor | None


async def reseal_step_results(
    store: Tables, *, batch_size: int, seal_plain: bool, after: PointCursor | None
) -> ResealedResults:
    """Re-seal up to ``batch_size`` step results under the cipher's current key, as ``PostgresStore.reencrypt`` does
    responses: one transaction that locks them (``reseal_points_batch``), opens and seals them here, and writes them
    back (``reseal_points``), safe beside live traffic. A result that does not open is left as it is and reported."""
    cipher, sql = store.cipher, queries(store.schema)
    if cipher is None:
        raise ValueError("re-sealing step results needs a PostgresStore with a cipher: PostgresStore(..., cipher=...)")
    older = [key_id for key_id in cipher.key_ids if key_id != cipher.current]
    resealed: list[tuple[str, str, datetime, str, bytes]] = []
    unreadable: list[tuple[str, str, str]] = []
    async with store.connector.session() as connection:
        with reachable(store.schema):
            async with connection.transaction(isolation="read_committed"):
                rows = await connection.fetch(
                    sql["reseal_points_batch"], *(after or _START), after is None, older, seal_plain, batch_size,
                    timeout=store.timeout,
                )  # fmt: skip
                for row in rows:
                    tenant, key, step = row["tenant"], row["key"], row["step"]
                    try:
                        if row["sealed"] is None:
                            result = row["result"].encode()
                        else:
                            result = cipher.open_step(tenant, key, step, row["sealed_with"], bytes(row["sealed"]))
                    except SealedResponseError as error:
                        unreadable.append((tenant, key, f"step {step!r}: {error}"))
                        continue
                    resealed.append((tenant, key, row["life"], step, cipher.seal_step(tenant, key, step, result)[1]))
                if resealed:
                    columns = [list(column) for column in zip(*resealed, strict=True)]
                    await connection.execute(sql["reseal_points"], cipher.current, *columns, timeout=store.timeout)
    last = rows[-1] if len(rows) == batch_size else None
    cursor = None if last is None else (last["tenant"], last["key"], last["life"], last["step"])
    return ResealedResults(len(resealed), unreadable, cursor)


async def step_results_by_key(store: Tables) -> dict[str | None, int]:
    """How many step results are sealed under each key id (None: stored plain); one scan of the table."""
    async with store.connector.session() as connection:
        with reachable(store.schema):
            rows = await connection.fetch(queries(store.schema)["points_by_key"], timeout=store.timeout)
    return {row["sealed_with"]: row["results"] for row in rows}
