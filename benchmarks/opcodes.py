"""The Python work of one request, counted: opcodes, library calls and library modules entered, against the budget.

Time on a shared 2-core machine moves by several percent between two runs of the same code; what CPython executes
does not. So this counts it, with ``sys.settrace`` and ``f_trace_opcodes``, in the library's own files only:

- **opcodes**: every opcode executed in a frame of a library file;
- **calls**: every call of a library function, a coroutine resumed counting as a call (as CPython reports it);
- **modules entered**: the library files those calls ran in.

The app is the one the budget is set on: FastAPI with ``setup(app)`` and ``IdempotencyMiddleware`` on a
``PostgresStore`` with its defaults (the default tenant resolver, under the benchmarks' secret; its timeout, the
lease and its batches of replay counts an hour apart, so that no timer fires during a count), a plain route that
returns a dict and a transactional one (``@idempotent(transactional=True)``) that inserts one row through
``IdempotencyConnection``. It is called in process through httpx's ASGI transport, one request at a time, after 60
warm-up rounds (a fresh plain request, its replay, a fresh transactional request: statements prepared, pools
filled), with the cycle collector off while counting. Three requests are counted: a fresh plain one, a fresh
transactional one, and the replay of a plain one. Beside them, the app the other benchmarks serve (``benchapp``'s
``ours``: Starlette, plain mode) is counted the same way, a fresh request and a replay, called as an ASGI app with
``overhead.py``'s request.

Each revision is extracted with ``git archive`` (``common.library_copy``; ``worktree`` is the working tree), gets a
database of its own, which it migrates, and is counted in a process that imports it and says so. Two counts of one
revision agree to the opcode. An opcode is not a unit of time, and C (asyncpg's protocol, orjson, hashing) and the
database are not counted: the count says where the Python work of a request is, and whether it moved.

    .venv/bin/python benchmarks/opcodes.py                                # the budget table, written to results/
    .venv/bin/python benchmarks/opcodes.py --revisions 2667283,worktree --no-write
    ./dev bench --quick --only opcodes                                    # the same through run.py
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from types import FrameType
from typing import Any

import asyncpg
import pgserver
from benchapp import TENANT_SECRET
from common import (
    Context,
    Target,
    check_copy,
    database_url,
    git,
    installed_versions,
    library_copy,
    library_digest,
    load_average,
    publish,
    recreate_databases,
    table,
    target_table,
    working_tree,
)
from fastapi import FastAPI
from servers import HERE, REPO, bench_env

import idempotency_mw
from idempotency_mw import IdempotencyMiddleware, PostgresStore, idempotent
from idempotency_mw.fastapi import IdempotencyConnection, setup  # at the top: FastAPI reads the routes' annotations

WORKTREE = "worktree"
# The columns of the budget table: the library before the security review's fixes, after them, and now.
REVISIONS = {"7b59cfc": "today", "2667283": "after the review fixes", WORKTREE: "now"}
REQUESTS = ("fresh plain", "fresh transactional", "replay")
BUDGETS = {  # request -> (modules entered, opcodes), at most
    "fresh plain": (12, 2500),
    "fresh transactional": (12, 3100),
    "replay": (10, 1600),
}
E2E_REQUESTS = ("fresh", "replay")
WARM_UP = 60  # rounds
MODE = "exact"  # what the results call this count's mode: it has no quick one, and no run moves it
AUTHORIZATION = "Bearer sk_test_opcodes"
EFFECTS = "opcodes_effects"  # the transactional route's own table

Modules = dict[str, dict[str, int]]  # library module -> {"calls": n, "opcodes": n}


# -- the count (in a process that imports the revision's library) -------------------------------------------------


class Count:
    """A ``sys.settrace`` tracer that counts, per library module, the calls and opcodes of frames whose code lives
    under ``root`` (the imported library's directory, with a trailing separator); frames elsewhere are not traced."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.calls: collections.Counter[str] = collections.Counter()
        self.opcodes: collections.Counter[str] = collections.Counter()

    def trace(self, frame: FrameType, event: str, arg: object) -> Any:
        filename = frame.f_code.co_filename
        if not filename.startswith(self.root):
            return None
        module = filename[len(self.root) :]
        self.calls[module] += 1  # the global tracer hears only "call": a new frame, or a coroutine resumed
        frame.f_trace_opcodes = True
        opcodes = self.opcodes

        def local(frame: FrameType, event: str, arg: object) -> Any:
            if event == "opcode":
                opcodes[module] += 1
            return local

        return local

    def modules(self) -> Modules:
        return {name: {"calls": n, "opcodes": self.opcodes[name]} for name, n in sorted(self.calls.items())}


async def counted(root: str, request: Awaitable[Any]) -> tuple[Modules, Any]:
    """The calls and opcodes of one awaited ``request``, by library module, and what it returned."""
    count = Count(root)
    previous = sys.gettrace()  # a coverage tracer, when a test runs this: put back after
    sys.settrace(count.trace)
    try:
        answer = await request
    finally:
        sys.settrace(previous)
    return count.modules(), answer


def library_root() -> str:
    """The directory of the library this process imported, as the tracer matches frames' files against it."""
    return os.path.dirname(os.path.abspath(idempotency_mw.__file__)) + os.sep


Post = Callable[[str, str], Awaitable[Any]]


async def each_request(app: Any, steps: Callable[[Post], Awaitable[dict[str, Modules]]]) -> dict[str, Modules]:
    """``steps(post)`` with ``post(path, key)`` a POST through httpx's ASGI transport that must answer 201."""
    import httpx

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://opcodes", headers={"Authorization": AUTHORIZATION}
    ) as client:

        async def post(path: str, key: str) -> httpx.Response:
            response = await client.post(path, json={"amount": 5}, headers={"Idempotency-Key": key})
            if response.status_code != 201:
                raise RuntimeError(f"POST {path} answered {response.status_code}: {response.text[:300]}")
            return response

        return await steps(post)


