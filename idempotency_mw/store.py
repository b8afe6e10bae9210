"""The contract every store keeps; the middleware talks to nothing else.

A record is identified by ``(tenant, key)``. ``claim`` is the only entry point and answers in one step: the caller
now owns the key (with a fresh fence token), or the record already exists and is completed, in progress, or was
made by a different request. Every later write names the fence, so a worker whose claim was taken over can change
nothing.
"""

from __future__ import annotations

import enum
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import orjson

Headers = list[tuple[bytes, bytes]]


def encode_headers(headers: Headers) -> str:
    """A response's header list as stores keep it: JSON ``[[name, value], …]``; latin-1 keeps every byte, so the
    round trip is exact."""
    return orjson.dumps([[name.decode("latin-1"), value.decode("latin-1")] for name, value in headers]).decode()


def decode_headers(encoded: str | bytes) -> Headers:
    """The header list back from its JSON text. The PostgreSQL stores read the column as text (``headers::text``,
    sql/queries.sql), never as a jsonb value, which a connection's JSON codec would decode (a SQLAlchemy engine's
    connections have one, and so may an app's asyncpg pool). A JSON string holding that text is the list encoded
    twice, as a connection's JSON codec wrote it when the statements passed the headers as a jsonb value (before
    they cast the text in SQL): such a record, stored before, replays too instead of failing until it expires."""
    pairs = orjson.loads(encoded)
    if isinstance(pairs, str):  # encoded twice (a header list is always a JSON array)
        pairs = orjson.loads(pairs)
    return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in pairs]


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A response as the client first received it. ``body`` is None when it was not
    stored in full: over the storage cap, or cut short before it finished (``body_size`` is what went out)."""

    status: int
    headers: Headers
    body: bytes | None
    body_size: int

    def unreplayable(self) -> StoredResponse:
        """What is kept of a response the store cannot hold as it is: the status and size, no headers, no body."""
        return StoredResponse(self.status, [], None, self.body_size)


@dataclass(frozen=True, slots=True)
class SealedResponse:
    """A :class:`StoredResponse` as a store with a cipher keeps it (``idempotency_mw.encryption``): status, headers
    and body sealed together in ``sealed``, under the operator's key ``key_id``. Only ``body_size`` stays readable:
    the ciphertext's length tells it anyway."""

    key_id: str
    sealed: bytes
    body_size: int


class ClaimOutcome(enum.Enum):
    OWNED = "owned"  # fresh, or taken over from an expired record or a lapsed lease
    COMPLETED = "completed"  # same request, finished: replay ``response``
    IN_PROGRESS = "in_progress"  # same request, still running under a live lease
    MISMATCH = "mismatch"  # a different request already used this key


@dataclass(frozen=True, slots=True)
class Claim:
    outcome: ClaimOutcome
    # OWNED: ours; IN_PROGRESS: the running claim's, whose settlement a waiter waits for, or 0 when the request runs
    # under no claim of the store's (a cutover's earlier package runs it): nothing to wait for. Fences are never 0.
    fence: int = 0
    response: StoredResponse | None = None  # only when COMPLETED
    attempts: int = 0  # requests that came with this key after the first (retries, conflicts, mismatches)
    # MISMATCH only: the record's fingerprint when it is a bare SHA-256, written before fingerprints were keyed; the
    # caller compares it with the request's own digest, and claims again with it among ``matching`` if they agree.
    unkeyed: bytes | None = None
    # OWNED and COMPLETED: when the record expires (epoch seconds), as the store wrote it (a lease taken over keeps the
    # record's expiry); sent to the client as Idempotency-Expires. None from a store that does not tell: no header.
    expires_at: float | None = None
    # MISMATCH only: the record's request parts (keyed digests, ``parts=`` of the claim that wrote it), when it has
    # them and they were written with its fingerprint; the caller compares them with its own to say what changed.
    parts: bytes | None = None


