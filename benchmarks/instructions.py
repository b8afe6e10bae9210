"""Issue 14, attribution: machine instructions per request, counted by valgrind, in process.

    benchmarks/.work/venv/bin/python benchmarks/instructions.py --dsn postgresql://…   # prints JSON

Time on a shared 2-core machine moves by a third between two runs of the same code; the instructions a process
executes do not. So this measures what the other benchmarks time, as a count: the user-space instructions
(valgrind's ``Ir``) the app process executes per fresh-key request, and per claim+complete pair of the store path.
System calls are outside the count (the kernel's side of a socket write is not an instruction of the process), so
a ratio here is larger than the same ratio of CPU time, which includes them.

Each figure comes from two runs of the same driver under ``valgrind --tool=cachegrind --cache-sim=no``, one with
more requests than the other: the difference over the difference in requests is the cost of one request, without
the interpreter's start, the imports and the connections. A driver (``--drive``) runs in process, as overhead.py
and storepath.py do, 16 requests at a time, under uvloop, against the same PostgreSQL:

- requests: ``bare`` (the app without middleware), ``handwritten`` (the baseline of target 14.1), ``ours``
  (the middleware on PostgresStore, as the end-to-end servers run it), each built by ``benchapp.build``;
- ``ours`` with one part of the middleware taken out at a time, to show what that part costs. These are for
  attribution only, never for use: ``tasks`` awaits the claim and the settlement in the request's own task, which
  a cancellation (a server shutting down) would then lose;
- pairs: ``raw`` (prepared asyncpg statements on a connection per task) and ``store`` (``PostgresStore.claim`` +
  ``complete``), the two variants of target 14.2.

The cycle collector is off in the driver runs, so that two counts of the same code agree (a collection of the whole
heap inside one run and not the other would move a count by tens of thousands); ours and the hand-written app are
counted again with it on, for its share.

Needs valgrind (``apt install valgrind``); without it the measurement says so and measures nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from common import table

CONCURRENCY = 16
REQUESTS = ("bare", "handwritten", "ours")
ABLATIONS = {
    "tasks": "the claim and the settlement awaited in the request's own task, without a task each and a wait that "
    "outlasts a cancellation (unsafe: a cancellation would lose them)",
    "fingerprint": "the fingerprint a SHA-256 of the body, without canonical JSON",
    "tenant": "a fixed tenant, without the HMAC of the Authorization header",
    "events": "no on_event hook (the default one logs nothing at the default level, but is asked)",
}
PAIRS = ("raw", "store")


# -- the drivers (run under valgrind) ----------------------------------------------------------------------------


def _ablated_app(dsn: str, ablation: str) -> tuple[Any, Any, Any]:
    """``ours`` as benchapp builds it, with one part taken out (see ABLATIONS)."""
    import benchapp
    from starlette.applications import Starlette
    from starlette.middleware import Middleware

    import idempotency_mw.middleware as middleware
    from idempotency_mw import AuthorizationTenant, IdempotencyMiddleware, PostgresStore

    store = PostgresStore(dsn)
    options: dict[str, Any] = {"tenant": AuthorizationTenant(benchapp.TENANT_SECRET)}
    if ablation == "tasks":
        _inline_tasks(middleware)
    elif ablation == "fingerprint":
        middleware.fingerprint = lambda method, path, query, content_type, body, *exclude: hashlib.sha256(body).digest()
    elif ablation == "tenant":
        options["tenant"] = lambda scope: "bench-tenant"
    elif ablation == "events":
        options["on_event"] = None
    else:
        raise SystemExit(f"unknown ablation {ablation!r}")
    app = Starlette(routes=benchapp.routes(), middleware=[Middleware(IdempotencyMiddleware, store=store, **options)])
    return app, store.open, store.close


class _Inline:
    """Stands in for a task: awaiting it runs the coroutine in the awaiting task."""

    used = 0

    def __init__(self, coroutine: Any, name: str = "") -> None:
        self.coroutine, self.finished, self.result = coroutine, False, None
        _Inline.used += 1

    def __await__(self) -> Any:
        if not self.finished:
            self.result = yield from self.coroutine.__await__()
            self.finished = True
        return self.result

    def done(self) -> bool:
        return self.finished


def _inline_tasks(middleware: Any) -> None:
    """The middleware's tasks (``start_eagerly``: the claim's, and plain mode's settlement in recording.py) and the
    waits that outlast a cancellation (``outlasting``) become plain awaits."""
    import idempotency_mw.recording as recording

    for module in (middleware, recording):
        module.start_eagerly = _Inline
        module.outlasting = lambda task: task


async def _requests(dsn: str, variant: str, count: int) -> None:
    import benchapp
    import overhead
    from pgserver import Database

    if variant in REQUESTS:
        app, start, stop = benchapp.build(variant, Database(dsn, embedded=False, settings={}))
    else:
        app, start, stop = _ablated_app(dsn, variant)
    await start()
    limit = asyncio.Semaphore(CONCURRENCY)
    statuses: set[int] = set()

    async def one(key: bytes) -> None:
        async with limit:
            scope = {**overhead.SCOPE, "headers": [*overhead.BASE_HEADERS, (b"idempotency-key", key)]}
            sink = overhead.Sink()
            await app(scope, overhead.receive, sink.send)
            statuses.add(sink.status)

    try:
        for n in (200, count):  # the first batch warms up (statements prepared, pools full), in every run alike
            run = uuid.uuid4().hex
            await asyncio.gather(*(one(f"{run}-{i}".encode()) for i in range(n)))
            if statuses != {201}:
                raise SystemExit(f"{variant}: answers other than 201: {sorted(statuses)}")
    finally:
        await stop()
    if variant == "tasks" and not _Inline.used:
        raise SystemExit("the 'tasks' ablation no longer applies: the middleware starts no task through start_eagerly")


async def _pairs(dsn: str, variant: str, count: int) -> None:
    import asyncpg
    import storepath

    from idempotency_mw import PostgresStore
    from idempotency_mw.rows import encode_headers, new_fence
    from idempotency_mw.sql import queries

    run = uuid.uuid4().hex
    connections: list[asyncpg.Connection] = []
    store: PostgresStore | None = None
    if variant == "raw":
        sql = queries("public")
        connections = [await asyncpg.connect(dsn) for _ in range(CONCURRENCY)]
        prepared = [(await c.prepare(sql["claim"]), await c.prepare(sql["complete"])) for c in connections]

        async def pair(worker: int, key: str) -> None:
            claim, complete = prepared[worker]
            row = await claim.fetchrow(storepath.TENANT, key, [storepath.FINGERPRINT], 30.0, 86400.0, new_fence(), None)
            headers = encode_headers(storepath.RESPONSE.headers)
            body = storepath.BODY
            await complete.fetch(storepath.TENANT, key, row["fence"], 201, headers, body, len(body), None, None)

    else:
        store = PostgresStore(dsn, min_size=CONCURRENCY, max_size=20)
        await store.open()

        async def pair(worker: int, key: str) -> None:
            assert store is not None
            claim = await store.claim(storepath.TENANT, key, storepath.FINGERPRINT, lease=30.0, ttl=86400.0)
            await store.complete(storepath.TENANT, key, claim.fence, storepath.RESPONSE)

    async def worker(n: int, pairs: int, batch: str) -> None:
        for i in range(pairs // CONCURRENCY):
            await pair(n, f"{run}-{batch}-{n}-{i}")

    try:
        for batch, n in (("warm", 320), ("count", count)):
            await asyncio.gather(*(worker(w, n, batch) for w in range(CONCURRENCY)))
    finally:
        for connection in connections:
            await connection.close()
        if store is not None:
            await store.close()


# -- counting ------------------------------------------------------------------------------------------------------

IR = re.compile(r"I\s+refs:\s+([\d,]+)")


def count(dsn: str, kind: str, variant: str, n: int, collector: bool = False) -> int:
    """Instructions of one driver run of ``n`` requests or pairs, with the cycle collector off unless asked for."""
    done = subprocess.run(
        [
            "valgrind",
            "--tool=cachegrind",
            "--cache-sim=no",
            "--cachegrind-out-file=/dev/null",
            sys.executable,
            __file__,
            "--dsn",
            dsn,
            "--drive",
            kind,
            variant,
            str(n),
            *([] if collector else ["--collector-off"]),
        ],
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "PYTHONHASHSEED": "0"},  # the same string hashes, so the same dict probes, every run
        check=False,
    )
    found = IR.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"{kind} {variant} x{n} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return int(found.group(1).replace(",", ""))


def per_unit(dsn: str, kind: str, variant: str, low: int, high: int, collector: bool = False) -> float:
    return (count(dsn, kind, variant, high, collector) - count(dsn, kind, variant, low, collector)) / (high - low)


def measure(dsn: str, quick: bool) -> dict[str, Any]:
    if shutil.which("valgrind") is None:
        return {"missing": "valgrind is not installed (apt install valgrind)"}
    requests = (100, 600) if quick else (200, 1600)
    pairs = (320, 1920) if quick else (640, 4800)
    # With the cycle collector off, a count is the same from run to run; whether a collection of the whole heap
    # falls inside one run or not would otherwise move it by tens of thousands. The collector's own share is
    # counted apart: ours and the hand-written app again, with it on.
    jobs: list[tuple[str, str, tuple[int, int], bool]] = [
        *(("requests", v, requests, False) for v in (*REQUESTS, *ABLATIONS)),
        ("requests", "ours", requests, False),  # again: how far two counts of the same code differ
        *(("collector", v, requests, True) for v in ("handwritten", "ours")),
        *(("pairs", v, pairs, False) for v in PAIRS),
    ]
    # Counts do not depend on what else runs, so two at a time: one per core.
    with ThreadPoolExecutor(2) as pool:
        counted = list(
            pool.map(
                lambda job: per_unit(dsn, "pairs" if job[0] == "pairs" else "requests", job[1], *job[2], job[3]),
                jobs,
            )
        )
    result: dict[str, Any] = {
        "requests": {},
        "collector": {},
        "pairs": {},
        "ours_twice": [],
        "counts": {"requests": requests, "pairs": pairs},
    }
    for (kind, variant, _, _), value in zip(jobs, counted, strict=True):
        result[kind][variant] = value
        if kind == "requests" and variant == "ours":
            result["ours_twice"].append(value)
    result["requests"]["ours"] = sum(result["ours_twice"]) / 2
    return result


# -- rendering (run.py) -----------------------------------------------------------------------------------------


def k(instructions: float) -> str:
    return f"{instructions / 1000:,.0f}k"


def render(result: dict[str, Any]) -> str:
    title = "# Instructions per request (valgrind), in process"
    if "missing" in result:
        return f"{title}\n\nNot measured: {result['missing']}."
    r, p = result["requests"], result["pairs"]
    bare, hand, ours = r["bare"], r["handwritten"], r["ours"]
    rows = [
        ["the app alone (no middleware)", k(bare), "", ""],
        ["hand-written: claim + complete inline", k(hand), k(hand - bare), f"{hand / hand:.2f}x"],
        ["idempotency_mw on PostgresStore (mean of two counts)", k(ours), k(ours - bare), f"{ours / hand:.2f}x"],
    ]
    gap = ours - hand
    first, second = result["ours_twice"]
    collector = result["collector"]
    collected = [
        [name, k(collector[variant]), k(collector[variant] - r[variant])]
        for name, variant in (("hand-written", "handwritten"), ("idempotency_mw", "ours"))
    ]
    parts = [
        [f"`{name}`: {what}", k(r[name]), k(ours - r[name]), f"{(ours - r[name]) / gap:.0%}"]
        for name, what in ABLATIONS.items()
    ]
    low, high = result["counts"]["requests"]
    plow, phigh = result["counts"]["pairs"]
    return "\n\n".join(
        [
            title,
            "User-space machine instructions (valgrind's `Ir`) the process executes per fresh-key request, and per "
            "claim+complete pair of the store path: a count, so it does not move with the machine's load the way "
            "time does. System calls are not counted (the kernel's share of a socket write), so these ratios are "
            "larger than the same ratios of CPU time in endtoend.md and storepath.md. Each figure is the "
            f"difference between two runs of the same in-process driver ({low} and {high} requests, {plow} and "
            f"{phigh} pairs; {CONCURRENCY} at a time, uvloop, the same PostgreSQL), over the difference in "
            "requests. The cycle collector is off in these runs (a collection of the whole heap, inside one run "
            "and not the other, would move a count by tens of thousands); its share is counted apart below. "
            "Attribution, not a target: targets 14.1 and 14.2 are judged on time.",
            table(["per fresh request", "instructions", "over the app alone", "vs hand-written"], rows),
            f"Where ours spends the {k(gap)} instructions a request costs over the hand-written app: ours again "
            "with one part taken out at a time (never a way to run it: see instructions.py). Two counts of ours "
            f"itself, in this run, came out {k(first)} and {k(second)}.",
            table(["taken out", "instructions", "that part costs", "of the gap"], parts),
            "The cycle collector: the same requests with it on (as a server runs them). How often it runs depends "
            "on how many tracked objects each request keeps alive while it waits (tasks, coroutines, futures), and "
            "whether a collection of the whole heap falls inside a run moves these by up to tens of thousands.",
            table(["per fresh request, collector on", "instructions", "the collector's share"], collected),
            table(
                ["per claim+complete pair", "instructions", "vs raw"],
                [
                    ["raw: prepared asyncpg, a connection per task", k(p["raw"]), "1.00x"],
                    ["PostgresStore.claim + complete", k(p["store"]), f"{p['store'] / p['raw']:.2f}x"],
                ],
            ),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--drive", nargs=3, metavar=("KIND", "VARIANT", "COUNT"), help=argparse.SUPPRESS)
    parser.add_argument("--collector-off", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.drive:
        if args.collector_off:
            gc.disable()
        kind, variant, n = args.drive
        drive = _requests if kind == "requests" else _pairs
        try:
            from uvloop import run as run_loop
        except ImportError:  # the test suite's venv (tests/test_benchmarks.py); the benchmark venv has uvloop
            run_loop = asyncio.run  # type: ignore[assignment]
        run_loop(drive(args.dsn, variant, int(n)))
        return
    json.dump(measure(args.dsn, args.quick), sys.stdout)


if __name__ == "__main__":
    main()
