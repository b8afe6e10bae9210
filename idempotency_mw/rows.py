"""How the PostgreSQL stores write records and read them back: the claim's fence, the claim's answer row, the
arguments of a completion, and the header list as the ``headers`` column holds it.

A response is stored plain (``status``, ``headers``, ``body``) or, by a store with a cipher, sealed (``sealed``,
under the key ``sealed_with``; ``encryption.py``); ``body_size`` is kept either way. Either form is read back
whatever the store's cipher, so records written before encryption was turned on still replay."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import asyncpg
import orjson

from idempotency_mw.store import (
    Claim,
    ClaimOutcome,
    Headers,
    PlainResponseRefused,
    RecordInfo,
    SealedResponse,
    SealedResponseError,
    StoredResponse,
    UnknownKeyId,
)

if TYPE_CHECKING:
    from idempotency_mw.encryption import ResponseCipher


def new_fence() -> int:
    """A claim's fence: a random positive 63-bit token. Only equality is ever asked of fences, so what they need is
    to be unique per claim of a key, also across a restore or a failover, which a sequence cannot promise."""
    return int.from_bytes(os.urandom(8)) >> 1 or 1


def claim_from_row(row: asyncpg.Record, tenant: str, key: str, cipher: ResponseCipher | None = None) -> Claim:
    """The answer of the claim statements (``claim``, ``claim_or_take_over``, ``claim_locked`` in
    ``sql/queries.sql``) for ``(tenant, key)``."""
    attempts = row["attempts"]
    if row["owned"]:
        return Claim(ClaimOutcome.OWNED, fence=row["fence"], attempts=attempts)
    if not row["same_request"]:
        unkeyed = row["unkeyed"]
        return Claim(ClaimOutcome.MISMATCH, attempts=attempts, unkeyed=None if unkeyed is None else bytes(unkeyed))
    if not row["completed"]:
        return Claim(ClaimOutcome.IN_PROGRESS, fence=row["fence"], attempts=attempts)
    response = response_from_row(row, tenant, key, cipher)
    return Claim(ClaimOutcome.COMPLETED, response=response, attempts=attempts)


def completion(
    tenant: str, key: str, fence: int, response: StoredResponse, cipher: ResponseCipher | None = None
) -> tuple[Any, ...]:
    """The arguments of the ``complete`` and ``complete_in_transaction`` statements: the response plain, or sealed
    by ``cipher`` (then nothing of it is readable in the row but its body's size)."""
    if cipher is None:
        headers = encode_headers(response.headers)
        return (tenant, key, fence, response.status, headers, response.body, response.body_size, None, None)
    sealed = cipher.seal(tenant, key, response)
    return (tenant, key, fence, None, None, None, response.body_size, sealed.sealed, sealed.key_id)


def response_from_row(
    row: asyncpg.Record, tenant: str, key: str, cipher: ResponseCipher | None, *, resealing: bool = False
) -> StoredResponse:
    """The stored response of a row that has one: as stored, or opened by ``cipher``. A sealed one without a cipher
    that has its key raises :class:`UnknownKeyId`, naming the key; a plain one under a cipher that does not allow
    plain responses raises :class:`PlainResponseRefused` (unless ``resealing``: reencrypt reads it to seal it)."""
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
    )


def reseal_rows(
    rows: list[asyncpg.Record], cipher: ResponseCipher
) -> tuple[tuple[list[str], list[str], list[bytes]], list[tuple[str, str, str]]]:
    """The ``reseal_batch`` rows (``sql/queries.sql``) sealed again under the cipher's current key, as the ``reseal``
    statement's three arrays (tenants, keys, sealed), and those that do not open: ``(tenant, key, why)``."""
    resealed: tuple[list[str], list[str], list[bytes]] = ([], [], [])
    unreadable: list[tuple[str, str, str]] = []
    for row in rows:
        tenant, key = row["tenant"], row["key"]
        try:
            response = response_from_row(row, tenant, key, cipher, resealing=True)
        except SealedResponseError as error:
            unreadable.append((tenant, key, str(error)))
            continue
        resealed[0].append(tenant)
        resealed[1].append(key)
        resealed[2].append(cipher.seal(tenant, key, response).sealed)
    return resealed, unreadable


def encode_headers(headers: Headers) -> str:
    """Headers as JSON ``[[name, value], …]``; latin-1 keeps every byte, so the round trip is exact."""
    return orjson.dumps([[name.decode("latin-1"), value.decode("latin-1")] for name, value in headers]).decode()


def decode_headers(encoded: str | bytes | list[list[str]]) -> Headers:
    """The header list back from the column: its JSON text, or the list itself where the connection decodes jsonb
    (a SQLAlchemy engine's connections do)."""
    pairs = orjson.loads(encoded) if isinstance(encoded, str | bytes) else encoded
    return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in pairs]
