"""What one request costs the database, counted by the server: round trips, commits, WAL flushes and WAL bytes per
request, for a fresh key (plain and transactional) and a replay. These are the deterministic counts the benchmarks
stand on (benchmarks/README.md); held here so that none creeps back.

The server is one of the test's own (``benchmarks/pgserver.py``, autovacuum off), since its log and its statistics
are read:

- round trips: the messages the server executed for the store's connections, from its log (``log_statement =
  all``, set on the store's sessions only): a simple query is one line however many statements it holds, and a
  prepared statement's execution is one;
- commits: ``pg_stat_database.xact_commit``, read-only and implicit transactions included;
- WAL flushes: ``pg_stat_io``'s WAL fsyncs by client backends;
- WAL bytes: ``pg_current_wal_lsn()`` before and after.

Commits and flushes are statistics a backend reports as it exits: each measurement closes the store, and the same
measurement with no request at all is taken off (the store's opening and closing, the test's own reads). Nothing
here is timed.
"""

from __future__ import annotations

import importlib
import os
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idempotency_mw import IdempotencyMiddleware, PostgresStore, idempotency_context
from idempotency_mw.postgres import _store

pytestmark = pytest.mark.slow  # it starts a PostgreSQL of its own

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
N = 20  # requests per measurement
APP_NAME = "imw-costs"


@dataclass(frozen=True)
class Cost:
    round_trips: float
    commits: float
    flushes: float
    wal_bytes: float


@dataclass(frozen=True)
class Server:
    url: str
    log_path: str

    @property
    def database(self) -> str:
        return urlsplit(self.url).path.lstrip("/") or "postgres"

    def on(self, database: str) -> str:
        return urlunsplit(urlsplit(self.url)._replace(path="/" + database))


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        pgserver = importlib.import_module("pgserver")
    finally:
        sys.path.remove(str(BENCHMARKS))
    with pgserver.database(from_environment=False) as db:
        assert db.log_path is not None
        yield Server(db.url, db.log_path)


@pytest.fixture
async def admin(server: Server) -> AsyncIterator[asyncpg.Connection]:
    """The test's connection, to another database than the store's."""
    setup = await asyncpg.connect(server.url)
    try:
        await setup.execute("ALTER SYSTEM SET autovacuum = off")
        await setup.execute("SELECT pg_reload_conf()")
        await setup.execute("CREATE TABLE IF NOT EXISTS cost_effects (id bigserial PRIMARY KEY, amount int)")
    finally:
        await setup.close()
    connection = await asyncpg.connect(server.on("template1"))
    yield connection
    await connection.close()


async def plain(request: Request) -> Response:
    return JSONResponse({"id": uuid.uuid4().hex, **await request.json()}, status_code=201)


async def transactional(request: Request) -> Response:
    context = idempotency_context(request)
    assert context is not None
    assert context.connection is not None
    await context.connection.execute("INSERT INTO cost_effects (amount) VALUES ($1)", 1250)
    return JSONResponse({"id": uuid.uuid4().hex}, status_code=201)


