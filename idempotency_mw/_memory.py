"""An in-process store with the PostgreSQL store's semantics, for tests and single-process development.

Records live in a dict; expired ones are swept as new claims arrive, so memory follows the live records, not
every key ever seen. Expiry times wait in a heap beside it, so a claim looks only at records whose time has come
(O(log n)), never at the live ones. The expiry of a record released or forgotten early waits there until its time,
unless such leftovers come to outnumber the live records: then the heap is rebuilt from the live records alone.
It shares nothing between processes: do not use it behind several workers. With a ``cipher`` it keeps responses
sealed, as PostgresStore does (``encryption.py``): for tests of an app that encrypts, and for a process whose memory
may be dumped.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from idempotency_mw._fingerprint import DIGEST_BYTES
from idempotency_mw._waiting import Waiters
from idempotency_mw.store import (
    Claim,
    ClaimOutcome,
    PlainResponseRefused,
    RecordInfo,
    SealedResponse,
    StoredResponse,
    Subscription,
    UnknownKeyId,
)

if TYPE_CHECKING:
    from idempotency_mw.encryption import ResponseCipher


@dataclass(slots=True)
class _Record:
    fingerprint: bytes
    fence: int
    created_at: float
    expires_at: float
    lease_expires_at: float | None
    response: StoredResponse | SealedResponse | None = None
    attempts: int = 0
    request: str | None = None
    replays: int = 0
    last_replayed_at: float | None = None
    parts: bytes | None = None


class MemoryStore:
    SPARE_EXPIRIES = 1024  # leftover expiries tolerated beyond two per live record before the heap is rebuilt

    def __init__(self, *, clock: Callable[[], float] = time.time, cipher: ResponseCipher | None = None) -> None:
        self.cipher = cipher
        self._records: dict[tuple[str, str], _Record] = {}
        # (expires_at, key) for every expiry a record was given; one that a record has outlived (its lease moved it
        # on, or the key was forgotten and claimed again) is passed over when its time comes.
        self._expiries: list[tuple[float, tuple[str, str]]] = []
        self._fences = itertools.count(1)
        self._clock = clock
        self._waiters = Waiters()

    def __len__(self) -> int:
        return len(self._records)

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
        now = self._clock()
        self._expire(now)
        record = self._records.get((tenant, key))
        if record is None or record.expires_at <= now:
            fence = next(self._fences)
            attempts = 0  # an expired record's attempts belong to the operation it recorded, not to this one
            # A record never expires under a live lease: renew and a takeover move expires_at past the lease.
            expires = now + max(ttl, lease)
            self._records[(tenant, key)] = _Record(
                fingerprint, fence, now, expires, now + lease, request=request, parts=parts
            )
            self._push(expires, (tenant, key))
            return Claim(ClaimOutcome.OWNED, fence=fence, attempts=attempts, expires_at=expires)
        same = record.fingerprint == fingerprint or record.fingerprint in matching
        if same and record.response is not None:
            # A replay is not an attempt; its count is inspect's (PostgreSQL writes it in batches, not per replay).
            record.replays += 1
            record.last_replayed_at = now
            response = self._opened(tenant, key, record.response)
            return Claim(
                ClaimOutcome.COMPLETED, response=response, attempts=record.attempts, expires_at=record.expires_at
            )
        record.attempts += 1
        attempts = record.attempts
        if not same:
            unkeyed = record.fingerprint if len(record.fingerprint) == DIGEST_BYTES else None
            return Claim(ClaimOutcome.MISMATCH, attempts=attempts, unkeyed=unkeyed, parts=record.parts)
        assert record.lease_expires_at is not None
        if record.lease_expires_at <= now:
            self._waiters.wake(record.fence)  # those who waited for the claim that lapsed wait for this one now
            record.fence = next(self._fences)
            record.lease_expires_at = now + lease
            self._extend(tenant, key, record)
            return Claim(ClaimOutcome.OWNED, fence=record.fence, attempts=attempts, expires_at=record.expires_at)
        return Claim(ClaimOutcome.IN_PROGRESS, fence=record.fence, attempts=attempts)

    def _held(self, tenant: str, key: str, fence: int) -> _Record | None:
        record = self._records.get((tenant, key))
        if record is None or record.fence != fence or record.response is not None:
            return None
        return record

    async def renew(self, tenant: str, key: str, fence: int, *, lease: float) -> bool:
        record = self._held(tenant, key, fence)
        if record is None:
            return False
        record.lease_expires_at = self._clock() + lease
        self._extend(tenant, key, record)
        return True

    async def complete(self, tenant: str, key: str, fence: int, response: StoredResponse) -> bool:
        record = self._held(tenant, key, fence)
        if record is None:
            return False
        if self.cipher is None:
            record.response = StoredResponse(response.status, list(response.headers), response.body, response.body_size)
        else:
            record.response = self.cipher.seal(tenant, key, response)
        record.lease_expires_at = None
        self._waiters.wake(fence)
        return True

    async def release(self, tenant: str, key: str, fence: int) -> bool:
        if self._held(tenant, key, fence) is None:
            return False
        del self._records[(tenant, key)]
        self._waiters.wake(fence)
        return True

    def watch(self, fence: int) -> contextlib.AbstractAsyncContextManager[Subscription]:
        return self._waiters.watch(fence)

    async def forget(self, tenant: str, key: str) -> bool:
        record = self._records.pop((tenant, key), None)
        if record is None:
            return False
        self._waiters.wake(record.fence)  # its waiters claim again, and the first runs
        return True

    async def inspect(self, tenant: str, key: str) -> RecordInfo | None:
        record = self._records.get((tenant, key))
        if record is None:
            return None
        return RecordInfo(
            tenant=tenant,
            key=key,
            state="in_progress" if record.response is None else "completed",
            fence=record.fence,
            fingerprint=record.fingerprint,
            attempts=record.attempts,
            created_at=record.created_at,
            expires_at=record.expires_at,
            lease_expires_at=record.lease_expires_at,
            response=None if record.response is None else self._opened(tenant, key, record.response),
            sealed_with=record.response.key_id if isinstance(record.response, SealedResponse) else None,
            request=record.request,
            replays=record.replays,
            last_replayed_at=record.last_replayed_at,
            parts=record.parts,
        )

    def _opened(self, tenant: str, key: str, response: StoredResponse | SealedResponse) -> StoredResponse:
        """A response as stored, or opened by the cipher (:class:`UnknownKeyId` without one that has its key)."""
        if isinstance(response, StoredResponse):
            if self.cipher is not None and not self.cipher.allow_plain:
                raise PlainResponseRefused()
            return response
        if self.cipher is None:
            raise UnknownKeyId(response.key_id, ())
        return self.cipher.open(tenant, key, response)

    async def purge_expired(self, *, batch_size: int = 1000) -> int:
        return self._expire(self._clock(), batch_size)

    async def close(self) -> None:
        self._records.clear()
        self._expiries.clear()

    def _extend(self, tenant: str, key: str, record: _Record) -> None:
        """A record never expires under a live lease: a renewal or a takeover moves expires_at past the lease."""
        assert record.lease_expires_at is not None
        if record.lease_expires_at > record.expires_at:
            record.expires_at = record.lease_expires_at
            self._push(record.expires_at, (tenant, key))

    def _push(self, expires_at: float, key: tuple[str, str]) -> None:
        """Note the expiry just given to the record at ``key``. Once leftovers (of records released, forgotten or
        extended) outnumber the live records, the heap is rebuilt from the live records instead, this one's new
        expiry included: memory follows the live records, at an amortised O(1) per claim."""
        if len(self._expiries) < 2 * len(self._records) + self.SPARE_EXPIRIES:
            heapq.heappush(self._expiries, (expires_at, key))
            return
        self._expiries = [(record.expires_at, live) for live, record in self._records.items()]
        heapq.heapify(self._expiries)

    def _expire(self, now: float, limit: int | None = None) -> int:
        """Delete the records expired by ``now``, oldest first, at most ``limit``; how many were deleted."""
        expiries, records = self._expiries, self._records
        deleted = 0
        while expiries and expiries[0][0] <= now and (limit is None or deleted < limit):
            _, key = heapq.heappop(expiries)
            record = records.get(key)
            if record is not None and record.expires_at <= now:
                del records[key]
                deleted += 1
        return deleted