def replayed(response: Any) -> None:
    if response.headers.get("idempotent-replayed") != "true":
        raise RuntimeError(f"a replay was not replayed: {dict(response.headers)}")


QUIET_SECONDS = 3600.0  # the store's timeout and the lease while counting: no timer of theirs fires meanwhile


@contextlib.contextmanager
def replay_batches_quiet() -> Iterator[None]:
    """The store opened within writes the replays it counts every ``QUIET_SECONDS`` rather than every
    ``REPLAYS_EVERY`` (5 s), like its other timers. On a starved machine (the suite on every core, another job
    beside it) a round outlasted the 5 s and a batch landed inside a counted request: its own calls, and the
    request's statements waiting for it or run on a connection the pool opened meanwhile (prepared, types looked
    up), 19 calls more in ``_claim.py`` alone. A revision from before the batches has nothing to quiet."""
    from idempotency_mw.postgres import _store

    every = getattr(_store, "REPLAYS_EVERY", None)
    if every is None:
        yield
        return
    _store.REPLAYS_EVERY = QUIET_SECONDS
    try:
        yield
    finally:
        _store.REPLAYS_EVERY = every


async def count_budget_app(dsn: str) -> dict[str, Modules]:
    """The three requests of the budget, on the FastAPI app (the module docstring says how)."""
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute(f"CREATE TABLE IF NOT EXISTS {EFFECTS} (id bigserial PRIMARY KEY, amount int)")
    finally:
        await connection.close()
    # Timers of the store's fire on their own, not for a request: the statements' deadline check, every quarter of
    # the store's timeout, and the leases' renewal, every third of a lease. Long enough, neither fires while a
    # request is counted (at the defaults one could, on a slow machine, and add its opcodes to that request's).
    store = PostgresStore(dsn, timeout=QUIET_SECONDS)
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=store, lease=QUIET_SECONDS)
    setup(app)

    @app.post("/plain", status_code=201)
    async def plain(body: dict[str, Any]) -> dict[str, Any]:
        return {"id": uuid.uuid4().hex, **body}

    @app.post("/tx", status_code=201)
    @idempotent(transactional=True)
    async def tx(body: dict[str, Any], db: IdempotencyConnection) -> dict[str, Any]:
        await db.execute(f"INSERT INTO {EFFECTS} (amount) VALUES ($1)", int(body["amount"]))
        return {"id": uuid.uuid4().hex, **body}

    root = library_root()

    async def steps(post: Post) -> dict[str, Modules]:
        for i in range(WARM_UP):
            key = f"warm-{i}-{uuid.uuid4().hex}"
            await post("/plain", key)
            await post("/plain", key)
            await post("/tx", "t" + key)
        found: dict[str, Modules] = {}
        with collector_off():
            found["fresh plain"], _ = await counted(root, post("/plain", f"fresh-{uuid.uuid4().hex}"))
            found["fresh transactional"], _ = await counted(root, post("/tx", f"fresh-{uuid.uuid4().hex}"))
            key = f"replay-{uuid.uuid4().hex}"
            await post("/plain", key)
            found["replay"], answer = await counted(root, post("/plain", key))
        replayed(answer)
        return found

    await store.migrate()
    with replay_batches_quiet():
        await store.open()
    try:
        return await each_request(app, steps)
    finally:
        await store.close()


