"""What fixes cost on the hot path, each measured side by side with what it replaced: issue 10's (issue 14,
target 6), and those of 0.2.0 for any isolation level, the app's own connection state and lent connections.

    benchmarks/.work/venv/bin/python benchmarks/fixes.py --dsn postgresql://… [--postmaster-pid N] [--quick]
    # prints JSON; run.py renders results/fixes.md (./dev bench --only fixes)

In process, under uvloop, variants interleaved round after round. Issue 10's, through the ASGI app called directly
(no sockets):

- **Session reset** (defect 2): a transactional request (claim, the handler's one INSERT on the lent connection,
  completion and commit, the connection's reset) with the full reset of ``sql/reset_session.sql`` against asyncpg's
  own partial reset (a connection class made here for the comparison only; the store has no such switch). Client
  CPU per request, requests per second (16 concurrent), and with ``--postmaster-pid`` the database's CPU.
- **Settle point** (defects 3 and 4): the middleware settles each request in a task of its own
  (``start_eagerly`` + ``outlasting``: an eager task on Python 3.12+, a task from the start on 3.11), so that a
  cancellation cannot interrupt writing the record. Against a task from the start waited for through
  ``asyncio.shield`` (as first written; on 3.11 the same task as shipped, so the two columns differ by the wait
  alone) and a variant that awaits the settlement directly
  (benchmark only: it would lose that guarantee), fresh requests on ``MemoryStore`` and ``PostgresStore``, and the
  mechanisms alone.
- **Lease keeper** (defect 14): hold + drop per request, timed alone.
- The **fingerprint** (defects 1 and 8) has its own measurement, ``fingerprint.py``.

0.2.0's, one operation at a time, the variants taking turns operation by operation, each operation timed alone
(medians per round, then over rounds, with the round-by-round differences); the library before them is commit
43f0f80 (``common.library_copy``):

- **The guard on the lent connection** (``lending.LentConnection``): a statement through it against the same
  statement on the asyncpg connection itself; the call alone, without a round trip.
- **Responses in a table of their own**: the shipped statements against 43f0f80's one-table ones, each layout on
  a schema of its own in the same database, through raw asyncpg: fresh claim, completion, replay, and the
  completion in a transaction; wall time, the server process's CPU (with ``--postmaster-pid``: the server is
  local) and WAL bytes. Statements, not stores: the store of 43f0f80 differs in more than its tables.
- **READ COMMITTED on a REPEATABLE READ database** (a database made for it): ``claim`` + ``complete`` through an
  app's asyncpg pool with each statement in a READ COMMITTED transaction of its own against the plain statements
  of before (and without the share of the pool kept for finishing work), and through the store's own pool pinned
  per connection against not pinned.
- **The pool's session state restored per lend**: the reset a lent connection runs with and without the SQL that
  restores its pool's state, on a connection of the store's own and on one of an app's pool whose ``init`` sets a
  role and settings; and reading that state, once per connection.
- **Pieces**: the fingerprint's UTF-8 decoding of forms and queries, the recorder's response start and the lease
  keeper per event loop, on the shipped library and on 43f0f80, each in processes of its own (``fixpieces.py``);
  and the exception check of a transactional response, which is new.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import psutil
from benchapp import TENANT_SECRET
from common import Target, check_copy, library_copy, table, target_table
from overhead import BASE_HEADERS, SCOPE, Sink, receive
from servers import HERE, REPO, bench_env
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idempotency_mw import AuthorizationTenant, IdempotencyMiddleware, MemoryStore, PostgresStore
from idempotency_mw.connectors import PIN_RESTORE, AppPool, OwnPool, StoreConnection, reachable
from idempotency_mw.context import idempotency_context
from idempotency_mw.eager import outlasting, start_eagerly
from idempotency_mw.leases import LeaseKeeper
from idempotency_mw.lending import LentConnection, remember, reset_sql, set_restore
from idempotency_mw.recording import PlainRun
from idempotency_mw.rows import encode_headers, new_fence
from idempotency_mw.sql import queries, reset_session, session
from idempotency_mw.store import ClaimOutcome, StoredResponse

TENANT = AuthorizationTenant(TENANT_SECRET)
CONCURRENCY = 16
FULL, PARTIAL, FUNCTION = "full reset (shipped)", "asyncpg's reset (before)", "full, deallocation in a function"
SHIPPED = "start_eagerly + outlasting (shipped)"
FROM_THE_START = "task from the start + shield (before)"
DIRECT = "awaited directly"


class PartialResetConnection(StoreConnection):
    """asyncpg's own reset (what a lent connection got before defect 2 was fixed): for this comparison only."""

    def get_reset_query(self) -> str:
        return str(super(StoreConnection, self).get_reset_query())


DEALLOCATE_FUNCTION = """
CREATE OR REPLACE FUNCTION public.bench_deallocate_sql_statements() RETURNS void LANGUAGE plpgsql AS $$
DECLARE statement_name text;
BEGIN
    FOR statement_name IN SELECT name FROM pg_prepared_statements WHERE from_sql LOOP
        EXECUTE format('DEALLOCATE %I', statement_name);
    END LOOP;
END
$$
"""


class FunctionResetConnection(StoreConnection):
    """The full reset with its DO block (compiled anew at every reset) as a function (compiled once per server
    process): what a migration could add. Not shipped; for this comparison only."""

    def get_reset_query(self) -> str:
        return deallocation_in_a_function(super().get_reset_query())


def deallocation_in_a_function(reset: str) -> str:
    """``reset`` with its DO block replaced by a call of ``DEALLOCATE_FUNCTION``; what follows the block (the pool's
    session state, restored) stays."""
    start = reset.index("DO $$")
    end = reset.index("$$;", start + len("DO $$")) + len("$$;")
    return reset[:start] + "SELECT public.bench_deallocate_sql_statements();" + reset[end:]


def transactional_app(store: PostgresStore) -> Starlette:
    async def order(request: Request) -> Response:
        body = await request.body()
        context = idempotency_context(request)
        assert context is not None
        assert context.connection is not None
        await context.connection.execute("INSERT INTO bench_orders (body) VALUES ($1)", body.decode())
        return JSONResponse({"status": "accepted"}, status_code=201)

    middleware = [Middleware(IdempotencyMiddleware, store=store, tenant=TENANT, transactional=True)]
    return Starlette(routes=[Route("/orders", order, methods=["POST"])], middleware=middleware)


def postgres_cpu(pid: int | None) -> float:
    if pid is None:
        return 0.0
    postmaster = psutil.Process(pid)
    times = postmaster.cpu_times()
    total = times.user + times.system + times.children_user + times.children_system
    for child in postmaster.children(recursive=True):
        try:
            child_times = child.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += child_times.user + child_times.system
    return float(total)


async def drive(app: Any, requests: int, prefix: str) -> tuple[int, Sink]:
    """``requests`` fresh keyed POSTs, ``CONCURRENCY`` at a time; (201s, the last sink)."""
    sink = Sink()
    created = 0
    keys = iter(range(requests))

    async def worker() -> None:
        nonlocal created
        for i in keys:
            scope = {**SCOPE, "headers": [*BASE_HEADERS, (b"idempotency-key", f"{prefix}-{i}".encode())]}
            own = Sink()
            await app(scope, receive, own.send)
            created += own.status == 201

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return created, sink


