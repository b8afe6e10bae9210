"""Issue 14, target 6: what the fixes of issue 10 cost, each measured side by side with the variant it replaced.

    benchmarks/.work/venv/bin/python benchmarks/fixes.py --dsn postgresql://… [--postmaster-pid N] [--quick]

In process, under uvloop, the ASGI app called directly (no sockets), variants interleaved round after round:

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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import asyncpg
import psutil
from benchapp import TENANT_SECRET
from common import Target, table, target_table
from overhead import BASE_HEADERS, SCOPE, Sink, receive
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idempotency_mw import AuthorizationTenant, IdempotencyMiddleware, MemoryStore, PostgresStore
from idempotency_mw.connectors import OwnPool, StoreConnection
from idempotency_mw.context import idempotency_context
from idempotency_mw.eager import outlasting, start_eagerly
from idempotency_mw.leases import LeaseKeeper
from idempotency_mw.recording import PlainRun

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


async def main(dsn: str, pid: int | None, quick: bool) -> dict[str, Any]:
    rounds = 5 if quick else 9
    return {
        "concurrency": CONCURRENCY,
        "rounds": rounds,
        "reset": await reset_cost(dsn, pid, rounds, 1000 if quick else 2000),
        "settle": await settle_cost(dsn, rounds, 1000 if quick else 3000),
        "pieces": await pieces(50000),
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
    ]


def render(result: dict[str, Any]) -> str:
    reset = result["reset"]
    settle = result["settle"]
    return "\n\n".join(
        [
            "# What the fixes of issue 10 cost",
            f"In process, uvloop, the ASGI app called directly, {result['concurrency']} requests at a time, "
            f"{result['rounds']} interleaved rounds, medians. The fingerprint's cost per body shape is in "
            "[fingerprint.md](fingerprint.md).",
            target_table(targets(result)),
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
        ]
    )


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
