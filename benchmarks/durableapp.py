"""The app that ``durability.py`` serves: one transactional route, ``POST /orders``, that inserts one row.

Variants (``BENCH_VARIANT`` for uvicorn's ``durableapp:create_app --factory``, ``BENCH_DSN`` the database):

- ``handwritten``: no library. The two-commit design an expert writes by hand, on one connection of a LIFO pool of
  20 (like ``handwritten.py``): the store's ``claim`` statement in autocommit, its own durable commit, so that a
  concurrent retry sees the claim at once; then ``BEGIN``, the handler's insert, the store's
  ``complete_in_transaction`` statement and ``COMMIT``, the second durable commit, which lands the effect and its
  record together.
- ``ours``: ``IdempotencyMiddleware`` with ``PostgresStore`` (defaults) in transactional mode; the handler writes
  through the connection of the transaction the middleware lends it. Which copy of ``idempotency_mw`` that is
  depends on ``PYTHONPATH`` (``durability.py`` runs a copy from a git revision beside the working tree's), and
  ``GET /_library`` tells where it was imported from, so the harness can check it measured the copy it meant to.

Both variants run the same handler (:func:`place_order`) for the same requests: only the idempotency around it
differs.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import asyncpg
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import idempotency_mw

ORDERS = "durability_orders"
CREATE_ORDERS = (
    f"CREATE TABLE IF NOT EXISTS {ORDERS} (id bigserial PRIMARY KEY, amount integer NOT NULL, "
    "currency text NOT NULL, customer text NOT NULL, created_at timestamptz NOT NULL DEFAULT now())"
)
INSERT_ORDER = f"INSERT INTO {ORDERS} (amount, currency, customer) VALUES ($1, $2, $3) RETURNING id"
VARIANTS = ("handwritten", "ours")
POOL_SIZE = 20
LEASE, TTL = 30.0, 86400.0
REPLAYED = (b"idempotent-replayed", b"true")
# The secret of our tenant resolver: a fixed value, nothing here is secret (as in benchapp.py).
TENANT_SECRET = "benchmark-tenant-secret-0123456789abcdef"
LIBRARY = os.path.dirname(os.path.abspath(idempotency_mw.__file__))  # which copy of the library this process runs

Endpoint = Callable[[Request], Awaitable[Response]]
Hook = Callable[[], Awaitable[None]]


async def place_order(connection: Any, order: dict[str, Any]) -> Response:
    """The handler's effect, the same in every variant: one row inserted in the transaction it is given."""
    order_id = await connection.fetchval(INSERT_ORDER, order["amount"], order["currency"], order["customer"])
    return JSONResponse({"id": order_id, "status": "accepted", **order}, status_code=201)


@dataclass
class Prepared:
    """One connection of the hand-written pool with the store's claim statements prepared on it."""

    connection: asyncpg.Connection
    claim: Any
    claim_or_take_over: Any
    claim_locked: Any
    parameters: int  # of the claim statements


class Connections:
    """A LIFO pool of connections opened at startup, each with its statements prepared (``handwritten.py``'s)."""

    def __init__(self, dsn: str, size: int = POOL_SIZE) -> None:
        self.dsn = dsn
        self.size = size
        self.idle: list[Prepared] = []
        self.waiters: list[asyncio.Future[Prepared]] = []

    async def open(self) -> None:
        from idempotency_mw.postgres._sql import queries

        sql = queries("public")
        self.complete_sql = sql["complete_in_transaction"]
        for _ in range(self.size):
            connection = await asyncpg.connect(self.dsn)
            claim = await connection.prepare(sql["claim"])
            claim_or_take_over = await connection.prepare(sql["claim_or_take_over"])
            claim_locked = await connection.prepare(sql["claim_locked"])
            await connection.prepare(self.complete_sql)  # into asyncpg's statement cache, like the handler's insert
            parameters = len(claim.get_parameters())
            self.idle.append(Prepared(connection, claim, claim_or_take_over, claim_locked, parameters))

    async def close(self) -> None:
        await asyncio.gather(*(entry.connection.close() for entry in self.idle))

    async def take(self) -> Prepared:
        if self.idle:
            return self.idle.pop()
        waiter: asyncio.Future[Prepared] = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        return await waiter

    def give(self, entry: Prepared) -> None:
        while self.waiters:
            waiter = self.waiters.pop(0)
            if not waiter.done():
                waiter.set_result(entry)
                return
        self.idle.append(entry)


class FencedOut(Exception):
    """The completion found a newer claim of the key: the transaction rolls back with the handler's insert."""


def new_fence() -> int:
    """A claim's fence, as the store draws it: a random positive 63-bit token."""
    return int.from_bytes(os.urandom(8)) >> 1 or 1