async def reset_cost(dsn: str, pid: int | None, rounds: int, requests: int) -> dict[str, Any]:
    admin = await asyncpg.connect(dsn)
    await admin.execute("CREATE TABLE IF NOT EXISTS bench_orders (id bigserial PRIMARY KEY, body text)")
    await admin.execute(DEALLOCATE_FUNCTION)
    stores: dict[str, PostgresStore] = {}
    for variant, connection_class in (
        (FULL, StoreConnection),
        (PARTIAL, PartialResetConnection),
        (FUNCTION, FunctionResetConnection),
    ):
        store = PostgresStore(dsn, min_size=CONCURRENCY, max_size=CONCURRENCY + 4)
        assert isinstance(store._connector, OwnPool)
        store._connector.pool.connection_class = connection_class  # this comparison only: not a store option
        await store.open()
        stores[variant] = store
    apps = {variant: transactional_app(store) for variant, store in stores.items()}
    per: dict[str, list[dict[str, float]]] = {variant: [] for variant in apps}
    try:
        run = uuid.uuid4().hex[:8]
        for variant, app in apps.items():  # warm-up: statements prepared, connections opened
            await drive(app, 200, f"{run}-warm-{len(variant)}")
        for r in range(rounds):
            for variant in list(apps) if r % 2 == 0 else list(apps)[::-1]:
                cpu, wall, db = time.process_time(), time.perf_counter(), postgres_cpu(pid)
                created, _ = await drive(apps[variant], requests, f"{run}-{r}-{len(variant)}")
                if created != requests:
                    raise SystemExit(f"{variant}: {created} of {requests} requests answered 201")
                per[variant].append(
                    {
                        "client_us": (time.process_time() - cpu) / requests * 1e6,
                        "postgres_us": (postgres_cpu(pid) - db) / requests * 1e6,
                        "rps": requests / (time.perf_counter() - wall),
                    }
                )
    finally:
        for store in stores.values():
            await store.close()
        await admin.execute("DROP TABLE IF EXISTS bench_orders")
        await admin.execute("DROP FUNCTION IF EXISTS public.bench_deallocate_sql_statements()")
        await admin.close()
    return {
        variant: {field: statistics.median(r[field] for r in runs) for field in ("client_us", "postgres_us", "rps")}
        | {"each_rps": [round(r["rps"]) for r in runs]}
        for variant, runs in per.items()
    } | {
        "rps_ratio": statistics.median(a["rps"] / b["rps"] for a, b in zip(per[FULL], per[PARTIAL], strict=True)),
        "rps_ratio_function": statistics.median(
            a["rps"] / b["rps"] for a, b in zip(per[FUNCTION], per[PARTIAL], strict=True)
        ),
    }


async def settle_cost(dsn: str, rounds: int, requests: int) -> dict[str, Any]:
    """Fresh requests on MemoryStore and on PostgresStore: the settle task (as shipped, ``PlainRun._settle``) against
    awaiting the settlement directly, and against the settle task as first written (a task and asyncio.shield)."""
    shipped = PlainRun._settle

    async def direct(self: PlainRun) -> None:  # no task, no shield: the guarantee is gone
        if not self._claimed or self._settled:
            return
        self._settled = True
        self._on_settled(await self._settle_with(self.recorder), self.recorder.status)

    async def from_the_start(self: PlainRun) -> None:  # the settle task as first written
        if not self._claimed:
            return
        if self.settling is None:
            self.settling = asyncio.ensure_future(self._settle_with(self.recorder))
        outcome = await asyncio.shield(self.settling)
        if not self._settled:
            self._settled = True
            self._on_settled(outcome, self.recorder.status)

    def app(store: Any) -> Starlette:
        async def order(request: Request) -> Response:
            await request.body()
            return JSONResponse({"status": "accepted"}, status_code=201)

        middleware = [Middleware(IdempotencyMiddleware, store=store, tenant=TENANT)]
        return Starlette(routes=[Route("/orders", order, methods=["POST"])], middleware=middleware)

    settles: dict[str, Callable[..., Any]] = {
        SHIPPED: shipped,
        FROM_THE_START: from_the_start,
        DIRECT: direct,
    }
    postgres = PostgresStore(dsn, min_size=CONCURRENCY, max_size=CONCURRENCY + 4)
    await postgres.open()
    stores: dict[str, Callable[[], Any]] = {"MemoryStore": MemoryStore, "PostgresStore": lambda: postgres}
    per: dict[str, dict[str, list[float]]] = {store: {name: [] for name in settles} for store in stores}
    run = uuid.uuid4().hex[:8]
    try:
        for r in range(rounds):
            for s, (store_name, make) in enumerate(stores.items()):
                for n, name in enumerate(settles if r % 2 == 0 else list(settles)[::-1]):
                    PlainRun._settle = settles[name]  # type: ignore[method-assign]
                    target = app(make())
                    await drive(target, 100, f"{run}-warm-{r}-{s}-{n}")
                    started = time.process_time()
                    created, _ = await drive(target, requests, f"{run}-{r}-{s}-{n}")
                    per[store_name][name].append((time.process_time() - started) / requests * 1e6)
                    assert created == requests
    finally:
        PlainRun._settle = shipped  # type: ignore[method-assign]
        await postgres.close()
    out: dict[str, Any] = {}
    for store_name, runs in per.items():
        out[store_name] = {name: statistics.median(values) for name, values in runs.items()} | {
            f"added_us {name}": statistics.median(a - b for a, b in zip(runs[name], runs[DIRECT], strict=True))
            for name in (SHIPPED, FROM_THE_START)
        }
    return out


async def pieces(n: int) -> dict[str, float]:
    """µs per call, each mechanism alone."""

    async def nothing() -> None:
        return None

    async def each(make: Callable[[], Any]) -> float:
        started = time.process_time()
        for _ in range(n):
            await make()
        return (time.process_time() - started) / n * 1e6

    keeper = LeaseKeeper(MemoryStore())

    async def lease() -> None:
        keeper.drop(keeper.hold("t", "k", 1, 30.0))

    direct = await each(nothing)
    return {
        "awaiting a coroutine directly": direct,
        "a task from the start: ensure_future + shield": await each(
            lambda: asyncio.shield(asyncio.ensure_future(nothing()))
        ),
        "start_eagerly + outlasting, never waiting (eager on 3.12+ only)": await each(
            lambda: outlasting(start_eagerly(nothing(), "nothing"))
        ),
        "lease keeper: hold + drop": await each(lease) - direct,
    }


# -- 0.2.0: any isolation level, the app's connection state, lent connections --------------------------------------

BEFORE = "43f0f80"  # the library before these fixes (the commit before cd7f9e4)
RAW, LENT = "raw asyncpg connection (before)", "LentConnection (shipped)"
ONE_TABLE, TWO_TABLES = "one table (before)", "two tables (shipped)"
LEAN, EVERY_CASE = "claim (shipped)", "claim_or_take_over (every case, as the one claim before)"
FRESH_CLAIM, COMPLETION, REPLAY, IN_TRANSACTION = (
    "fresh claim",
    "completion (plain mode)",
    "replay (the claim of a completed key)",
    "completion in the handler's transaction (BEGIN, completion, COMMIT)",
)
APP_EXPLICIT = "app's pool: each statement in a READ COMMITTED transaction (shipped)"
APP_PLAIN = "app's pool: plain statements, under REPEATABLE READ (before)"
APP_NO_SHARE = "app's pool: plain statements, no share kept for finishing work (before 0.2.0)"
OWN_PINNED = "own pool: READ COMMITTED pinned per connection (shipped)"
OWN_UNPINNED = "own pool: not pinned, under REPEATABLE READ (before)"
RESET_ONLY, RESET_RESTORE = "reset only (before)", "reset, then the pool's state (shipped)"
OWN_RESTORE, APP_RESTORE = "own pool: the READ COMMITTED pin", "app's pool: a role and two settings from its init"
LIBRARY_SHIPPED, LIBRARY_BEFORE = "shipped", "before"
APP_COMPARED = "the READ COMMITTED transactions on an app's pool"
SHARE_COMPARED = "the share an app's pool keeps for finishing work, in fresh requests"
OWN_COMPARED = "the READ COMMITTED pin on the store's own pool"
CHECKOUT_COMPARED = "the share, a checkout of an app's pool alone (acquire and release)"
ISOLATION_PAIRS = {  # what is compared: (shipped, before)
    APP_COMPARED: (APP_EXPLICIT, APP_PLAIN),
    SHARE_COMPARED: (APP_PLAIN, APP_NO_SHARE),
    OWN_COMPARED: (OWN_PINNED, OWN_UNPINNED),
}
FORM_ASCII_PIECE = "fingerprint: a small form body, ASCII"
FORM_ESCAPED_PIECE = "fingerprint: a small form body, UTF-8 escapes"
RECORDER_PIECE = "recorder: the response start (headers in a list) and its final body"
LEASE_PIECE = "lease keeper: hold + drop"
TENANT_ID = "fixes-tenant"
FINGERPRINT = bytes(range(32))
STORED = StoredResponse(
    201, [(b"content-type", b"application/json"), (b"content-length", b"21")], b'{"status":"accepted"}', 21
)
LEASE, TTL = 30.0, 86400.0
STATEMENT_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


