"""Python opcodes per request, for library revisions side by side: where the Python work of a request changed, and by
how much, without noise.

Time on a shared 2-core machine moves by several percent between two runs of the same code (``beforeafter.py``
measures that noise beside each pair); the opcodes CPython executes do not move. So this counts them, with
``sys.settrace`` and ``f_trace_opcodes``, for requests of ``benchapp``'s ``ours`` variant in process (plain mode,
``PostgresStore`` with its defaults, as the end-to-end servers run it): ``REQUESTS`` fresh keys, then as many
replays of them, one request at a time (with requests in flight together, which one waits for a pool connection
changes from run to run), after a warm-up, under uvloop, with the cycle collector off. Two counts of one revision
agree to the opcode.

An opcode is not a unit of time (a call that builds a frame costs many times a local variable's load), and what runs
in C (asyncpg's protocol, orjson, hashing, uvloop) or in the database is not counted: the count says where the
Python work of a request changed; ``beforeafter.py`` says what a change does end to end.

Revisions: by default the round, its base (``beforeafter.BASE``) and then every commit since that changed the
library (on the first-parent line, so a merge counts as one change), and the working tree when its library has
changes not committed; or ``--revisions a,b,...``, where ``worktree`` names the working tree. Each revision is
extracted (``common.library_copy``), migrates a database of its own and is counted in a process that imports it.

    .venv/bin/python benchmarks/opcodes.py                                      # the round: about 2 minutes
    .venv/bin/python benchmarks/opcodes.py --revisions 7440d2a,worktree --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import json
import subprocess
import sys
import time
import uuid
from types import FrameType
from typing import Any

import asyncpg
import peers
import pgserver
from beforeafter import BASE
from common import (
    REPO,
    Context,
    check_copy,
    database_url,
    git,
    library_copy,
    library_digest,
    load_average,
    migrate_with,
    recreate_databases,
    table,
    working_tree,
)
from servers import HERE, bench_env

REQUESTS = 300
WARM_UP = 200
MODES = ("fresh", "replay")
WORKTREE = "worktree"
LIBRARY = "idempotency_mw/"
SUBJECT = 80  # characters of a commit subject shown (older subjects ran to hundreds)


def group(filename: str) -> str:
    """Where an opcode ran: a module of the library (``idempotency_mw/middleware.py``), an installed package
    (``asyncpg``), ``asyncio``, the rest of the standard library, or the benchmark's own driver."""
    if f"/{LIBRARY}" in filename:
        return LIBRARY + filename.rsplit(f"/{LIBRARY}", 1)[1]
    if "site-packages/" in filename:
        return filename.rsplit("site-packages/", 1)[1].split("/", 1)[0]
    if "/asyncio/" in filename:
        return "asyncio"
    if "/lib/python3" in filename:
        return "standard library"
    return "benchmark driver"


def library_total(counts: dict[str, float]) -> float:
    return sum(n for name, n in counts.items() if name.startswith(LIBRARY))


# -- the driver (in a process that imports the revision's library) ------------------------------------------------