@dataclass(frozen=True, slots=True)
class RecordInfo:
    """What ``inspect`` shows of a record (never the request body, which is not stored)."""

    tenant: str
    key: str
    state: str
    fence: int
    fingerprint: bytes
    attempts: int
    created_at: float
    expires_at: float
    lease_expires_at: float | None
    response: StoredResponse | None
    sealed_with: str | None = None  # the id of the key its response is sealed under; None when stored plain
    request: str | None = None  # the request's method and route template; None for a record written before 0003
    replays: int = 0  # replays of its response written so far (counted in batches: the last seconds' may be missing)
    last_replayed_at: float | None = None  # within the batch interval (PostgresStore: 5 s) of the last replay
    last_step: str | None = None  # the last recovery point of a request that runs in steps (docs/design.md §10)
    parts: bytes | None = None  # its request parts, keyed digests (explain_mismatch); None when none were written


@dataclass(frozen=True)
class RecordLine:
    """One record as ``idempotency-mw list`` shows it: no fingerprint, no body, and the status only when the response
    is stored plain (a sealed one shows ``sealed_with``)."""

    key: str
    request: str | None
    state: str
    attempts: int
    replays: int
    created_at: float
    expires_at: float
    status: int | None
    sealed_with: str | None
    body_size: int | None


@dataclass(frozen=True, slots=True)
class RecoveryPoint:
    """A step of a request that runs in steps, as its recovery point keeps it (docs/design.md §10): its name, the
    order the request reached it in, and its result as JSON text; ``result`` is None for an unrepeatable outside
    step that began and whose outcome is unknown."""

    step: str
    position: int
    result: bytes | None


@dataclass(frozen=True, slots=True)
class StalledRequest:
    """A request stopped at a recovery point that nobody resumes (``idempotency-mw stalled``): in progress under a
    lapsed lease, with the last step it reached (``last_step_done`` False: an unrepeatable outside step that began
    and whose outcome is unknown)."""

    tenant: str
    key: str
    request: str | None
    last_step: str
    last_step_done: bool
    created_at: float
    lapsed_at: float
    expires_at: float


class StoreUnavailable(Exception):
    """The store could not be reached or did not answer in time."""


class PoolExhausted(StoreUnavailable):
    """No connection of the store's pool came free within ``timeout``: every one was busy. Unlike a database that
    cannot be reached, the usual fix is on the app's side: raise the pool's ``max_size`` (or hold connections for
    less time). ``pool`` says which pool: the store's own, an asyncpg pool the app passed in, or the SQLAlchemy
    engine's; ``knob`` names the setting that sizes it."""

    def __init__(self, pool: str, *, max_size: int, timeout: float, knob: str = "max_size") -> None:
        super().__init__(
            f"{pool} is exhausted: no connection came free within {timeout:g}s (max_size={max_size}). "
            f"If the database answers promptly, the pool is too small for the load: raise {knob}"
        )
        self.pool = pool
        self.max_size = max_size
        self.timeout = timeout


class TransactionEnded(RuntimeError):
    """A transactional handler ended the transaction it was lent (a COMMIT or ROLLBACK of its own): its effect and
    the record can no longer land together, so the record is refused and the request fails like a handler error.
    Statements that may need undoing belong in a savepoint (asyncpg: ``async with connection.transaction():``;
    SQLAlchemy: ``async with session.begin_nested():``)."""

    @classmethod
    def by_the_handler(cls, lent: str, savepoint: str) -> TransactionEnded:
        """The error for a handler that ended the transaction through ``lent``; ``savepoint`` shows the way instead."""
        return cls(
            f"the handler ended the idempotency transaction itself (COMMIT or ROLLBACK on the lent {lent}, or a "
            "RESET ALL, which clears the store's mark of its transaction), so its "
            "effect and the record cannot land together; the record was refused and the key is free again. Run "
            f"statements that may need undoing in a savepoint: {savepoint}"
        )