def client(store: PostgresStore, path: str) -> httpx.AsyncClient:
    """A client of an app that answers ``path`` alone: ``/plain`` in plain mode, ``/tx`` in transactional mode."""
    app = Starlette(routes=[Route(path, plain if path == "/plain" else transactional, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=path == "/tx")
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://costs", headers={"authorization": "Bearer costs"}
    )


def log_size(log_path: str) -> int:
    return os.path.getsize(log_path)


def messages_since(log_path: str, offset: int) -> int:
    """The messages the logged sessions had executed, from the server's log: a backend logs one before it answers."""
    with open(log_path, "rb") as log:
        log.seek(offset)
        return sum(1 for line in log if b"LOG:  statement: " in line or b"LOG:  execute " in line)


class Measured:
    """Two apps (plain, transactional) on one store whose sessions log every statement they run, and what the server
    counts around a batch of requests."""

    def __init__(self, server: Server, admin: asyncpg.Connection) -> None:
        # Unknown DSN parameters are asyncpg's server settings: only the store's sessions are logged. Every
        # connection is opened (and its session set up) as the store opens.
        url = f"{server.url}&application_name={APP_NAME}&log_statement=all"
        self.store = PostgresStore(url, min_size=4, max_size=4)
        self.server = server
        self.admin = admin
        self.clients = {path: client(self.store, path) for path in ("/plain", "/tx")}

    async def post(self, path: str, key: str) -> httpx.Response:
        return await self.clients[path].post(path, json={"amount": 1250}, headers={"idempotency-key": key})

    async def cost(self, path: str, keys: list[str], status: int) -> Cost:
        """What sending ``keys`` to ``path`` costs, in all (not divided).

        Round trips and WAL are read around the requests alone. Commits and flushes are reported by a backend as it
        exits: they are read around a close of the store, an opening, the requests and a close again, and the same
        without requests is taken off (:func:`per_request`)."""
        await self._closed()
        commits, flushes = await self._statistics()
        await self.store.open()
        await self.warm()
        log_offset = log_size(self.server.log_path)
        lsn = await self.admin.fetchval("SELECT pg_current_wal_lsn()::text")
        for key in keys:
            answer = await self.post(path, key)
            assert answer.status_code == status, answer.text
        wal = await self.admin.fetchval("SELECT pg_current_wal_lsn() - $1::text::pg_lsn", lsn)
        trips = messages_since(self.server.log_path, log_offset)
        await self._closed()
        commits_after, flushes_after = await self._statistics()
        await self.store.open()
        return Cost(trips, commits_after - commits, flushes_after - flushes, float(wal))

    async def warm(self) -> None:
        """Fresh requests and replays on both paths: every statement prepared, and its types read, on the
        connections the measured requests take (the pool's most recently used)."""
        for path in ("/plain", "/tx"):
            for _ in range(2):
                key = str(uuid.uuid4())
                assert (await self.post(path, key)).status_code == 201
                assert (await self.post(path, key)).headers["idempotent-replayed"] == "true"

    async def _closed(self) -> None:
        """Close the store and wait until its backends are gone: a backend reports its statistics before it goes."""
        await self.store.close()
        while await self.admin.fetchval("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", APP_NAME):
            await self.admin.execute("SELECT pg_sleep(0.01)")

    async def _statistics(self) -> tuple[int, int]:
        # The test's own connection is on another database: its transactions are not in the store's count.
        await self.admin.execute("SELECT pg_stat_clear_snapshot()")
        row = await self.admin.fetchrow(
            "SELECT (SELECT xact_commit FROM pg_stat_database WHERE datname = $1) AS commits, "
            "(SELECT sum(fsyncs) FROM pg_stat_io WHERE object = 'wal' AND backend_type = 'client backend') AS flushes",
            self.server.database,
        )
        assert row is not None
        return int(row["commits"]), int(row["flushes"])


async def per_request(measured: Measured, path: str, keys: list[str], status: int) -> Cost:
    """The cost of ``keys`` per request: the commits and flushes of the store's close and opening taken off."""
    base = await measured.cost(path, [], status)
    cost = await measured.cost(path, keys, status)
    n = len(keys)
    return Cost(
        cost.round_trips / n,
        (cost.commits - base.commits) / n,
        (cost.flushes - base.flushes) / n,
        cost.wal_bytes / n,
    )


@pytest.fixture
async def measured(server: Server, admin: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Any]:
    monkeypatch.setattr(_store, "REPLAYS_EVERY", 3600.0)  # the replays' batch is written as the store closes
    measured = Measured(server, admin)
    await measured.store.migrate()
    await measured.store.open()
    try:
        yield measured
    finally:
        for each in measured.clients.values():
            await each.aclose()
        await measured.store.close()


def keys() -> list[str]:
    return [str(uuid.uuid4()) for _ in range(N)]


def close_to(value: float, expected: float) -> bool:
    """Counts per request are whole numbers; a stray transaction of the server's own (a statistics write) would be
    one in N."""
    return abs(value - expected) < 1.5 / N


async def test_a_fresh_plain_request_costs_two_round_trips_two_commits_two_flushes(measured: Measured) -> None:
    """The claim and the completion: each one statement, its own transaction, its own durable commit."""
    cost = await per_request(measured, "/plain", keys(), 201)
    assert close_to(cost.round_trips, 2), cost
    assert close_to(cost.commits, 2), cost
    assert close_to(cost.flushes, 2), cost
    assert cost.wal_bytes < 2400, cost  # 2,208 bytes when this test was written


async def test_a_fresh_transactional_request_costs_what_the_hand_written_app_does(measured: Measured) -> None:
    """The claim (committed at once, without waiting for its flush), then BEGIN, the handler's INSERT, the completion
    and the COMMIT, whose round trip also carries the connection's reset and the waiters' notice: five round trips
    as the hand-written two-commit app (benchmarks/durableapp.py), one durable flush. The reset and the notice,
    read after the COMMIT, are a third, read-only transaction of that round trip (benchmarks/README.md)."""
    cost = await per_request(measured, "/tx", keys(), 201)
    assert close_to(cost.round_trips, 5), cost
    assert close_to(cost.commits, 3), cost
    assert close_to(cost.flushes, 1), cost
    assert cost.wal_bytes < 2450, cost  # 2,248 bytes when this test was written


async def test_a_replay_costs_one_round_trip_and_writes_no_wal(measured: Measured) -> None:
    """A replay reads the record and its response in the claim's one statement; its count is kept in memory and
    written in batches (Replays), so the replay itself writes nothing."""
    sent = keys()
    for key in sent:
        assert (await measured.post("/plain", key)).status_code == 201
    cost = await per_request(measured, "/plain", sent, 201)
    assert close_to(cost.round_trips, 1), cost
    assert close_to(cost.commits, 1), cost  # and the replays' batch as the store closes: one for all N
    assert close_to(cost.flushes, 0), cost
    assert cost.wal_bytes == 0, cost


async def test_counting_scattered_replays_writes_no_record_page(server: Server, measured: Measured) -> None:
    """The replays' batch (count_replays) goes to a table of its own: a replay of each of many records scattered
    over a large table would otherwise change each one's page, and the first change of a page after a checkpoint
    writes the whole page to the WAL (benchmarks/results/scale.md). Each record here sits on a page of its own
    among other records, as a key replayed at random among many does."""
    sent = [f"replay-scatter-{n:04}" for n in range(REPLAYED)]
    for key in sent:
        assert (await measured.post("/plain", key)).status_code == 201
        assert (await measured.post("/plain", key)).headers["idempotent-replayed"] == "true"
    database = await asyncpg.connect(server.url)  # the store's database (the admin connection is on another)
    try:
        tenant = await database.fetchval("SELECT tenant FROM idempotency_records WHERE key = $1", sent[0])
        await database.execute(FILLER, tenant, sent)
        await database.execute("CLUSTER idempotency_records USING idempotency_records_pkey")
        records = "SELECT ctid::text, xmin::text FROM idempotency_records WHERE key = ANY ($1) ORDER BY key"
        before = await database.fetch(records, sent)
        pages = {row["ctid"].split(",")[0] for row in before}
        assert len(pages) == REPLAYED, pages  # each on a page of its own
        await database.execute("CHECKPOINT")
        lsn = await database.fetchval("SELECT pg_current_wal_insert_lsn()::text")
        await measured.store.count_replays()
        wal = await database.fetchval("SELECT pg_current_wal_insert_lsn() - $1::text::pg_lsn", lsn)
        assert await database.fetch(records, sent) == before  # no record row was written
        # 758 bytes a replay when this test was written (a row of the replays' table and its index entry, each
        # new); 7,791 when the counts were written in the records: a whole page each.
        assert wal / REPLAYED < 1000, wal / REPLAYED
    finally:
        await database.close()
    info = await measured.store.inspect(tenant, sent[0])
    assert info is not None
    assert (info.replays, info.last_replayed_at is not None) == (1, True)


REPLAYED = 200
# Behind each replayed record in the primary key (its key, then a suffix), 50 of the same tenant's: more than a page
# of the records table, once CLUSTER has written them in that order.
FILLER = """
INSERT INTO idempotency_records (tenant, key, fingerprint, fence, created_at, expires_at, request)
SELECT $1, k || 'f' || n, sha256((k || n)::bytea), n, now(), now() + interval '1 day', 'POST /plain'
FROM unnest($2::text[]) AS k, generate_series(10, 59) AS n
"""