def encode_headers(headers: list[tuple[bytes, bytes]]) -> str:
    """The ``headers`` column's JSON, ``[[name, value], …]`` (latin-1 keeps every byte)."""
    return json.dumps([[name.decode("latin-1"), value.decode("latin-1")] for name, value in headers])


def decode_headers(encoded: str) -> list[tuple[bytes, bytes]]:
    return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in json.loads(encoded)]


def two_commits(connections: Connections) -> Endpoint:
    """The hand-written endpoint: claim (commit 1), then the handler and the completion in a transaction (commit 2).

    Only the SQL is the library's (its ``claim`` and ``complete_in_transaction`` statements, from the working tree):
    the rest is written here, so that it runs whatever the library's internals become. A ``claim`` statement that
    takes more parameters than the six below (a ``synchronous_commit`` for its own commit, say) gets NULL for them,
    the statement's "as the session has it": the claim's own durable commit, as the two-commit design has it."""

    async def endpoint(request: Request) -> Response:
        body = await request.body()
        order = json.loads(body)
        key = request.headers.get("idempotency-key")
        entry = await connections.take()
        connection = entry.connection
        try:
            if key is None:  # no key: the handler still runs in a transaction, and nothing is recorded
                async with connection.transaction():
                    return await place_order(connection, order)
            tenant = request.headers.get("authorization", "")
            args: tuple[Any, ...] = (tenant, key, [hashlib.sha256(body).digest()], LEASE, TTL, new_fence())
            args += (None,) * (entry.parameters - len(args))
            row = await entry.claim.fetchrow(*args)  # a fresh key, a replay, a 409 or a 422 (see sql/queries.sql)
            if row is None:  # a takeover, or a race
                row = await entry.claim_or_take_over.fetchrow(*args)
            if row is None:  # a race with a concurrent claim of the key
                row = await entry.claim_locked.fetchrow(*args)
            if row["owned"]:
                try:
                    async with connection.transaction():
                        response = await place_order(connection, order)
                        status = await connection.execute(
                            connections.complete_sql,
                            tenant,
                            key,
                            row["fence"],
                            response.status_code,
                            encode_headers(response.raw_headers),
                            response.body,
                            len(response.body),
                            None,  # not sealed (no cipher)
                            None,
                            False,  # a transaction the library did not mark as it began
                        )
                        if status != "INSERT 0 1":
                            raise FencedOut
                except FencedOut:
                    return Response(status_code=409)
                return response
        finally:
            connections.give(entry)
        if not row["same_request"]:
            return Response(status_code=422)
        if not row["completed"]:
            return Response(status_code=409)
        replay = Response(row["body"], status_code=row["status"])
        replay.raw_headers = [*decode_headers(row["headers"]), REPLAYED]
        return replay

    return endpoint


async def in_lent_transaction(request: Request) -> Response:
    """Ours: the handler writes through the transaction the middleware lent it."""
    from idempotency_mw import idempotency_context

    context = idempotency_context(request)
    if context is None or context.connection is None:
        raise RuntimeError("the middleware lent this transactional route no connection")
    return await place_order(context.connection, await request.json())


async def library(request: Request) -> Response:
    """Where ``idempotency_mw`` was imported from."""
    return JSONResponse({"path": LIBRARY})


def build(variant: str, dsn: str) -> Starlette:
    """The app of ``variant`` on the database ``dsn``; its lifespan opens and closes the connections."""
    startup: Hook
    shutdown: Hook
    if variant == "handwritten":
        connections = Connections(dsn)
        orders = two_commits(connections)
        startup, shutdown = connections.open, connections.close
        middleware = []
    elif variant == "ours":
        from starlette.middleware import Middleware

        from idempotency_mw import AuthorizationTenant, IdempotencyMiddleware, PostgresStore

        store = PostgresStore(dsn)
        orders = in_lent_transaction
        startup, shutdown = store.open, store.close
        middleware = [
            Middleware(
                IdempotencyMiddleware, store=store, tenant=AuthorizationTenant(TENANT_SECRET), transactional=True
            )
        ]
    else:
        raise ValueError(f"unknown variant {variant!r}; one of {', '.join(VARIANTS)}")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await startup()
        try:
            yield
        finally:
            await shutdown()

    routes = [Route("/orders", orders, methods=["POST"]), Route("/_library", library, methods=["GET"])]
    return Starlette(routes=routes, middleware=middleware, lifespan=lifespan)


def create_app() -> Starlette:
    """uvicorn factory: ``BENCH_VARIANT`` picks the variant, ``BENCH_DSN`` the database."""
    return build(os.environ["BENCH_VARIANT"], os.environ["BENCH_DSN"])