async def count_benchapp(dsn: str) -> dict[str, Modules]:
    """A fresh request and a replay of ``benchapp``'s ``ours``, called as an ASGI app with ``overhead.py``'s request
    (``POST /orders``, five headers and the key), counted the same way."""
    import benchapp
    import overhead
    from pgserver import Database

    app, start, stop = benchapp.build("ours", Database(dsn, embedded=False, settings={}))
    root = library_root()

    async def post(key: str) -> overhead.Sink:
        scope = {**overhead.SCOPE, "headers": [*overhead.BASE_HEADERS, (b"idempotency-key", key.encode())]}
        sink = overhead.Sink()
        await app(scope, overhead.receive, sink.send)
        if sink.status != 201:
            raise RuntimeError(f"POST /orders answered {sink.status}")
        return sink

    async def steps() -> dict[str, Modules]:
        for i in range(WARM_UP):
            key = f"warm-{i}-{uuid.uuid4().hex}"
            await post(key)
            await post(key)
        found: dict[str, Modules] = {}
        with collector_off():
            found["fresh"], _ = await counted(root, post(f"fresh-{uuid.uuid4().hex}"))
            key = f"replay-{uuid.uuid4().hex}"
            await post(key)
            found["replay"], sink = await counted(root, post(key))
        if not sink.replayed:
            raise RuntimeError("a replay of POST /orders was not replayed")
        return found

    await start()
    try:
        return await steps()
    finally:
        await stop()


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """The cycle collector off, after a collection: one that fell inside a count would move it."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def _drive(dsn: str) -> dict[str, Any]:
    return {
        "path": idempotency_mw.__path__[0],
        "budget": await count_budget_app(dsn),
        "benchapp": await count_benchapp(dsn),
    }


# -- the revisions (the harness's process) --------------------------------------------------------------------------


def count(url: str, revision: str) -> dict[str, Any]:
    """One revision's counts, on a database of its own that its library migrates."""
    if revision == WORKTREE:
        commit, root, database = git("rev-parse", "HEAD"), REPO, "opcodes_worktree"
    else:
        commit, root = library_copy(revision)
        database = f"opcodes_{commit[:12]}"
    asyncio.run(recreate_databases(url, [database], create=True))
    try:
        env = {**bench_env(str(root)), "IDEMPOTENCY_TENANT_SECRET": TENANT_SECRET}  # the default resolver's
        done = subprocess.run(
            [sys.executable, str(HERE / "opcodes.py"), "--drive", database_url(url, database)],
            cwd=str(HERE),
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"counting {revision} failed:\n{done.stderr[-3000:]}")
        found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        check_copy(revision, found.pop("path"), root)
    finally:
        asyncio.run(recreate_databases(url, [database], create=False))
    return {
        "revision": revision,
        "label": REVISIONS.get(revision, revision),
        "commit": commit,
        "dirty": working_tree()["dirty"] if revision == WORKTREE else False,
        "digest": library_digest(root),
        **found,
    }