async def _drive(dsn: str, requests: int) -> dict[str, Any]:
    import benchapp
    import overhead
    from pgserver import Database

    import idempotency_mw

    app, start, stop = benchapp.build("ours", Database(dsn, embedded=False, settings={}))
    counts: dict[str, collections.Counter[str]] = {mode: collections.Counter() for mode in MODES}
    statuses: collections.Counter[tuple[str, int, bool]] = collections.Counter()

    async def one(key: bytes, mode: str) -> None:
        scope = {**overhead.SCOPE, "headers": [*overhead.BASE_HEADERS, (b"idempotency-key", key)]}
        sink = overhead.Sink()
        await app(scope, overhead.receive, sink.send)
        statuses[(mode, sink.status, sink.replayed)] += 1

    def counting(into: collections.Counter[str]) -> Any:
        def local(frame: FrameType, event: str, arg: object) -> Any:
            if event == "opcode":
                into[group(frame.f_code.co_filename)] += 1
            return local

        def tracer(frame: FrameType, event: str, arg: object) -> Any:
            frame.f_trace_opcodes = True
            return local

        return tracer

    await start()
    try:
        run = uuid.uuid4().hex
        warm = [f"warm-{run}-{i}".encode() for i in range(WARM_UP)]
        for key in warm:  # statements prepared, pools filled, both paths taken
            await one(key, "warm")
        for key in warm:
            await one(key, "warm")
        keys = [f"{run}-{i}".encode() for i in range(requests)]
        for mode in MODES:
            previous = sys.gettrace()  # a coverage tracer, when a test runs this: put back after
            sys.settrace(counting(counts[mode]))
            try:
                for key in keys:
                    await one(key, mode)
            finally:
                sys.settrace(previous)
    finally:
        await stop()
    expected = {("warm", 201, False): WARM_UP, ("warm", 201, True): WARM_UP}
    expected |= {("fresh", 201, False): requests, ("replay", 201, True): requests}
    if statuses != expected:
        raise SystemExit(f"unexpected answers: {dict(statuses)}")
    return {
        "path": idempotency_mw.__path__[0],
        **{mode: {name: n / requests for name, n in sorted(counts[mode].items())} for mode in MODES},
    }


def drive(dsn: str, requests: int) -> dict[str, Any]:
    import uvloop

    gc.disable()  # a collection inside one count and not another would move it
    return uvloop.run(_drive(dsn, requests))


# -- the revisions (run.py's process) -----------------------------------------------------------------------------


def round_revisions() -> list[str]:
    """The round's base, every first-parent commit since that changed the library, and the working tree when its
    library has changes not committed."""
    changed = git("rev-list", "--reverse", "--first-parent", f"{BASE}..HEAD", "--", "idempotency_mw").split()
    return [BASE, *changed, *([WORKTREE] if working_tree()["dirty"] else [])]


def count(python: str, url: str, revision: str, requests: int) -> dict[str, Any]:
    """One revision's counts, on a database of its own migrated by that revision's library."""
    if revision == WORKTREE:
        commit, root, subject = git("rev-parse", "HEAD"), REPO, "the working tree"
    else:
        commit, root = library_copy(revision)
        subject = git("log", "-1", "--format=%s", commit)
    database = f"opcodes_{commit[:12]}"
    asyncio.run(recreate_databases(url, [database], create=True))
    try:
        dsn = database_url(url, database)
        migrated = migrate_with(python, dsn, root)
        check_copy(f"{revision} (migration)", migrated["path"], root)
        done = subprocess.run(
            [python, __file__, "--drive", dsn, "--requests", str(requests)],
            cwd=str(HERE),
            env=bench_env(str(root)),
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"counting {revision} failed:\n{done.stderr[-3000:]}")
        counted: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        check_copy(revision, counted.pop("path"), root)
    finally:
        asyncio.run(recreate_databases(url, [database], create=False))
    return {"revision": revision, "commit": commit, "subject": subject, "digest": library_digest(root), **counted}


def measure_with(python: str, url: str, revisions: list[str], requests: int = REQUESTS) -> dict[str, Any]:
    counted = []
    for revision in revisions:
        counted.append(count(python, url, revision, requests))
        fresh, replay = (library_total(counted[-1][mode]) for mode in MODES)
        print(f"opcodes: {revision}: library {fresh:.0f} fresh, {replay:.0f} replay", file=sys.stderr, flush=True)
    return {"requests": requests, "revisions": counted}


def measure(ctx: Context) -> dict[str, Any]:
    """run.py's entry: the round's revisions, on the run's server and venv."""
    return measure_with(ctx.python, ctx.db.url, round_revisions())


# -- rendering ------------------------------------------------------------------------------------------------------


def _delta(now: float, before: float | None) -> str:
    return "" if before is None else f"{now - before:+.0f}"