class StoreNotMigrated(StoreUnavailable):
    """The store's tables are not in the database: it was never migrated, or the store looks in another schema
    than the one that was. The message names the schema and the command that fixes it."""

    def __init__(self, schema: str, detail: str = "") -> None:
        option = "" if schema == "public" else f" --schema {schema}"
        super().__init__(
            f'the idempotency tables are missing from schema "{schema}" of this database'
            + (f" ({detail})" if detail else "")
            + f": run `idempotency-mw{option} migrate`, or `await store.migrate()` before `store.open()`"
        )
        self.schema = schema


class StoreNotGranted(StoreUnavailable):
    """The store's role lacks privileges its statements need on the store's tables or function: typically grants
    that name the tables one by one, given before a migration added one. The message names what is missing and the
    GRANT that gives it."""

    def __init__(self, schema: str, missing: list[str]) -> None:
        function = "idempotency_settled(text, text, timestamptz)"
        tables = [entry.split(":")[0] for entry in missing if not entry.startswith(function)]
        fixes = []
        if tables:
            fixes.append(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {', '.join(tables)} TO <its role>")
        if len(tables) < len(missing):  # the function is missing too
            fixes.append(f"GRANT EXECUTE ON FUNCTION {function} TO <its role>")
        super().__init__(
            f'the idempotency store\'s role lacks privileges it needs in schema "{schema}": {"; ".join(missing)}. '
            f"As the tables' owner, in that schema: {'; '.join(fixes)} (docs/operations.md, the runtime role's grants)"
        )
        self.schema = schema
        self.missing = missing


class SealedResponseError(Exception):
    """A stored response is sealed (``idempotency_mw.encryption``) and cannot be opened: it was changed or moved to
    another record since it was sealed, or it is sealed under a key the store was not given (:class:`UnknownKeyId`).
    The record stays as it is: neither replayed nor run again. The middleware answers its retries 503, like any
    store failure, and logs this message."""


class UnknownKeyId(SealedResponseError):
    """A stored response is sealed under a key id the store's cipher does not have (or the store has no cipher)."""

    def __init__(self, key_id: str, known: tuple[str, ...]) -> None:
        if known:
            given = f"this store's cipher has only {', '.join(repr(k) for k in known)}"
        else:
            given = "this store has no cipher (PostgresStore(..., cipher=ResponseCipher.from_env()))"
        super().__init__(
            f"the stored response is sealed under key id {key_id!r}, and {given}: give the store that key again "
            "(IDEMPOTENCY_RESPONSE_KEYS), and keep it until `idempotency-mw reencrypt` has re-sealed every response "
            "under it"
        )
        self.key_id = key_id


class PlainResponseRefused(SealedResponseError):
    """A stored response is plain while the store seals every response it writes (it has a cipher): it was written
    by someone who holds no key (a role that can write the table), or before encryption was turned on. Refused
    unless the cipher allows plain responses (``ResponseCipher(..., allow_plain=True)``, until ``idempotency-mw
    reencrypt --seal-plain`` has sealed them)."""

    def __init__(self) -> None:
        super().__init__(
            "the stored response is plain, but this store seals every response it writes: a plain one was not "
            "written by it, or was written before encryption was turned on. It is refused rather than replayed; if "
            "responses were stored plain before encryption, give the cipher allow_plain=True until `idempotency-mw "
            "reencrypt --seal-plain` has sealed them"
        )


@dataclass(frozen=True, slots=True)
class ResealedBatch:
    """One batch of a re-encryption (``PostgresStore.reencrypt``): how many responses were re-sealed under the
    current key, those that could not be opened (``(tenant, key, why)``, left as they are), and where the next batch
    starts (None once every response was looked at)."""

    resealed: int
    unreadable: list[tuple[str, str, str]]
    after: tuple[str, str] | None


class Subscription(Protocol):
    """A subscription to the settlement of one claim (:meth:`Store.watch`)."""

    async def wait(self, within: float) -> None:
        """Return once the claim has settled, or after ``within`` seconds."""


@runtime_checkable
class Store(Protocol):
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
        """Insert an ``in_progress`` record or report the existing one, atomically, in one round trip.
        ``fingerprint`` is what a new record holds; a record holding it or any of ``matching`` (the request's
        fingerprint under previous keys) is the same request. ``request`` (its method and route template) and
        ``parts`` (its parts as keyed digests, from a route that explains a mismatch) are written with a new record,
        and a different request's answer carries the record's ``parts``; a store keeps them as opaque bytes."""

    async def renew(self, tenant: str, key: str, fence: int, *, lease: float) -> bool:
        """Extend the lease of a claim still held under ``fence``; False if it was taken over."""

    async def complete(self, tenant: str, key: str, fence: int, response: StoredResponse) -> bool:
        """Store the response of a claim still held under ``fence``; False if it was taken over."""

    async def release(self, tenant: str, key: str, fence: int) -> bool:
        """Delete a claim still held under ``fence`` so that a retry runs afresh."""

    async def forget(self, tenant: str, key: str) -> bool:
        """Delete the record whatever its state (operator action, or the resource it names was deleted)."""

    async def inspect(self, tenant: str, key: str) -> RecordInfo | None:
        """The record as stored, expired or not."""

    async def purge_expired(self, *, batch_size: int = 1000) -> int:
        """Delete up to ``batch_size`` expired records; return how many went."""

    def watch(self, fence: int) -> AbstractAsyncContextManager[Subscription]:
        """Subscribe to the settlement of the claim under ``fence`` (the one a claim answered ``IN_PROGRESS`` with):
        completed, released or taken over, here or in another process. Subscribed once the block is entered, so a
        caller checks the claim again inside it, then waits; without polling, and without holding a connection
        meanwhile (``_waiting.py``)."""

    async def close(self) -> None:
        """Release resources the store opened itself."""


class Transaction(Protocol):
    """A connection lent to one transactional request: the key is claimed on it (committed at once, so that a
    concurrent duplicate sees the claim), then a transaction begins on it, the handler writes in that transaction,
    and the record completes in it."""

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
        """:meth:`Store.claim`, on this connection, before the transaction begins."""

    async def begin(self) -> None:
        """Begin the transaction the handler writes in (the database's default isolation level)."""

    async def complete(self, tenant: str, key: str, fence: int, response: StoredResponse) -> bool:
        """Write the response of a claim still held under ``fence``, inside this transaction; False if fenced out."""

    async def commit(self) -> None:
        """Commit. :class:`StoreUnavailable` if the database cannot be reached (the commit may or may not have
        landed); any other error is the database refusing it (a deferred constraint, an aborted transaction)."""

    async def rollback(self) -> None:
        """Roll back; :class:`StoreUnavailable` if the database cannot be reached."""


@runtime_checkable
class RecoveringTransaction(Transaction, Protocol):
    """A lent transaction that keeps recovery points (docs/design.md §10): what a handler that runs in steps needs."""

    async def recovery_points(self, tenant: str, key: str, fence: int) -> list[RecoveryPoint]:
        """The recovery points of the record's current life, in order, in this transaction (before its writes)."""

    async def record_steps(self, tenant: str, key: str, fence: int, points: list[RecoveryPoint]) -> bool:
        """Write ``points`` in this transaction, for a claim still held under ``fence``; False if fenced out."""

    async def lapse(self, tenant: str, key: str, fence: int) -> bool:
        """Outside a transaction, once the last one ended: leave a claim still held under ``fence`` at its recovery
        point, its lease lapsed now, so that the retry resumes at once; False if fenced out."""


@runtime_checkable
class TransactionalStore(Store, Protocol):
    """A store that can also lend connections for transactions: what transactional mode needs."""

    def transaction(self) -> AbstractAsyncContextManager[Transaction]:
        """A connection for one transactional request (:class:`StoreUnavailable` if none comes in time), given back
        with a clean session when the block ends."""