def measure_with(url: str, revisions: Sequence[str]) -> dict[str, Any]:
    counts = []
    for revision in revisions:
        counts.append(count(url, revision))
        line = "/".join(str(totals(counts[-1]["budget"][r])["opcodes"]) for r in REQUESTS)
        print(f"opcodes: {revision}: {line}", file=sys.stderr, flush=True)
    return {"warm_up": WARM_UP, "revisions": counts}


def measure(ctx: Context) -> dict[str, Any]:
    """run.py's entry: the budget's revisions, on the run's server (in this interpreter, not the benchmark venv)."""
    return measure_with(ctx.db.url, list(REVISIONS))


# -- reading the result ---------------------------------------------------------------------------------------------


def totals(modules: Modules) -> dict[str, int]:
    """Opcodes, calls and modules entered of one request."""
    return {
        "opcodes": sum(m["opcodes"] for m in modules.values()),
        "calls": sum(m["calls"] for m in modules.values()),
        "modules": len(modules),
    }


def judged(result: dict[str, Any]) -> dict[str, Any]:
    """The revision the budget is judged on: the last counted (the working tree, by default)."""
    last: dict[str, Any] = result["revisions"][-1]
    return last


def within(request: str, found: dict[str, int]) -> dict[str, bool]:
    modules, opcodes = BUDGETS[request]
    return {"modules": found["modules"] <= modules, "opcodes": found["opcodes"] <= opcodes}


def targets(result: dict[str, Any]) -> list[Target]:
    entry = judged(result)
    found = {request: totals(entry["budget"][request]) for request in REQUESTS}
    name = "the working tree" if entry["revision"] == WORKTREE else f"`{entry['revision']}`"
    out = []
    for measure, index, what in (
        ("opcodes", 1, "Python opcodes in the library per request"),
        ("modules", 0, "library modules a request enters"),
    ):
        out.append(
            Target(
                f"{what}: fresh plain / fresh transactional / replay ({name}; counted)",
                "≤ " + " / ".join(f"{BUDGETS[r][index]:,}" for r in REQUESTS),
                " / ".join(f"{found[r][measure]:,}" for r in REQUESTS),
                all(within(r, found[r])[measure] for r in REQUESTS),
            )
        )
    return out


def _verdict(request: str, measure: str, found: dict[str, int]) -> str:
    if measure == "calls":
        return ""
    limit = BUDGETS[request][0 if measure == "modules" else 1]
    over = found[measure] - limit
    return "met" if over <= 0 else f"**missed** by {over:,}"


def _column(entry: dict[str, Any]) -> str:
    if entry["revision"] == WORKTREE:
        return f"{entry['label']} (working tree)"
    commit = f"`{entry['commit'][:7]}`"
    return commit if entry["label"] == entry["revision"] else f"{entry['label']} ({commit})"


def _named(entry: dict[str, Any]) -> str:
    """The revision judged, in words: the working tree with its commit (and whether it has changes), or a commit."""
    if entry["revision"] == WORKTREE:
        changes = ", with changes not committed" if entry["dirty"] else ""
        return f"the working tree at `{entry['commit'][:7]}`{changes}"
    return f"`{entry['commit'][:7]}`"