def render(result: dict[str, Any], ctx: Context | None = None) -> str:
    revisions = result["revisions"]
    rows = []
    previous: dict[str, float] | None = None
    for entry in revisions:
        totals = {mode: library_total(entry[mode]) for mode in MODES}
        cells = []
        for mode in MODES:
            cells += [
                f"{totals[mode]:.0f}",
                _delta(totals[mode], previous[mode] if previous else None),
                f"{sum(entry[mode].values()):.0f}",
            ]
        name = "working tree" if entry["revision"] == WORKTREE else f"`{entry['commit'][:7]}`"
        subject = entry["subject"] if len(entry["subject"]) <= SUBJECT else entry["subject"][: SUBJECT - 1] + "…"
        rows.append([name, subject, *cells])
        previous = totals
    headers = ["revision", "change"]
    for mode in MODES:
        headers += [f"{mode}: library", "change", f"{mode}: all Python"]
    first, last = revisions[0], revisions[-1]
    groups = sorted(
        {name for entry in (first, last) for mode in MODES for name in entry[mode]},
        key=lambda name: (-abs(last["fresh"].get(name, 0.0) - first["fresh"].get(name, 0.0)), name),
    )
    module_rows = []
    for name in groups:
        cells = []
        for mode in MODES:
            before, after = first[mode].get(name, 0.0), last[mode].get(name, 0.0)
            cells += [f"{before:.0f}", f"{after:.0f}", f"{after - before:+.0f}"]
        module_rows.append([f"`{name}`", *cells])
    module_headers = ["where", *(f"{mode}: {side}" for mode in MODES for side in ("first", "last", "change"))]
    first_name, last_name = (rows[0][0], rows[-1][0])
    return "\n\n".join(
        [
            "# Python opcodes per request, revision by revision",
            "What a request of `benchapp`'s `ours` variant (plain mode, `PostgresStore` with its defaults) executes "
            f"in Python, in process, counted by `opcodes.py`: {result['requests']} fresh keys, then as many replays "
            "of them, one at a time, after a warm-up. *library* is the opcodes in `idempotency_mw`; *all Python* "
            "adds Starlette, asyncpg's Python side, asyncio and the driver. Counts are exact (two counts of one "
            "revision agree to the opcode), but an opcode is not a unit of time, and C (asyncpg's protocol, orjson, "
            "hashing, uvloop) and the database are not counted: for what a change does end to end, see "
            "[beforeafter.md](beforeafter.md) and [redesign.md](redesign.md).",
            "## Revision by revision",
            "Each change to the library on the round's first-parent line, with what it changed in each count.",
            table(headers, rows),
            f"## Where, from {first_name} to {last_name}",
            table(module_headers, module_rows),
        ]
    )


# -- standalone -----------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--revisions", help=f"comma-separated git revisions ('{WORKTREE}': the working tree)")
    parser.add_argument("--requests", type=int, default=REQUESTS, help="requests counted per mode")
    parser.add_argument("--no-write", action="store_true", help="print the tables, leave results/ as it is")
    parser.add_argument("--drive", metavar="DSN", help=argparse.SUPPRESS)  # the counting process
    args = parser.parse_args()
    if args.drive:
        print(json.dumps(drive(args.drive, args.requests)))
        return
    revisions = args.revisions.split(",") if args.revisions else round_revisions()
    began, load_before = time.time(), load_average()
    python, _, versions = peers.ensure()
    with pgserver.database() as db:
        result = measure_with(python, db.url, revisions, args.requests)
        database = "embedded" if db.embedded else "DATABASE_URL"
        postgres = asyncio.run(server_version(db.url))
    markdown = render(result)
    print(markdown)
    if args.no_write:
        return
    import run  # here, not above: run.py imports this module

    written = run.publish(
        "opcodes",
        markdown,
        result,
        began=began,
        mode="full",
        postgres=postgres,
        database=f"{database}; a database per revision",
        load_before=load_before,
        versions=versions,
        seconds=0.0,
    )
    print(f"written to {written}", file=sys.stderr)


async def server_version(url: str) -> str:
    connection = await asyncpg.connect(url)
    try:
        return await pgserver.server_version(connection)
    finally:
        await connection.close()


if __name__ == "__main__":
    main()
