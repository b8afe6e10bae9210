"""The store's records as its statements write and read them, and the claims it has handed out until they settle;
what the database's answers mean (rows, and the errors that mean it cannot be reached).

:class:`Records` is what a store and the transactions it lends share: the statements of ``sql/queries.sql`` in the
store's schema, the claim (up to three statements, the first that answers), a completion's arguments, the rows read
back, and the claims handed out and not yet settled (the store's ``close`` gives them a grace; settling one wakes
the requests that wait for it in this process).

A response is stored plain (``status``, ``headers``, ``body``) or, by a store with a cipher, sealed (``sealed``,
under the key ``sealed_with``; ``idempotency_mw.encryption``); ``body_size`` is kept either way. A sealed one is
read back with the cipher that has its key; a plain one under a cipher only if the cipher allows plain responses.
The headers go to their jsonb column as JSON text and come back as text (sql/queries.sql), whatever JSON codec the
connection has.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import struct
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

import asyncpg

from idempotency_mw._waiting import Waiters
from idempotency_mw.postgres._sql import queries
from idempotency_mw.store import (
    Claim,
    ClaimOutcome,
    PlainResponseRefused,
    RecordInfo,
    ResealedBatch,
    SealedResponse,
    SealedResponseError,
    StoredResponse,
    StoreNotMigrated,
    StoreUnavailable,
    UnknownKeyId,
    decode_headers,
    encode_headers,
)

if TYPE_CHECKING:
    from idempotency_mw.encryption import ResponseCipher

logger = logging.getLogger("idempotency_mw")

Run = Callable[[str, tuple[Any, ...]], Awaitable[Any]]  # one statement by name and arguments: its first row

# What "the store cannot be reached" looks like from asyncpg: connection failures, a server shutting down,
# deadlines. Errors in our own SQL surface as they are, except a missing table (see NOT_MIGRATED).
# A lost COMMIT (TransactionResolutionUnknownError, SQLSTATE 08007) is among them: the retry then finds the record
# completed (and replays) or gone (and runs), so answering 503 and releasing the key is right either way.
UNAVAILABLE = (
    OSError,
    TimeoutError,
    asyncpg.exceptions.PostgresConnectionError,  # SQLSTATE class 08, connection lost or refused
    asyncpg.exceptions.InterfaceError,  # "connection is closed", a closed pool, an operation on a lost connection
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.CrashShutdownError,
    asyncpg.exceptions.TooManyConnectionsError,
    asyncpg.exceptions.QueryCanceledError,
    # A statement sent on a connection whose server process was just terminated (pg_terminate_backend, a
    # failover): the server's FATAL error has arrived but the socket is not closed yet, and asyncpg, still in the
    # middle of that error, refuses the statement with "cannot switch to state 11; another operation (2) is in
    # progress". asyncpg raises this class for any client state it did not expect; a connection that saw it is
    # closed, never reused, so a retry runs on a fresh one.
    asyncpg.exceptions.InternalClientError,
)

# What "the store's tables are not there" looks like: a table or sequence (42P01) or the schema itself (3F000)
# does not exist. The store's statements name nothing else, so this means "not migrated" (or the wrong schema).
NOT_MIGRATED = (asyncpg.exceptions.UndefinedTableError, asyncpg.exceptions.InvalidSchemaNameError)


def caused_by(error: BaseException, types: tuple[type[BaseException], ...]) -> bool:
    """Whether ``error`` or an error it was raised from is one of ``types`` (SQLAlchemy wraps the driver's)."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, types):
            return True
        cause = cause.__cause__
    return False


@contextlib.contextmanager
def reachable(schema: str | None = None) -> Iterator[None]:
    """Turn "the database cannot be reached" (see ``UNAVAILABLE``) into :class:`StoreUnavailable` and, around the
    store's own statements in ``schema``, "the tables are missing" into :class:`StoreNotMigrated`; let the rest be.
    """
    try:
        yield
    except UNAVAILABLE as error:
        raise StoreUnavailable(str(error) or type(error).__name__) from error
    except NOT_MIGRATED as error:
        if schema is None:
            raise
        raise StoreNotMigrated(schema, str(error)) from error


async def run_unprepared(
    connection: asyncpg.Connection, sql: str, args: tuple[Any, ...], deadline: float, status: bool, explicit: bool
) -> Any:
    """A statement by its text (asyncpg's statement cache, if any, prepares it), in a READ COMMITTED transaction of
    its own when ``explicit``: its first row, or with ``status`` its status; ``deadline``: seconds it may take."""
    if explicit:
        async with connection.transaction(isolation="read_committed"):
            return await run_unprepared(connection, sql, args, deadline, status, False)
    if status:
        return await connection.execute(sql, *args, timeout=deadline)
    return await connection.fetchrow(sql, *args, timeout=deadline)


class Replays:
    """The replays of a store's records since they were last written: a replay writes nothing, and the counts go to
    their table now and then (``count_replays``, which also sets the time of the last replay, to within that
    interval), so ``inspect`` can say how often, and about when last, a response was replayed. Each count is of one
    life of its record (the ``created_at`` the claim returned). A crash loses the counts not yet written; so does a
    batch the database refuses (a role whose grant was revoked), which is logged: kept, it would be refused again."""

    CHUNK = 1000  # records a statement writes: a batch of many is written in short statements, each within timeout
    KEPT = 100_000  # records whose counts are kept through failed batches; beyond, they are dropped and logged

    def __init__(self) -> None:
        self._counted: dict[tuple[str, str, datetime.datetime], int] = {}
        self._writing: asyncio.Task[None] | None = None  # writes them every few seconds, while the store is open

    def count(self, tenant: str, key: str, life: datetime.datetime) -> None:
        counted = self._counted
        counted[tenant, key, life] = counted.get((tenant, key, life), 0) + 1

    async def write(self, run: Run) -> None:
        """The counts so far, in ``count_replays`` statements of at most ``CHUNK`` records. Those not written are
        kept for the next time if the database could not be reached or did not answer in time, rolled a statement
        back (a deadlock, a lock timeout), is read-only for now (a failover), or the write was cancelled; lost if it
        refused them (a missing grant, a bad value), and the error raised."""
        taken, self._counted = list(self._counted.items()), {}
        for start in range(0, len(taken), self.CHUNK):
            chunk = taken[start : start + self.CHUNK]
            try:
                await run("count_replays", columns(chunk))
            except BaseException as error:
                if not refused(error):
                    self._give_back(taken[start:])
                raise

    def _give_back(self, taken: list[tuple[tuple[str, str, datetime.datetime], int]]) -> None:
        """Counts whose statement failed: counted again with whatever came since, up to ``KEPT`` records."""
        counted = self._counted
        dropped = 0
        for record, replays in taken:
            if record in counted or len(counted) < self.KEPT:
                counted[record] = counted.get(record, 0) + replays
            else:
                dropped += 1
        if dropped:
            logger.error(
                "idempotency replay counts of %d records dropped: %d kept already, unwritten", dropped, len(counted)
            )

    def start(self, run: Run, every: float) -> None:
        """Write the counts every ``every`` seconds from now on (an outage: counted again next time)."""
        if self._writing is None or self._writing.done():
            self._writing = asyncio.create_task(self._keep_writing(run, every), name="idempotency replays")

    async def stop(self, run: Run) -> None:
        """No more writing every few seconds: write what is counted once more (lost if the database is gone or
        refuses them)."""
        if self._writing is not None:
            self._writing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writing
            self._writing = None
        await self._write_or_log(run)

    async def _keep_writing(self, run: Run, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            await self._write_or_log(run)

    async def _write_or_log(self, run: Run) -> None:
        try:
            await self.write(run)
        except StoreUnavailable:
            pass  # kept for the next batch; the requests meet the outage too
        except Exception as error:  # a background batch: its error is the log's, not a request's
            if refused(error):
                logger.error("idempotency replay counts not written, and dropped: %r", error)
            else:
                logger.warning("idempotency replay counts not written, kept for the next batch: %r", error)


def columns(
    counts: list[tuple[tuple[str, str, datetime.datetime], int]],
) -> tuple[list[str], list[str], list[datetime.datetime], list[int]]:
    """Counts as the four arrays of ``count_replays``."""
    return (
        [tenant for (tenant, _, _), _ in counts],
        [key for (_, key, _), _ in counts],
        [life for (_, _, life), _ in counts],
        [replays for _, replays in counts],
    )


# SQLSTATE classes of an error the database would raise again for the same statement: a data exception (22), an
# integrity constraint (23), a syntax error or access rule violation (42: a missing grant). Any other error of a
# replay count (an outage, a timeout, a rollback, a server read-only during a failover) keeps the counts.
REFUSING = ("22", "23", "42")


def refused(error: BaseException) -> bool:
    """Whether the database refused the statement, and would refuse it again."""
    sqlstate = getattr(error, "sqlstate", None)
    return isinstance(error, asyncpg.PostgresError) and isinstance(sqlstate, str) and sqlstate[:2] in REFUSING


class Records:
    """The records of one store: its statements, its cipher, and its claims until they settle."""

    def __init__(self, schema: str, *, timeout: float, cipher: ResponseCipher | None) -> None:
        self.schema = schema
        self.timeout = timeout
        self.cipher = cipher
        self.sql = queries(schema)
        self.waiters = Waiters()  # requests waiting for a claim of another's to settle (on_conflict="wait")
        self.closing = False  # the store is closing: no new claims
        self.replays = Replays()  # counted here, written in batches (count_replays)
        self._unsettled: set[tuple[str, str, int]] = set()
        self._all_settled: asyncio.Event | None = None  # set when the last one settles while the store closes

    async def claim(
        self,
        run: Run,
        tenant: str,
        key: str,
        fingerprints: tuple[bytes, ...],
        *,
        lease: float,
        ttl: float,
        flush: bool,
        request: str | None = None,
        parts: bytes | None = None,
    ) -> Claim:
        """The claim of ``(tenant, key)`` by ``run`` (``sql/queries.sql``: ``claim``, then ``claim_or_take_over``
        when it answers nothing, then ``claim_locked`` after a race). Without ``flush`` (a transactional request's)
        it commits without waiting for its WAL flush, which the handler's COMMIT does for it: never for a claim whose
        effect is outside the database, which a crash could then lose after the effect ran."""
        if self.closing:
            raise StoreUnavailable("the idempotency store is closing: it takes no new claims")
        # max: a record never expires under a live lease (sql/queries.sql, renew)
        lease, ttl, synchronous_commit = float(lease), float(max(ttl, lease)), None if flush else "off"
        args = (tenant, key, fingerprints, lease, ttl, new_fence(), synchronous_commit, request, parts)
        row = await run("claim", args)  # a fresh key, a replay, a 409 or a 422
        if row is None:  # an expired record or a lapsed lease to take over, or a race
            row = await run("claim_or_take_over", args)
        if row is None:  # lost a race with a concurrent claim of the key: lock and look again
            row = await run("claim_locked", args)
            assert row is not None  # INSERT … ON CONFLICT DO UPDATE … RETURNING always returns the row
        claim = claim_from_row(row, tenant, key, self.cipher)
        if claim.outcome is ClaimOutcome.OWNED:
            self._unsettled.add((tenant, key, claim.fence))
        elif claim.outcome is ClaimOutcome.COMPLETED:
            self.replays.count(tenant, key, row["life"])
        return claim

    async def reseal(
        self,
        connection: asyncpg.Connection,
        batch_size: int,
        seal_plain: bool,
        after: tuple[str, str] | None,
        batch_bytes: int,
    ) -> ResealedBatch:
        """One batch of ``PostgresStore.reencrypt`` on ``connection``, in one transaction: the rows locked
        (``reseal_batch``: ``batch_size`` rows, and no more than ``batch_bytes`` of responses past the first), opened
        and sealed under the cipher's current key here, and written back (``reseal``)."""
        cipher, sql, timeout = self.cipher, self.sql, self.timeout
        assert cipher is not None
        older = [key_id for key_id in cipher.key_ids if key_id != cipher.current]
        start, first = after or ("", ""), after is None
        async with connection.transaction(isolation="read_committed"):
            rows = await connection.fetch(
                sql["reseal_batch"], *start, first, older, seal_plain, batch_size, batch_bytes, timeout=timeout
            )
            resealed, unreadable = reseal_rows(rows, cipher)
            if resealed[0]:
                await connection.execute(sql["reseal"], cipher.current, *resealed, timeout=timeout)
        # More to look at: a full batch of rows, or one the byte bound cut short of the rows it locked.
        more = bool(rows) and (rows[0]["locked"] == batch_size or len(rows) < rows[0]["locked"])
        last = (rows[-1]["tenant"], rows[-1]["key"]) if more else None
        return ResealedBatch(len(resealed[0]), unreadable, last)

    def completion(self, tenant: str, key: str, fence: int, response: StoredResponse) -> tuple[Any, ...]:
        """The arguments of ``complete`` and ``complete_in_transaction``: the response plain (its headers as JSON
        text, which the statements cast to jsonb), or sealed by the cipher (then nothing of it is readable in the
        row but its body's size)."""
        if self.cipher is None:
            headers = encode_headers(response.headers)
            return (tenant, key, fence, response.status, headers, response.body, response.body_size, None, None)
        sealed = self.cipher.seal(tenant, key, response)
        return (tenant, key, fence, None, None, None, response.body_size, sealed.sealed, sealed.key_id)

    def settled(self, tenant: str, key: str, fence: int) -> None:
        """A claim of this store was completed or released (or fenced out, or its attempt failed): the store's close
        waits no longer on its behalf, and the requests in this process that wait for it are woken."""
        self._unsettled.discard((tenant, key, fence))
        if not self._unsettled and self._all_settled is not None:
            self._all_settled.set()
        if self.waiters.events:  # someone waits in this process
            self.waiters.wake(fence)

    async def all_settled(self, grace: float) -> None:
        """Return once every claim handed out has settled, or after ``grace`` seconds."""
        if self._unsettled:
            self._all_settled = asyncio.Event()
            try:
                async with asyncio.timeout(grace):
                    await self._all_settled.wait()
            except TimeoutError:
                pass

    def reopened(self) -> None:
        """A closed store opens again: on new connections, without the claims of before the close (they had their
        grace then)."""
        self.closing = False
        self._unsettled.clear()
        self._all_settled = None

    def notice(self, tenant: str, key: str, fence: int, prepared: str | None = None) -> str:
        """The SQL that tells the waiters of a record in other processes that its claim under ``fence`` settled, if
        it had duplicates (``notify_waiters``): for after a COMMIT, in the round trip of the reset of the connection
        that committed, so its values are written in. ``prepared`` names the statement as prepared on that
        connection, which then runs with EXECUTE. The tenant and the key go as hex-encoded UTF-8, the fence as a
        number: no text of a client's is ever quoted. Decoded, they carry the collation of convert_from's encoding
        name ("C"), which the primary key cannot serve: COLLATE "default", the columns' own, keeps the statement
        written in a look-up by the key, not a scan of the table."""
        values = (
            f"pg_catalog.convert_from(pg_catalog.decode('{tenant.encode().hex()}', 'hex'), 'UTF8')",
            f"pg_catalog.convert_from(pg_catalog.decode('{key.encode().hex()}', 'hex'), 'UTF8')",
            str(int(fence)),
        )
        if prepared is not None:
            return f'EXECUTE "{prepared}"({", ".join(values)});'
        tenant_value, key_value, fence_value = values
        return (
            self.sql["notify_waiters"]
            .replace("$1", f'{tenant_value} COLLATE "default"')
            .replace("$2", f'{key_value} COLLATE "default"')
            .replace("$3", fence_value)
        )


def new_fence() -> int:
    """A claim's fence: a random positive 63-bit token. Only equality is ever asked of fences, so what they need is
    to be unique per claim of a key, also across a restore or a failover, which a sequence cannot promise."""
    return int.from_bytes(os.urandom(8)) >> 1 or 1


def claim_from_row(row: asyncpg.Record, tenant: str, key: str, cipher: ResponseCipher | None = None) -> Claim:
    """The answer of the claim statements for ``(tenant, key)``."""
    attempts = row["attempts"]
    if row["owned"]:
        return Claim(ClaimOutcome.OWNED, fence=row["fence"], attempts=attempts, expires_at=row["expires_at"])
    if not row["same_request"]:
        unkeyed, parts = row["unkeyed"], row["parts"]
        return Claim(
            ClaimOutcome.MISMATCH,
            attempts=attempts,
            unkeyed=None if unkeyed is None else bytes(unkeyed),
            parts=None if parts is None else bytes(parts),
        )
    if not row["completed"]:
        return Claim(ClaimOutcome.IN_PROGRESS, fence=row["fence"], attempts=attempts)
    response = response_from_row(row, tenant, key, cipher)
    return Claim(ClaimOutcome.COMPLETED, response=response, attempts=attempts, expires_at=row["expires_at"])


def response_from_row(
    row: asyncpg.Record, tenant: str, key: str, cipher: ResponseCipher | None, *, resealing: bool = False
) -> StoredResponse:
    """The stored response of a row that has one (its headers as the JSON text the statements read, never a
    decoded jsonb value): as stored, or opened by ``cipher``. A sealed one without a cipher that has its key raises
    :class:`UnknownKeyId`, naming the key; a plain one under a cipher that does not allow plain responses raises
    :class:`PlainResponseRefused` (unless ``resealing``: reencrypt reads it to seal it)."""
    sealed = row["sealed"]
    if sealed is None:
        if cipher is not None and not cipher.allow_plain and not resealing:
            raise PlainResponseRefused()
        return StoredResponse(row["status"], decode_headers(row["headers"]), row["body"], row["body_size"])
    stored = SealedResponse(row["sealed_with"], bytes(sealed), row["body_size"])
    if cipher is None:
        raise UnknownKeyId(stored.key_id, ())
    return cipher.open(tenant, key, stored)


def record_from_row(row: asyncpg.Record, cipher: ResponseCipher | None = None) -> RecordInfo:
    """The answer of the ``inspect`` statement."""
    response = None
    if row["state"] == "completed":
        response = response_from_row(row, row["tenant"], row["key"], cipher)
    return RecordInfo(
        tenant=row["tenant"],
        key=row["key"],
        state=row["state"],
        fence=row["fence"],
        fingerprint=bytes(row["fingerprint"]),
        attempts=row["attempts"],
        created_at=row["created_at"],
        expires_at=row["expires_at"],
        lease_expires_at=row["lease_expires_at"],
        response=response,
        sealed_with=row["sealed_with"],
        request=row["request"],
        replays=row["replays"],
        last_replayed_at=row["last_replayed_at"],
        last_step=row["last_step"],
        parts=None if row["request_parts"] is None else bytes(row["request_parts"]),
    )


def reseal_rows(
    rows: list[asyncpg.Record], cipher: ResponseCipher
) -> tuple[tuple[list[str], list[str], list[bytes]], list[tuple[str, str, str]]]:
    """The ``reseal_batch`` rows sealed again under the cipher's current key, as the ``reseal`` statement's three
    arrays (tenants, keys, sealed), and those that do not open: ``(tenant, key, why)``. A plain row that no store
    wrote (headers that are not a list of pairs, a status out of range: written by hand) is one of those too, so
    that it stops neither the batch nor every run after it."""
    resealed: tuple[list[str], list[str], list[bytes]] = ([], [], [])
    unreadable: list[tuple[str, str, str]] = []
    for row in rows:
        tenant, key = row["tenant"], row["key"]
        try:
            sealed = cipher.seal(tenant, key, response_from_row(row, tenant, key, cipher, resealing=True)).sealed
        except SealedResponseError as error:
            unreadable.append((tenant, key, str(error)))
            continue
        except (ValueError, TypeError, AttributeError, struct.error) as error:  # only a plain row gets here
            unreadable.append((tenant, key, f"not a response a store wrote: {error}"))
            continue
        resealed[0].append(tenant)
        resealed[1].append(key)
        resealed[2].append(sealed)
    return resealed, unreadable