def render(result: dict[str, Any], ctx: Context | None = None) -> str:
    revisions = result["revisions"]
    last = judged(result)
    budget_rows = []
    for request in REQUESTS:
        found = [totals(entry["budget"][request]) for entry in revisions]
        for measure, label, index in (
            ("opcodes", "opcodes", 1),
            ("modules", "modules entered", 0),
            ("calls", "calls", None),
        ):
            budget = "" if index is None else f"≤ {BUDGETS[request][index]:,}"
            budget_rows.append(
                [request, label, budget, *(f"{f[measure]:,}" for f in found), _verdict(request, measure, found[-1])]
            )
    columns = [_column(entry) for entry in revisions]
    modules = sorted(
        {name for request in REQUESTS for name in last["budget"][request]},
        key=lambda name: (-sum(last["budget"][r].get(name, {}).get("opcodes", 0) for r in REQUESTS), name),
    )
    module_rows = [
        [f"`{name}`", *(f"{last['budget'][r].get(name, {}).get('opcodes', 0):,}" for r in REQUESTS)] for name in modules
    ]
    module_rows.append(["all library", *(f"**{totals(last['budget'][r])['opcodes']:,}**" for r in REQUESTS)])
    module_rows.append(["budget", *(f"≤ {BUDGETS[r][1]:,}" for r in REQUESTS)])
    e2e_rows = []
    for entry, column in zip(revisions, columns, strict=True):
        cells = []
        for request in E2E_REQUESTS:
            e2e = totals(entry["benchapp"][request])
            cells += [f"{e2e['opcodes']:,}", str(e2e["calls"]), str(e2e["modules"])]
        e2e_rows.append([column, *cells])
    e2e_headers = ["revision", *(f"{r}: {m}" for r in E2E_REQUESTS for m in ("opcodes", "calls", "modules"))]
    digests = "; ".join(f"{entry['revision']} {entry['digest'][:12]}" for entry in revisions)
    return "\n\n".join(
        [
            "# The Python work of one request, against the budget",
            "Counted by `opcodes.py` ([README](../README.md#the-opcode-budget)), deterministic: a FastAPI app with "
            "`setup(app)` and `IdempotencyMiddleware` on a `PostgresStore` with its defaults (its timeout and the "
            "lease an hour, so that no timer of theirs fires while a request is counted), a plain route "
            "returning a dict and a transactional route inserting one row through `IdempotencyConnection`, called "
            f"in process through httpx's ASGI transport one request at a time after {result['warm_up']} warm-up "
            "rounds, the cycle collector off. `sys.settrace` with `f_trace_opcodes` counts, in the library's own "
            "files only, the opcodes executed, the calls (a coroutine resumed counts as one) and the modules those "
            "calls ran in. Two counts of one revision agree to the opcode; C code and the database are not counted.",
            target_table(targets(result)),
            "## Against the budget",
            f"Verdicts are for the last column: {_named(last)}.",
            table(["request", "counted", "budget", *columns, "verdict"], budget_rows),
            "## Where the opcodes go",
            f"Opcodes per library module (a path under `idempotency_mw/`) of {_named(last)}, for each request "
            "counted above.",
            table(["module", *REQUESTS], module_rows),
            "## The benchmarks' app",
            "`benchapp`'s `ours` (Starlette, plain mode, `PostgresStore` with its defaults: what the end-to-end and "
            "scale servers serve) called as an ASGI app with `overhead.py`'s request, `POST /orders` with five "
            "headers and the key (httpx sends more, which the middleware reads through): a fresh request and a "
            "replay, counted the same way. This is the count `opcodes.py` kept per revision before the budget.",
            table(e2e_headers, e2e_rows),
            f"Library digests (`common.library_digest`): {digests}.",
        ]
    )


# -- standalone -----------------------------------------------------------------------------------------------------


async def server_version(url: str) -> str:
    connection = await asyncpg.connect(url)
    try:
        return await pgserver.server_version(connection)
    finally:
        await connection.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--revisions",
        help=f"comma-separated git revisions, the last judged ('{WORKTREE}': the working tree; "
        f"default {','.join(REVISIONS)})",
    )
    parser.add_argument("--no-write", action="store_true", help="print the tables, leave results/ as it is")
    parser.add_argument("--drive", metavar="DSN", help=argparse.SUPPRESS)  # the counting process
    args = parser.parse_args()
    if args.drive:
        print(json.dumps(asyncio.run(_drive(args.drive))))
        return
    revisions = args.revisions.split(",") if args.revisions else list(REVISIONS)
    began, load_before = time.time(), load_average()
    with pgserver.database() as db:
        result = measure_with(db.url, revisions)
        database = "embedded" if db.embedded else "DATABASE_URL"
        postgres = asyncio.run(server_version(db.url))
    markdown = render(result)
    print(markdown)
    if args.no_write:
        return
    written = publish(
        "opcodes",
        markdown,
        result,
        targets(result),
        began=began,
        mode=MODE,
        postgres=postgres,
        database=f"{database}; a database per revision",
        load_before=load_before,
        versions=installed_versions(),
        seconds=0.0,
    )
    print(f"written to {written}", file=sys.stderr)


if __name__ == "__main__":
    main()
