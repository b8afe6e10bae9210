"""The baseline of issue 14: what an expert writes without a library, for the end-to-end comparison.

The same ``/orders`` handler as every other variant (``benchapp.orders``), with idempotency written inline in the
endpoint: the store's own ``claim`` and ``complete`` statements (``sql/queries.sql``), run with asyncpg as
prepared-statement objects kept per connection, from a small LIFO pool of connections opened at startup (20, like
the store's ``max_size``), with no deadline, no events, no lease renewal, no response capture beyond the one
JSON response this handler returns. Same semantics as the middleware for the traffic the benchmark sends:

- a fresh key: claim, run the handler, complete with its status, headers and body, send the response;
- a completed key with the same request: claim (a read), send the stored response with ``Idempotent-Replayed``;
- anything else the claim says (in progress, a different request): 409 or 422, a bare status.

The tenant is the ``Authorization`` header as sent and the fingerprint a SHA-256 of the body: the cheapest choice
an expert could defend, cheaper than the middleware's HMAC tenant and canonical JSON fingerprint.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
from starlette.requests import Request
from starlette.responses import Response

from idempotency_mw.postgres._records import new_fence
from idempotency_mw.postgres._sql import queries
from idempotency_mw.store import decode_headers, encode_headers

POOL_SIZE = 20
LEASE, TTL = 30.0, 86400.0
REPLAYED = (b"idempotent-replayed", b"true")


# A connection with its statements prepared, in this order.
STATEMENTS = ("claim", "claim_or_take_over", "claim_locked", "complete")
Entry = tuple[asyncpg.Connection, Any, Any, Any, Any]


class Connections:
    """A LIFO pool of connections, each with the store's claim and completion statements prepared (STATEMENTS)."""

    def __init__(self, dsn: str, size: int = POOL_SIZE) -> None:
        self.dsn = dsn
        self.size = size
        self.idle: list[Entry] = []
        self.waiters: list[asyncio.Future[Entry]] = []
        self.claim_parameters = 0  # of the claim statements, known once they are prepared

    async def open(self) -> None:
        sql = queries("public")
        for _ in range(self.size):
            connection = await asyncpg.connect(self.dsn)
            prepared = [await connection.prepare(sql[name]) for name in STATEMENTS]
            self.idle.append((connection, *prepared))
            self.claim_parameters = len(prepared[0].get_parameters())

    async def close(self) -> None:
        await asyncio.gather(*(entry[0].close() for entry in self.idle))

    async def take(self) -> Entry:
        if self.idle:
            return self.idle.pop()
        waiter: asyncio.Future[Entry] = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        return await waiter

    def give(self, entry: Entry) -> None:
        while self.waiters:
            waiter = self.waiters.pop(0)
            if not waiter.done():
                waiter.set_result(entry)
                return
        self.idle.append(entry)


def idempotent(
    handler: Callable[[Request], Awaitable[Response]], connections: Connections
) -> Callable[[Request], Awaitable[Response]]:
    """``handler`` with the claim before and the completion after, inline."""

    async def endpoint(request: Request) -> Response:
        key = request.headers.get("idempotency-key")
        if key is None:
            return await handler(request)
        tenant = request.headers.get("authorization", "")
        fingerprint = hashlib.sha256(await request.body()).digest()
        args: tuple[Any, ...] = (tenant, key, [fingerprint], LEASE, TTL, new_fence(), None)
        # The claim statement's later parameters (what inspect shows, the request's parts) are NULL: nothing this
        # app does not use is stored, as in durableapp.py.
        args += (None,) * (connections.claim_parameters - len(args))
        entry = await connections.take()
        try:
            row = await entry[1].fetchrow(*args)  # a fresh key, a replay, a 409 or a 422 (see sql/queries.sql)
            if row is None:  # a takeover, or a race
                row = await entry[2].fetchrow(*args)
            if row is None:  # a race with a concurrent claim of the key
                row = await entry[3].fetchrow(*args)
        finally:
            connections.give(entry)
        if row["owned"]:
            response = await handler(request)
            entry = await connections.take()
            try:
                await entry[4].fetchrow(
                    tenant,
                    key,
                    row["fence"],
                    response.status_code,
                    encode_headers(response.raw_headers),
                    response.body,
                    len(response.body),
                    None,  # not sealed (no cipher)
                    None,
                )
            finally:
                connections.give(entry)
            return response
        if not row["same_request"]:
            return Response(status_code=422)
        if not row["completed"]:
            return Response(status_code=409)
        replay = Response(row["body"], status_code=row["status"])
        replay.raw_headers = [*decode_headers(row["headers"]), REPLAYED]
        return replay

    return endpoint
