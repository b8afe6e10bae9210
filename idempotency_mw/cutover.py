"""Switching to this middleware from another idempotency package without a window for duplicate runs.

A request first seen by the previous package and retried after the switch must find what that package recorded:
its response if it completed, or that it is still running. ``IdempotencyMiddleware(..., earlier=lookup)`` asks
``lookup`` on every fresh claim, for as long as the previous package's records live (its retention), and answers
from what it finds, as from a record of its own. ``fastapi_idempotency(pool)`` reads the PostgreSQL table of
``fastapi-idempotency`` (its Tortoise store), ``asgi_idempotency_header(redis)`` the responses asgi-idempotency-header
keeps in Redis. docs/migrating.md has the cutover, package by package.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import asyncpg
import orjson
from starlette.types import Scope

from idempotency_mw.store import StoredResponse

__all__ = ["Earlier", "EarlierLookup", "RedisLike", "asgi_idempotency_header", "fastapi_idempotency"]


@dataclass(frozen=True, slots=True)
class Earlier:
    """What the previous package recorded for a request with this key: still ``running``, or completed with
    ``response``; ``same_request`` False when its record is of a different request (a 422 here too)."""

    running: bool = False
    response: StoredResponse | None = None
    same_request: bool = True


EarlierLookup = Callable[[Scope, bytes, str], Awaitable[Earlier | None]]
"""``lookup(scope, body, key)``: the ASGI scope and body of a keyed request, and its key; None when the previous
package has no live record of it."""


def fastapi_idempotency(
    pool: asyncpg.Pool | Callable[[], asyncpg.Pool],
    *,
    scope: Callable[[Scope], str | Awaitable[str]] | None = None,
    header: str = "Idempotency-Key",
    table: str = "fastapi_idempotency_requests",
) -> EarlierLookup:
    """The records of fastapi-idempotency 0.1's Tortoise store, in ``table`` of the database ``pool`` reaches (an
    asyncpg pool, or a function that returns the one the app made in its lifespan).

    ``scope`` must be the ``scope`` function the app gave that package (its default, the client's address, is
    used otherwise), called here with the ASGI scope; ``header`` the header it read the key from. Its record is
    found as it found it (a SHA-256 of the scope and the key, each length-prefixed), and its fingerprint compared
    as it compared it (method, path, query and body): a different request is a 422 here too. A record past its
    ``expires_at`` is gone for that package, and for this lookup."""
    if not re.fullmatch(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)?", table):
        raise ValueError(f"fastapi_idempotency table must be a plain (optionally schema-qualified) name, got {table!r}")
    wanted = header.lower().encode("latin-1")
    statement = f"SELECT fingerprint, status_code, headers, body FROM {table} WHERE key = $1 AND expires_at > now()"

    async def lookup(asgi_scope: Scope, body: bytes, key: str) -> Earlier | None:
        sent = [value for name, value in asgi_scope["headers"] if name == wanted]
        if len(sent) != 1:
            return None
        owner = _client_host(asgi_scope) if scope is None else scope(asgi_scope)
        owner = await owner if inspect.isawaitable(owner) else owner
        found = await (pool() if callable(pool) else pool).fetchrow(
            statement, _digest(owner, sent[0].decode("latin-1"))
        )
        if found is None:
            return None
        try:
            query = asgi_scope.get("query_string", b"").decode()  # as Starlette decodes it for request.url
        except UnicodeDecodeError:
            return None  # that package's Request could not have read it either: it recorded nothing of it
        if found["fingerprint"] != _digest(asgi_scope["method"], asgi_scope["path"], query, body):
            return Earlier(same_request=False)
        if found["status_code"] is None:
            return Earlier(running=True)
        headers = found["headers"]
        pairs = orjson.loads(headers) if isinstance(headers, str | bytes) else headers
        stored = found["body"] or b""
        return Earlier(
            response=StoredResponse(
                found["status_code"],
                [(name.encode("latin-1"), value.encode("latin-1")) for name, value in pairs],
                stored,
                len(stored),
            )
        )

    return lookup


class RedisLike(Protocol):
    """What the lookup asks of a Redis client (``redis.asyncio.Redis``, the one the old app used)."""

    def get(self, name: str) -> Awaitable[bytes | str | None]: ...


def asgi_idempotency_header(
    redis: RedisLike, *, header: str = "Idempotency-Key", response_key: str = "idempotency-key-responses"
) -> EarlierLookup:
    """The responses asgi-idempotency-header 0.2's Redis store completed, for a cutover after a drain (stop its
    instances first: what ran under it has then completed, or failed and left nothing).

    That package keeps a completed response as its JSON value and status, under the key alone: it has no tenant and
    no fingerprint, so what it would have replayed to any client that sent the key is what this lookup answers
    (the JSON rendered as its replay rendered it), once, before this middleware keeps it under the client's tenant.
    Its set of pending keys is not read: after the drain, a key there without a response failed (that package never
    removes one whose request raised), and runs here. ``header`` and ``response_key`` as given to that package."""
    wanted = header.lower().encode("latin-1")

    async def lookup(asgi_scope: Scope, body: bytes, key: str) -> Earlier | None:
        sent = [value for name, value in asgi_scope["headers"] if name == wanted]
        if len(sent) != 1:
            return None
        stored_as = response_key + sent[0].decode("latin-1")
        payload = await redis.get(stored_as)
        if not payload:
            return None
        status = await redis.get(stored_as + "status-code")
        if status is None:
            return None  # expired between the two reads
        rendered = json.dumps(
            json.loads(payload), ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
        ).encode()  # as its replay, a Starlette JSONResponse, rendered it
        headers = [(b"content-type", b"application/json")]
        return Earlier(response=StoredResponse(int(status), headers, rendered, len(rendered)))

    return lookup


def _client_host(scope: Scope) -> str:
    client = scope.get("client")
    return str(client[0]) if client else ""


def _digest(*parts: str | bytes) -> str:
    """That package's digest: SHA-256 over each part's length (8 bytes, big-endian) and then the part."""
    hasher = hashlib.sha256()
    for part in parts:
        data = part if isinstance(part, bytes) else part.encode()
        hasher.update(len(data).to_bytes(8, "big"))
        hasher.update(data)
    return hasher.hexdigest()