def compared(shipped: Sequence[float], before: Sequence[float]) -> dict[str, Any]:
    """Medians of two variants measured in the same rounds, and the median of their paired differences (shipped
    minus before, round by round) with its range."""
    added = [a - b for a, b in zip(shipped, before, strict=True)]
    return {
        "shipped": statistics.median(shipped),
        "before": statistics.median(before),
        "added": statistics.median(added),
        "low": min(added),
        "high": max(added),
        "each_shipped": list(shipped),
        "each_before": list(before),
    }


def ordered(names: Sequence[str], r: int) -> list[str]:
    """The variants in this round's order: forwards in even rounds, backwards in odd ones."""
    return list(names) if r % 2 == 0 else list(names)[::-1]


def with_database(dsn: str, name: str) -> str:
    """The same server and credentials, another database."""
    return urlunsplit(urlsplit(dsn)._replace(path=f"/{name}"))


def backend_cpu(connection: Any, local: bool) -> float | None:
    """CPU seconds the server process behind ``connection`` has used, in nanoseconds' resolution
    (``/proc/<pid>/schedstat``), when the server runs on this machine; None otherwise."""
    if not local:
        return None
    try:
        return int(Path(f"/proc/{connection.get_server_pid()}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


async def wal_position(connection: asyncpg.Connection) -> int:
    return int(await connection.fetchval("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint"))


Operation = Callable[[int], Awaitable[object]]


async def per_operation(
    operations: dict[str, Operation], n: int, servers: dict[str, Any] | None = None, local: bool = False
) -> dict[str, dict[str, float]]:
    """Each variant's operation ``n`` times, the variants taking turns operation by operation (in one order, then
    the other), each operation timed alone: the median µs of client CPU, wall time and, for a variant with a
    connection in ``servers`` on a local server, the CPU of the server process behind it."""
    samples: dict[str, dict[str, list[float]]] = {name: {"client": [], "wall": [], "server": []} for name in operations}
    for i in range(n):
        for name in ordered(list(operations), i):
            connection = servers.get(name) if servers else None
            server = backend_cpu(connection, local) if connection is not None else None
            cpu, clock = time.process_time(), time.perf_counter()
            await operations[name](i)
            wall, cpu = time.perf_counter() - clock, time.process_time() - cpu
            taken = samples[name]
            taken["wall"].append(wall * 1e6)
            taken["client"].append(cpu * 1e6)
            if server is not None:
                after = backend_cpu(connection, local)
                if after is not None:
                    taken["server"].append((after - server) * 1e6)
    return {
        name: {metric: statistics.median(values) for metric, values in taken.items() if values}
        for name, taken in samples.items()
    }


def compared_metrics(
    rounds: list[dict[str, dict[str, float]]], shipped: str, before: str, metrics: Sequence[str]
) -> dict[str, Any]:
    """``compared`` for each metric of ``per_operation``'s rounds (None for a metric that was not measured)."""
    out: dict[str, Any] = {}
    for metric in metrics:
        if all(metric in r[shipped] and metric in r[before] for r in rounds):
            out[metric] = compared([r[shipped][metric] for r in rounds], [r[before][metric] for r in rounds])
        else:
            out[metric] = None
    return out


async def guard_cost(dsn: str, rounds: int, statements: int) -> dict[str, Any]:
    """A statement through the ``LentConnection`` a transactional handler holds against the same statement on the
    asyncpg connection itself, statement by statement in turn: client CPU and wall time per statement; and a call
    that makes no round trip, which is the guard alone."""
    connection = await asyncpg.connect(dsn)
    try:
        targets: dict[str, Any] = {RAW: connection, LENT: LentConnection(connection)}
        for target in targets.values():  # prepared, and asyncpg's statement cache warm
            for i in range(200):
                await target.fetchval("SELECT $1::int", i)

        def statement(target: Any) -> Operation:
            async def run(i: int) -> object:
                return await target.fetchval("SELECT $1::int", i)

            return run

        operations = {name: statement(target) for name, target in targets.items()}
        measured: list[dict[str, dict[str, float]]] = []
        alone: dict[str, list[float]] = {name: [] for name in targets}
        calls = statements * 10
        for r in range(rounds):
            measured.append(await per_operation(operations, statements))
            for name in ordered(list(targets), r):
                target = targets[name]
                started = time.process_time()
                for _ in range(calls):
                    target.is_in_transaction()
                alone[name].append((time.process_time() - started) / calls * 1e6)
        started = time.process_time()
        for _ in range(calls):
            LentConnection(connection).end()
        lend = (time.process_time() - started) / calls * 1e6
    finally:
        await connection.close()
    per_statement = compared_metrics(measured, LENT, RAW, ("client", "wall"))
    return {
        "statements": statements,
        "client_us": per_statement["client"],
        "wall_us": per_statement["wall"],
        "call_us": compared(alone[LENT], alone[RAW]),
        "lend_us": lend,
    }


@dataclass
class Layout:
    """One table layout's statements, prepared on a connection of its own."""

    connection: asyncpg.Connection
    claim: asyncpg.prepared_stmt.PreparedStatement
    complete: asyncpg.prepared_stmt.PreparedStatement
    complete_in_transaction: asyncpg.prepared_stmt.PreparedStatement
    extra: tuple[None, ...]  # the shipped statements' parameters the one-table ones lack (all NULL in plain mode)
    completed_status: str  # what a completion that landed answers

    def claim_args(self, key: str) -> tuple[Any, ...]:
        fingerprint = [FINGERPRINT] if self.extra else FINGERPRINT  # the shipped claim takes one per fingerprint key
        return (TENANT_ID, key, fingerprint, LEASE, TTL, new_fence(), *self.extra[:1])

    def completion_args(self, key: str, fence: int) -> tuple[Any, ...]:
        headers = encode_headers(STORED.headers)
        return (TENANT_ID, key, fence, STORED.status, headers, STORED.body, STORED.body_size, *self.extra[1:])

    async def claim_fresh(self, key: str) -> int:
        row = await self.claim.fetchrow(*self.claim_args(key))
        assert row is not None, f"{key}: the claim returned no row"
        assert row["owned"], f"{key}: a fresh claim was not owned"
        return int(row["fence"])

    async def complete_plain(self, key: str, fence: int) -> None:
        await self.complete.fetch(*self.completion_args(key, fence))
        assert self.complete.get_statusmsg() == self.completed_status, f"{key}: not completed"

    async def replay(self, key: str) -> None:
        row = await self.claim.fetchrow(*self.claim_args(key))
        assert row is not None, f"{key}: the claim returned no row"
        completed = row["state"] == "completed" if "state" in row else row["completed"]
        assert completed, f"{key}: a completed key did not replay"
        assert row["status"] == STORED.status, f"{key}: the replay's status is {row['status']}"

    async def complete_in_a_transaction(self, key: str, fence: int) -> None:
        transaction = self.connection.transaction()
        await transaction.start()
        await self.complete_in_transaction.fetch(*self.completion_args(key, fence))
        status = self.complete_in_transaction.get_statusmsg()
        await transaction.commit()
        assert status == self.completed_status, f"{key}: not completed in the transaction"


def layout_step(
    layout: Layout, phase: str, keys: list[str], transactional: list[str], fences: dict[str, int]
) -> Operation:
    """The ``i``-th statement of ``phase`` on ``layout``: a fresh claim of ``keys[i]`` (its fence kept in
    ``fences``), its completion, its replay, or the completion of ``transactional[i]`` in a transaction."""

    async def run_one(i: int) -> object:
        if phase == FRESH_CLAIM:
            fences[keys[i]] = await layout.claim_fresh(keys[i])
        elif phase == COMPLETION:
            await layout.complete_plain(keys[i], fences[keys[i]])
        elif phase == REPLAY:
            await layout.replay(keys[i])
        else:
            await layout.complete_in_a_transaction(transactional[i], fences[transactional[i]])
        return None

    return run_one


def statements_of(text: str, schema: str) -> dict[str, str]:
    """A ``queries.sql`` split on its ``-- name:`` lines, in ``schema``."""
    parts = STATEMENT_NAME.split(text.replace("{schema}", f'"{schema}"').replace("{schema_name}", schema))
    return {name: body.strip() for name, body in zip(parts[1::2], parts[2::2], strict=True)}


async def responses_cost(dsn: str, local: bool, rounds: int, n: int) -> dict[str, Any]:
    """The store's statements with responses in a table of their own (shipped) against the one-table statements of
    the library before, each on a schema of its own in the same database, run through raw asyncpg (prepared, one
    connection each, one statement at a time) so that nothing but the statements differs. Per statement, the two
    layouts taking turns: wall time and the server process's CPU (a local server only); and WAL bytes, from the
    server's WAL position around a batch of each. Commits do not wait for their WAL flush (``synchronous_commit``
    off on these connections): both layouts flush once per commit, and a flush's time on a shared disk varies by
    more than the statements differ."""
    _, before_root = library_copy(BEFORE)
    sql = before_root / "idempotency_mw" / "sql"
    one, two = "bench_fixes_one_table", "bench_fixes_two_tables"
    admin = await asyncpg.connect(dsn)
    for schema in (one, two):
        await admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    await admin.execute(f'CREATE SCHEMA "{one}"')
    await admin.execute((sql / "migrations" / "0001_initial.sql").read_text().replace("{schema}", f'"{one}"'))
    migrating = PostgresStore(dsn, schema=two, min_size=0, max_size=1)
    await migrating.migrate()
    await migrating.close()
    layouts: dict[str, Layout] = {}
    phases = (FRESH_CLAIM, COMPLETION, REPLAY, IN_TRANSACTION)
    timed: dict[str, list[dict[str, dict[str, float]]]] = {phase: [] for phase in phases}
    wal: dict[str, dict[str, list[float]]] = {phase: {name: [] for name in (ONE_TABLE, TWO_TABLES)} for phase in phases}
    try:
        for name, statements, extra, landed in (
            (ONE_TABLE, statements_of((sql / "queries.sql").read_text(), one), (), "UPDATE 1"),
            (TWO_TABLES, queries(two), (None, None, None), "INSERT 0 1"),
        ):
            connection = await asyncpg.connect(dsn, server_settings={"synchronous_commit": "off"})
            in_transaction = statements.get("complete_in_transaction", statements["complete"])
            layouts[name] = Layout(
                connection,
                # the claim that answers every case in one statement, as the one-table library's did
                await connection.prepare(statements.get("claim_or_take_over", statements["claim"])),
                await connection.prepare(statements["complete"]),
                await connection.prepare(in_transaction),
                extra,
                landed,
            )
        servers = {name: layout.connection for name, layout in layouts.items()}
        run = uuid.uuid4().hex[:8]
        batch = min(n, 100)

        async def wal_of(phase: str, name: str, work: Callable[[], Awaitable[None]]) -> None:
            before = await wal_position(admin)
            await work()
            wal[phase][name].append((await wal_position(admin) - before) / batch)

        async def batches(name: str, prefix: str) -> None:
            """WAL bytes per statement, a batch of each phase in turn (and the warm-up)."""
            layout = layouts[name]
            keys = [f"{prefix}-{i}" for i in range(batch)]
            fences: dict[str, int] = {}
            transactional = [f"{prefix}-t{i}" for i in range(batch)]

            async def claims(chosen: list[str]) -> None:
                for key in chosen:
                    fences[key] = await layout.claim_fresh(key)

            async def completions() -> None:
                for key in keys:
                    await layout.complete_plain(key, fences[key])

            async def replays() -> None:
                for key in keys:
                    await layout.replay(key)

            async def in_transactions() -> None:
                for key in transactional:
                    await layout.complete_in_a_transaction(key, fences[key])

            await wal_of(FRESH_CLAIM, name, lambda: claims(keys))
            await wal_of(COMPLETION, name, completions)
            await wal_of(REPLAY, name, replays)
            await claims(transactional)
            await wal_of(IN_TRANSACTION, name, in_transactions)

        for name in layouts:  # warm-up: plans cached, the first pages of each table written
            await batches(name, f"{run}-warm-{len(name)}")
        for per_layout in wal.values():  # the warm-up's batches wrote the tables' first pages: not counted
            for values in per_layout.values():
                values.clear()
        for r in range(rounds):
            for name in ordered(list(layouts), r):
                await batches(name, f"{run}-wal-{r}-{len(name)}")
            keys = {name: [f"{run}-{r}-{len(name)}-{i}" for i in range(n)] for name in layouts}
            transactional = {name: [f"{run}-{r}-{len(name)}-t{i}" for i in range(n)] for name in layouts}
            fences: dict[str, int] = {}

            for phase in phases:
                if phase == IN_TRANSACTION:
                    for name, layout in layouts.items():
                        for key in transactional[name]:
                            fences[key] = await layout.claim_fresh(key)
                operations = {
                    name: layout_step(layout, phase, keys[name], transactional[name], fences)
                    for name, layout in layouts.items()
                }
                timed[phase].append(await per_operation(operations, n, servers, local))
    finally:
        for layout in layouts.values():
            await layout.connection.close()
        for schema in (one, two):
            await admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await admin.close()
    out: dict[str, Any] = {}
    for phase in phases:
        metrics = compared_metrics(timed[phase], TWO_TABLES, ONE_TABLE, ("wall", "server"))
        out[phase] = {
            "wall_us": metrics["wall"],
            "db_cpu_us": metrics["server"],
            "wal_bytes": compared(wal[phase][TWO_TABLES], wal[phase][ONE_TABLE]),
        }
    return {"statements": n, "wal_batch": batch, "phases": out}


async def claim_split_cost(dsn: str, local: bool, rounds: int, n: int) -> dict[str, Any]:
    """The claim as shipped, which leaves a takeover to ``claim_or_take_over``, against ``claim_or_take_over``
    answering the same requests itself, as the one claim statement of the library before did: per fresh claim and
    per replay, wall time and the server process's CPU, through raw asyncpg on the store's tables, prepared, one
    connection each, one statement at a time, the two taking turns. Commits do not wait for their WAL flush, as in
    :func:`responses_cost`. The first round warms up and is not counted."""
    migrating = PostgresStore(dsn, min_size=0, max_size=1)
    await migrating.migrate()
    await migrating.close()
    sql = queries("public")
    names = (LEAN, EVERY_CASE)
    connections = {name: await asyncpg.connect(dsn, server_settings={"synchronous_commit": "off"}) for name in names}
    timed: dict[str, list[dict[str, dict[str, float]]]] = {FRESH_CLAIM: [], REPLAY: []}
    try:
        prepared = {
            LEAN: await connections[LEAN].prepare(sql["claim"]),
            EVERY_CASE: await connections[EVERY_CASE].prepare(sql["claim_or_take_over"]),
        }
        complete = await connections[LEAN].prepare(sql["complete"])
        run = uuid.uuid4().hex[:8]

        def step(statement: Any, phase: str, keys: list[str], fences: dict[str, int]) -> Operation:
            async def run_one(i: int) -> object:
                row = await statement.fetchrow(TENANT_ID, keys[i], [FINGERPRINT], LEASE, TTL, new_fence(), None)
                assert row is not None, f"{keys[i]}: the claim returned no row"
                if phase == FRESH_CLAIM:
                    assert row["owned"], f"{keys[i]}: a fresh claim was not owned"
                    fences[keys[i]] = int(row["fence"])
                else:
                    assert row["completed"], f"{keys[i]}: a completed key did not replay"
                return None

            return run_one

        for r in range(rounds + 1):
            keys = {name: [f"{run}-split-{r}-{len(name)}-{i}" for i in range(n)] for name in names}
            fences: dict[str, int] = {}
            fresh = await per_operation(
                {name: step(prepared[name], FRESH_CLAIM, keys[name], fences) for name in names}, n, connections, local
            )
            headers = encode_headers(STORED.headers)
            for key, fence in fences.items():
                await complete.fetch(
                    TENANT_ID, key, fence, STORED.status, headers, STORED.body, STORED.body_size, None, None
                )
            replay = await per_operation(
                {name: step(prepared[name], REPLAY, keys[name], fences) for name in names}, n, connections, local
            )
            if r:
                timed[FRESH_CLAIM].append(fresh)
                timed[REPLAY].append(replay)
    finally:
        for connection in connections.values():
            await connection.close()
    return {
        "statements": n,
        "phases": {
            phase: {
                "wall_us": (metrics := compared_metrics(timed[phase], LEAN, EVERY_CASE, ("wall", "server")))["wall"],
                "db_cpu_us": metrics["server"],
            }
            for phase in timed
        },
    }


async def isolation_cost(dsn: str, rounds: int, n: int) -> dict[str, Any]:
    """Fresh plain-mode requests' store work (``claim`` then ``complete``) on a database whose default isolation is
    REPEATABLE READ, the variants taking turns request by request: through an app's asyncpg pool, each statement in
    a READ COMMITTED transaction of its own (shipped) against the plain statements of before; and through the
    store's own pool, pinned to READ COMMITTED per connection (shipped) against not pinned. Wall time and client
    CPU per request; commits do not wait for their WAL flush (``synchronous_commit`` off on that database), of
    which every variant has one per statement."""
    name = f"bench_fixes_rr_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(dsn)
    await admin.execute(f'CREATE DATABASE "{name}"')
    stores: dict[str, PostgresStore] = {}
    pool: asyncpg.Pool | None = None
    measured: dict[str, list[dict[str, dict[str, float]]]] = {what: [] for what in ISOLATION_PAIRS}
    checkouts: list[dict[str, dict[str, float]]] = []
    try:
        await admin.execute(f"ALTER DATABASE \"{name}\" SET default_transaction_isolation = 'repeatable read'")
        await admin.execute(f'ALTER DATABASE "{name}" SET synchronous_commit = off')
        url = with_database(dsn, name)
        migrating = PostgresStore(url, min_size=0, max_size=1)
        await migrating.migrate()
        await migrating.close()
        pool = await asyncpg.create_pool(url, min_size=4, max_size=4)
        for variant in (APP_EXPLICIT, APP_PLAIN, APP_NO_SHARE):
            stores[variant] = PostgresStore(pool)
        for variant in (OWN_PINNED, OWN_UNPINNED):
            stores[variant] = PostgresStore(url, min_size=1, max_size=2)
        own = stores[OWN_UNPINNED]._connector
        assert isinstance(own, OwnPool)
        own.pool.setup = None  # this comparison only: the statements run under the database's default, as before
        for store in stores.values():
            await store.open()
        for variant in (APP_PLAIN, APP_NO_SHARE):
            connector = stores[variant]._connector
            assert isinstance(connector, AppPool)
            assert connector._explicit is True  # it found REPEATABLE READ
            connector._explicit = False  # this comparison only: plain statements, as before
        without_share(stores[APP_NO_SHARE]._connector, pool)
        assert stores[OWN_PINNED].database_isolation == "repeatable read"
        assert stores[OWN_UNPINNED].database_isolation is None
        run = uuid.uuid4().hex[:8]

        def request(variant: str, prefix: str) -> Operation:
            store = stores[variant]

            async def run_one(i: int) -> object:
                key = f"{prefix}-{len(variant)}-{i}"
                claim = await store.claim(TENANT_ID, key, FINGERPRINT, lease=LEASE, ttl=TTL)
                assert claim.outcome is ClaimOutcome.OWNED
                return await store.complete(TENANT_ID, key, claim.fence, STORED)

            return run_one

        await per_operation({variant: request(variant, f"{run}-warm") for variant in stores}, 50)
        for r in range(rounds):
            for g, what in enumerate(ordered(list(ISOLATION_PAIRS), r)):  # two variants at a time, taking turns
                operations = {variant: request(variant, f"{run}-{r}-{g}") for variant in ISOLATION_PAIRS[what]}
                measured[what].append(await per_operation(operations, n))

        def checkout(connector: Any) -> Operation:
            async def run_one(i: int) -> object:
                connection = await connector._acquire(False)
                await connector._release(connection)
                return None

            return run_one

        alone = {variant: checkout(stores[variant]._connector) for variant in (APP_PLAIN, APP_NO_SHARE)}
        await per_operation(alone, 50)
        for _ in range(rounds):
            checkouts.append(await per_operation(alone, n))
    finally:
        for store in stores.values():
            await store.close()
        if pool is not None:
            await pool.close()
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
    measured[CHECKOUT_COMPARED] = checkouts
    compared_pairs: dict[str, Any] = {}
    for what, (shipped, before) in (*ISOLATION_PAIRS.items(), (CHECKOUT_COMPARED, (APP_PLAIN, APP_NO_SHARE))):
        metrics = compared_metrics(measured[what], shipped, before, ("wall", "client"))
        compared_pairs[what] = {"wall_us": metrics["wall"], "client_us": metrics["client"]}
    return {"requests": n, "compared": compared_pairs}


def without_share(connector: object, pool: asyncpg.Pool) -> None:
    """An app's pool as the store used it before 0.2.0 (this comparison only): a checkout straight from the pool,
    without the share that keeps one connection for the work that finishes requests."""
    assert isinstance(connector, AppPool)
    for name in ("_acquire", "_release"):  # replaced below: a renamed method would leave the share in place
        assert callable(getattr(connector, name, None)), f"AppPool has no {name} any more"
    timeout = connector.timeout

    async def acquire(urgent: bool) -> asyncpg.Connection:
        with reachable():
            return cast(asyncpg.Connection, await pool.acquire(timeout=timeout))

    async def release(connection: asyncpg.Connection) -> None:
        with contextlib.suppress(Exception):
            await pool.release(cast(asyncpg.pool.PoolConnectionProxy, connection), timeout=timeout)

    connector._acquire = acquire  # type: ignore[method-assign]
    connector._release = release  # type: ignore[method-assign]


async def restore_cost(dsn: str, local: bool, rounds: int, n: int) -> dict[str, Any]:
    """What a lent connection runs as it comes back, the variants taking turns reset by reset: the full reset with
    the SQL that restores its pool's session state (shipped) against the reset alone (before). On a connection of
    the store's own (the READ COMMITTED pin) and on one of an app's pool whose ``init`` sets a role and two
    settings; and the capture of that state, once per connection of an app's pool."""
    own = await asyncpg.connect(dsn)
    await own.fetchrow(session()["pin_read_committed"])
    set_restore(own, PIN_RESTORE)  # as OwnPool does for each connection it opens

    async def init(connection: asyncpg.Connection) -> None:
        role = await connection.fetchval("SELECT current_user")
        await connection.execute(
            f"SET ROLE \"{role}\"; SET search_path = bench_app, public; SET statement_timeout = '30s'"
        )

    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1, init=init)
    app = await pool.acquire()
    measured: dict[str, list[dict[str, dict[str, float]]]] = {OWN_RESTORE: [], APP_RESTORE: []}
    try:
        captures = max(n // 5, 1)
        started = time.perf_counter()
        for _ in range(captures):
            await app.fetchval(session()["capture"])
        capture = (time.perf_counter() - started) / captures * 1e6
        await remember(app, time_limit=5.0)
        connections = {OWN_RESTORE: own, APP_RESTORE: app}
        for connection in connections.values():
            assert reset_sql(connection) != reset_session() + "\n", "no pool state to restore"

        def resets(connection: Any) -> dict[str, Operation]:
            async def reset_only(i: int) -> object:
                return await connection.execute(reset_session())

            async def reset_and_restore(i: int) -> object:
                return await connection.execute(reset_sql(connection))

            return {RESET_ONLY: reset_only, RESET_RESTORE: reset_and_restore}

        for where, connection in connections.items():
            servers = {variant: connection for variant in (RESET_ONLY, RESET_RESTORE)}
            await per_operation(resets(connection), 20, servers, local)  # warm-up
            for _ in range(rounds):
                measured[where].append(await per_operation(resets(connection), n, servers, local))
        await app.execute(reset_sql(app))
        restored = await app.fetchval("SELECT current_setting('search_path')")
        assert restored == "bench_app, public", f"the app pool's search_path came back as {restored!r}"
    finally:
        await pool.release(app)
        await pool.close()
        await own.close()
    out: dict[str, Any] = {}
    for where, rounds_measured in measured.items():
        metrics = compared_metrics(rounds_measured, RESET_RESTORE, RESET_ONLY, ("wall", "server"))
        out[where] = {"wall_us": metrics["wall"], "db_cpu_us": metrics["server"]}
    return {"resets": n, "capture_us": capture, "compared": out}


def pieces_compared(rounds: int, n: int) -> dict[str, Any]:
    """``fixpieces.py`` on the working tree and on the library before, one process each per round, alternating."""
    commit, before_root = library_copy(BEFORE)
    roots = {LIBRARY_SHIPPED: REPO, LIBRARY_BEFORE: before_root}
    per: dict[str, list[dict[str, float]]] = {which: [] for which in roots}
    for r in range(rounds):
        for which in ordered(list(roots), r):
            done = subprocess.run(
                [sys.executable, str(HERE / "fixpieces.py"), "-n", str(n)],
                cwd=str(HERE),
                env=bench_env(str(roots[which])),
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
            if done.returncode != 0:
                raise RuntimeError(f"fixpieces.py on the {which} library failed: {done.stderr[-3000:]}")
            found = json.loads(done.stdout)
            check_copy(f"fixpieces.py ({which})", found["library"], roots[which])
            per[which].append(found["us"])
    names = list(per[LIBRARY_SHIPPED][0])
    return {
        "before": commit,
        "calls": n,
        "pieces": {
            name: compared([p[name] for p in per[LIBRARY_SHIPPED]], [p[name] for p in per[LIBRARY_BEFORE]])
            for name in names
        },
    }


def new_pieces(n: int) -> dict[str, float]:
    """µs per call of what this round added to the request path with nothing before it to compare with."""
    started = time.process_time()
    for _ in range(n):
        outer = sys.exception()  # as a transactional run starts the app
        handling = sys.exception()  # as the response starts
        _ = handling is not None and handling is not outer
    return {"the exception check of a transactional response": (time.process_time() - started) / n * 1e6}


async def exactly_once(dsn: str, pid: int | None, rounds: int, quick: bool) -> dict[str, Any]:
    local = pid is not None
    return {
        "guard": await guard_cost(dsn, rounds, 2000 if quick else 5000),
        "responses": await responses_cost(dsn, local, rounds, 200 if quick else 800),
        "claim_split": await claim_split_cost(dsn, local, rounds, 200 if quick else 800),
        "isolation": await isolation_cost(dsn, rounds, 200 if quick else 800),
        "restore": await restore_cost(dsn, local, rounds, 200 if quick else 800),
        "pieces": pieces_compared(rounds, 20000 if quick else 50000),
        "new_pieces": new_pieces(200000),
    }


async def main(dsn: str, pid: int | None, quick: bool) -> dict[str, Any]:
    rounds = 5 if quick else 9
    loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
    return {
        "concurrency": CONCURRENCY,
        "rounds": rounds,
        "loop": "uvloop" if loop == "uvloop" else "asyncio",
        "reset": await reset_cost(dsn, pid, rounds, 1000 if quick else 2000),
        "settle": await settle_cost(dsn, rounds, 1000 if quick else 3000),
        "pieces": await pieces(50000),
        "exactly_once": await exactly_once(dsn, pid, rounds, quick),
    }


# -- rendering (run.py) -----------------------------------------------------------------------------------------


def targets(result: dict[str, Any]) -> list[Target]:
    reset = result["reset"]
    full, partial, function = reset[FULL], reset[PARTIAL], reset[FUNCTION]
    settle = result["settle"]
    return [
        Target(
            "14.6 transactional requests/s with the full session reset vs asyncpg's partial one",
            "published",
            f"{reset['rps_ratio']:.2f}x (database CPU {full['postgres_us']:.0f} vs {partial['postgres_us']:.0f} µs, "
            f"client {full['client_us']:.0f} vs {partial['client_us']:.0f} µs per request; with the deallocation in "
            f"a function {reset['rps_ratio_function']:.2f}x, database {function['postgres_us']:.0f} µs)",
            None,
        ),
        Target(
            "14.6 the settle task per fresh request",
            "published",
            f"{settle['PostgresStore'][f'added_us {SHIPPED}']:+.1f} µs on PostgresStore, "
            f"{settle['MemoryStore'][f'added_us {SHIPPED}']:+.1f} µs on MemoryStore vs awaiting it directly "
            f"(a task from the start: {settle['PostgresStore'][f'added_us {FROM_THE_START}']:+.1f} and "
            f"{settle['MemoryStore'][f'added_us {FROM_THE_START}']:+.1f} µs)",
            None,
        ),
        Target(
            "14.6 the lease keeper per request (hold + drop)",
            "published",
            f"{result['pieces']['lease keeper: hold + drop']:.1f} µs",
            None,
        ),
        *(exactly_once_targets(result["exactly_once"]) if "exactly_once" in result else []),
    ]


def exactly_once_targets(found: dict[str, Any]) -> list[Target]:
    guard, phases = found["guard"], found["responses"]["phases"]
    split = found["claim_split"]["phases"] if "claim_split" in found else None
    isolation, restore = found["isolation"]["compared"], found["restore"]["compared"]
    explicit, pin, share = isolation[APP_COMPARED], isolation[OWN_COMPARED], isolation[CHECKOUT_COMPARED]
    pieces = found["pieces"]["pieces"]
    chosen = [pieces[name] for name in (FORM_ESCAPED_PIECE, FORM_ASCII_PIECE, RECORDER_PIECE, LEASE_PIECE)]

    def spread(c: dict[str, Any], digits: int, unit: str = " µs") -> str:
        return f"{c['added']:+.{digits}f}{unit} (rounds {c['low']:+.{digits}f} to {c['high']:+.{digits}f})"

    def database(phase: str, compared: dict[str, Any] | None = None) -> str:
        cpu = (compared or phases)[phase]["db_cpu_us"]
        return f"{spread(cpu, 0)} database CPU" if cpu is not None else "database CPU not measured"

    return [
        Target(
            "0.2.0 the guard on the lent connection, per statement the handler runs",
            "published",
            f"{spread(guard['call_us'], 2)} per call without a round trip ({guard['call_us']['before']:.2f} to "
            f"{guard['call_us']['shipped']:.2f} µs); client CPU per statement {spread(guard['client_us'], 1)}",
            None,
        ),
        Target(
            "0.2.0 responses in a table of their own, per statement",
            "published",
            f"completion {database(COMPLETION)}, {phases[COMPLETION]['wal_bytes']['added']:+.0f} B WAL; in the "
            f"handler's transaction {database(IN_TRANSACTION)}; fresh claim {database(FRESH_CLAIM)}; replay "
            f"{database(REPLAY)}",
            None,
        ),
        *(
            [
                Target(
                    "0.2.0 the claim without a takeover's parts (a takeover in a second statement), per statement",
                    "published",
                    f"fresh claim {database(FRESH_CLAIM, split)}; replay {database(REPLAY, split)}",
                    None,
                )
            ]
            if split is not None
            else []
        ),
        Target(
            "0.2.0 the store's statements held to READ COMMITTED on a REPEATABLE READ database, per fresh request",
            "published",
            f"app's pool {spread(explicit['client_us'], 0)} client CPU, {explicit['wall_us']['added']:+.0f} µs wall "
            "(two statements, each in a transaction of its own); own pool, pinned once per connection: "
            f"{spread(pin['client_us'], 1)} client CPU for the same client code, this comparison's resolution; the "
            f"share of an app's pool kept for finishing work {spread(share['client_us'], 1)} client CPU per checkout",
            None,
        ),
        Target(
            "0.2.0 the pool's session state restored, per lent connection",
            "published",
            "; ".join(
                f"{where} {values['wall_us']['added']:+.0f} µs wall"
                + (f", {spread(values['db_cpu_us'], 0)} database CPU" if values["db_cpu_us"] else "")
                for where, values in restore.items()
            ),
            None,
        ),
        Target(
            "0.2.0 the fingerprint's UTF-8 escapes, the recorder's headers, the lease keeper per loop",
            "published",
            f"{spread(pieces[FORM_ESCAPED_PIECE], 2)} (a form with UTF-8 escapes), "
            f"{spread(pieces[FORM_ASCII_PIECE], 2)} (an ASCII form), {spread(pieces[RECORDER_PIECE], 2)}, "
            f"{spread(pieces[LEASE_PIECE], 2)}"
            + (": rounds on both sides of zero for each" if all(c["low"] <= 0 <= c["high"] for c in chosen) else ""),
            None,
        ),
    ]


def render(result: dict[str, Any]) -> str:
    reset = result["reset"]
    settle = result["settle"]
    return "\n\n".join(
        [
            "# What the fixes cost: issue 10's, and 0.2.0's for any isolation level and the app's connections",
            f"In process, under {result.get('loop', 'uvloop')}, each fix side by side with what it replaced, "
            f"{result['rounds']} interleaved rounds, medians. The fingerprint's cost per body shape is in "
            "[fingerprint.md](fingerprint.md).",
            target_table(targets(result)),
            "## The fixes of issue 10",
            f"The ASGI app called directly, {result['concurrency']} requests at a time.",
            "**Session reset** (defect 2): transactional requests on `PostgresStore` (claim, one INSERT by the "
            "handler on the lent connection, completion, commit, the connection's reset), with the full reset of "
            "`sql/reset_session.sql` against asyncpg's own (`RESET ALL`-style, which leaves the role, temp tables "
            "and prepared statements), and the full reset with its `DO` block (which PostgreSQL compiles anew at "
            "every reset) replaced by a call of a PL/pgSQL function (compiled once per server process), which a "
            "migration could add: not shipped, measured to say what it would save. All are one round trip.",
            table(
                ["reset", "requests/s", "client CPU µs/req", "database CPU µs/req", "each round, requests/s"],
                [
                    [
                        name,
                        f"{reset[name]['rps']:.0f}",
                        f"{reset[name]['client_us']:.0f}",
                        f"{reset[name]['postgres_us']:.0f}",
                        ", ".join(str(x) for x in reset[name]["each_rps"]),
                    ]
                    for name in (FULL, PARTIAL, FUNCTION)
                ],
            ),
            "**Settle point** (defects 3 and 4): fresh requests, client CPU per request. The settlement runs in a "
            "task of its own (as shipped: `eager.start_eagerly`, an eager task on Python 3.12+ and a task from "
            "the start on 3.11, waited for through `eager.outlasting`; a cancelled request still finishes writing "
            "its record); in a task from its start waited for through `asyncio.shield` (as first written, with the "
            "same guarantee; on 3.11 the same task as shipped); and awaited "
            "directly (a variant made here only, without the guarantee). On `MemoryStore` the settlement never "
            "waits, so a task from the start adds two turns of the event loop that an eager task does not take. "
            "Every variant runs from the same stand-in for the handler's `send` (the shipped one settles inline, "
            "one coroutine level fewer), so the differences between them are the point.",
            table(
                ["store", f"{SHIPPED}, µs", f"{FROM_THE_START}, µs", f"{DIRECT}, µs"],
                [
                    [
                        store,
                        f"{values[SHIPPED]:.1f} ({values[f'added_us {SHIPPED}']:+.1f})",
                        f"{values[FROM_THE_START]:.1f} ({values[f'added_us {FROM_THE_START}']:+.1f})",
                        f"{values[DIRECT]:.1f}",
                    ]
                    for store, values in settle.items()
                ],
            ),
            "Each mechanism alone (µs per call):",
            table(["piece", "µs"], [[name, f"{value:.2f}"] for name, value in result["pieces"].items()]),
            *(render_exactly_once(result["exactly_once"], result["rounds"]) if "exactly_once" in result else []),
        ]
    )


def cells(c: dict[str, Any], digits: int) -> list[str]:
    """Before, shipped, and the paired difference with its range over rounds."""
    return [
        f"{c['before']:.{digits}f}",
        f"{c['shipped']:.{digits}f}",
        f"{c['added']:+.{digits}f} ({c['low']:+.{digits}f} to {c['high']:+.{digits}f})",
    ]


def statement_cells(values: dict[str, Any]) -> list[str]:
    """A statement's wall time and database CPU, each before, shipped and added (dashes for CPU not measured)."""
    cpu = cells(values["db_cpu_us"], 0) if values["db_cpu_us"] is not None else ["-", "-", "-"]
    return [*cells(values["wall_us"], 0), *cpu]


def render_claim_split(split: dict[str, Any]) -> list[str]:
    return [
        "**The claim without a takeover's parts**: `claim` answers a fresh key, a replay, a 409 and a 422 and "
        "leaves an expired record or a lapsed lease to `claim_or_take_over`, which answers every case as the one "
        "claim statement did. PostgreSQL sets up every part of a statement each time it runs it, so the two are "
        "compared on the requests both answer: the same tables, through raw asyncpg, prepared, one connection "
        f"each, {split['statements']} keys per phase and round, fresh claims and then a replay of each once they "
        "are completed; commits do not wait for their flush (as above). *before* is `claim_or_take_over`, "
        "*shipped* `claim`.",
        table(
            [
                "statement",
                "wall before, µs",
                "shipped",
                "added (rounds)",
                "database CPU before, µs",
                "shipped",
                "added",
            ],
            [[phase, *statement_cells(values)] for phase, values in split["phases"].items()],
        ),
    ]


def render_exactly_once(found: dict[str, Any], rounds: int) -> list[str]:
    guard, responses, isolation = found["guard"], found["responses"], found["isolation"]
    restore, pieces = found["restore"], found["pieces"]
    paired = "median of the round-by-round differences, shipped minus before, and their range"
    return [
        "## The fixes of 0.2.0: any isolation level, the app's connection state, lent connections",
        f"Each fix on a hot path against what it replaced, in {rounds} rounds. One operation at a time (no "
        "concurrency, so a difference is the fix's and not a queue's), the variants taking turns operation by "
        "operation, each operation timed alone; a round's figure is the median over its operations (a preempted "
        'one does not move it), every number below is the median over rounds, and "added" the '
        f"{paired}. The library before these fixes is commit `{pieces['before'][:7]}`.",
        "**The guard on the lent connection**: a transactional handler's connection is a `LentConnection`, which "
        "refuses every call once its request has ended. A statement (`fetchval('SELECT $1::int')`, "
        f"{guard['statements']} per round) through it and on the asyncpg connection itself; and a call that "
        f"makes no round trip (`is_in_transaction()`, {guard['statements'] * 10} in a row per round and variant), "
        "which is the guard alone. Lending and ending a "
        f"`LentConnection` costs {guard['lend_us']:.2f} µs per request.",
        table(
            ["per statement", "before, µs", "shipped, µs", "added, µs (rounds)"],
            [
                ["client CPU, a statement", *cells(guard["client_us"], 1)],
                ["wall time, a statement", *cells(guard["wall_us"], 1)],
                ["client CPU, a call without a round trip", *cells(guard["call_us"], 2)],
            ],
        ),
        "**Responses in a table of their own** (`idempotency_responses`): compared statement by statement, "
        "not through the stores, because the store before these fixes also differs in its connections, its claim's "
        "commit (one WAL flush per transactional request) and the waiters' notifications, which a comparison of "
        "whole requests would put on the table layout. The statements of "
        f"`{pieces['before'][:7]}` (one table) and the shipped ones (two tables; plain-mode parameters, the new ones "
        "NULL) each on a schema of their own in the same database, through raw asyncpg, prepared, one connection "
        f"each, {responses['statements']} keys per phase and round: fresh claims, their completions, a replay of "
        "each, and completions in a transaction of their own as a handler's transaction completes (`BEGIN`, the "
        "completion, `COMMIT`; the one-table library completed there with its plain `UPDATE`). Database CPU is the "
        "server process's, from `/proc/<pid>/schedstat` (a local server only); WAL bytes come from the server's WAL "
        f"position around a batch of {responses['wal_batch']} statements of one layout at a time (they vary little "
        "round to round); commits do not wait for their WAL "
        "flush (`synchronous_commit` off on these two connections): both layouts flush once per commit, and a "
        "flush's time on this shared disk varies by more than the statements do.",
        table(
            [
                "statement",
                "wall before, µs",
                "shipped",
                "added (rounds)",
                "database CPU before, µs",
                "shipped",
                "added (rounds)",
                "WAL before, B",
                "shipped",
            ],
            [
                [
                    phase,
                    *statement_cells(values),
                    f"{values['wal_bytes']['before']:.0f}",
                    f"{values['wal_bytes']['shipped']:.0f}",
                ]
                for phase, values in responses["phases"].items()
            ],
        ),
        *(render_claim_split(found["claim_split"]) if "claim_split" in found else []),
        "**The store's statements under READ COMMITTED** on a database whose default is REPEATABLE READ "
        "(`ALTER DATABASE … SET default_transaction_isolation`), and whose commits do not wait for their flush "
        f"(as above). {isolation['requests']} fresh plain-mode requests per round and variant, each "
        "`PostgresStore.claim` then `complete`. Through an app's asyncpg pool the store cannot set anything on the "
        "app's sessions, so each statement runs in a READ COMMITTED transaction of its own (`BEGIN`, the "
        "statement, `COMMIT`: two round trips more per statement) against the plain statements of before, which "
        "fail under concurrent writes on such a database; on its own pool each connection is pinned once as it "
        "opens, against connections not pinned. And the share an app's pool now keeps for the work that finishes "
        "requests (a semaphore and a deadline around each checkout that does not finish a request: a fresh request "
        "has one, its claim's) against a checkout straight from the pool, in those requests and alone (a checkout "
        "and its release, which runs asyncpg's own reset either way). The store's own pool runs the same statements "
        "and the same client code per request pinned or not (the pin is one query as a connection opens): its row "
        "shows what this comparison resolves.",
        table(
            [
                "what",
                "wall before, µs",
                "shipped",
                "added (rounds)",
                "client CPU before, µs",
                "shipped",
                "added (rounds)",
            ],
            [
                [what, *cells(values["wall_us"], 0), *cells(values["client_us"], 1)]
                for what, values in isolation["compared"].items()
            ],
        ),
        "**The pool's session state restored per lend**: what a lent connection runs as it comes back, timed "
        f"alone ({restore['resets']} per round): `sql/reset_session.sql`, then the SQL that gives the connection "
        "back the state its pool set up (shipped), against the reset alone (before, which left a connection of "
        "the app's pool without the role its `init` set). On a connection of the store's own pool that state is "
        "its READ COMMITTED pin; on one of an app's pool, an `init` that runs `SET ROLE`, `SET search_path` and "
        "`SET statement_timeout`. Both are one round trip. Reading that state, once per connection of an app's "
        f"pool the first time it is lent, takes {restore['capture_us']:.0f} µs (a query of `pg_settings`).",
        table(
            [
                "connection",
                "wall before, µs",
                "shipped",
                "added (rounds)",
                "database CPU before, µs",
                "shipped",
                "added (rounds)",
            ],
            [
                [
                    where,
                    *cells(values["wall_us"], 0),
                    *(cells(values["db_cpu_us"], 0) if values["db_cpu_us"] is not None else ["-", "-", "-"]),
                ]
                for where, values in restore["compared"].items()
            ],
        ),
        "**Pieces of the request path** that changed with these fixes, each timed alone (CPU time, "
        f"{pieces['calls']} calls, the cycle collector paused) by `fixpieces.py` in a process of its own on the "
        f"shipped library and on `{pieces['before'][:7]}`, alternating: the fingerprint's form and query decoding "
        "(%XX escapes read as UTF-8, as Starlette reads them), the recorder's response start (headers that come "
        "as an iterator are copied into the message that goes on; a list passes as before) and the lease keeper "
        "(one set of leases and timer per event loop). A process's own speed varies from one to the next by more "
        "than some of these differences: the rounds' range says how much.",
        table(
            ["piece", "before, µs", "shipped, µs", "added, µs (rounds)"],
            [[name, *cells(values, 2)] for name, values in pieces["pieces"].items()],
        ),
        "New on the path with nothing before it: "
        + "; ".join(f"{name}, {value:.2f} µs" for name, value in found["new_pieces"].items())
        + " (`sys.exception()` as the app starts and as its response starts, which tells a response the app made "
        "of an exception, whose writes roll back).",
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--postmaster-pid", type=int)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    try:
        from uvloop import run as run_loop
    except ImportError:
        run_loop = asyncio.run  # type: ignore[assignment]
    json.dump(run_loop(main(args.dsn, args.postmaster_pid, args.quick)), sys.stdout)
