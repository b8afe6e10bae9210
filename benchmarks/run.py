"""Run the measurements behind the project README's performance claims in one go, and write their tables to
``benchmarks/results/``.

    ./dev bench --quick                             # under 10 minutes on 2 cores
    .venv/bin/python benchmarks/run.py --quick      # the same
    .venv/bin/python benchmarks/run.py              # the full run: 15 s load runs, more repetitions, durability

Both modes measure the same sizes (10⁴, 10⁶ and 10⁷ stored records; 1,000,000 expired records purged); the quick
mode runs each load for 5 s instead of 15, repeats less, and leaves out the durable commits (``durability.py``,
about 4 minutes: in the full run, or with ``--only durability``). ``--seconds`` overrides the run length.

One PostgreSQL (embedded, restarted with pg_stat_statements; or ``DATABASE_URL``) serves every measurement but the
durable commits, which run on a server of their own with a shim that slows its flushes. Each measurement writes
``results/<name>.md`` and its raw numbers, with the targets judged from them, to ``results/raw/<name>.json``;
``results/README.md`` is the summary. ``--only name,name`` re-runs some measurements and keeps the others' results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import durability
import endtoend
import loadgen
import opcodes
import overhead
import peers
import pgserver
import purge
import roundtrips
import scale
from common import MEASUREMENTS, RESULTS, Context, Target, installed_versions, load_average, publish
from servers import HERE, bench_env

from idempotency_mw import PostgresStore

QUICK_SKIPS = ("durability",)  # about 4 minutes: in the full run, or the quick one with --only durability
IN_PROJECT_VENV = ("overhead", "opcodes")  # need neither wrk nor the benchmark venv
ROUNDTRIP_VARIANTS = ("ours", "fastidempotent", "fastapi-idempotency")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def run_overhead(ctx: Context) -> dict[str, Any]:
    """``overhead.py`` in this interpreter (the project's venv), in a process of its own."""
    n, rounds = (5000, 5) if ctx.quick else (20000, 9)
    done = subprocess.run(
        [sys.executable, str(HERE / "overhead.py"), "-n", str(n), "--rounds", str(rounds)],
        cwd=str(HERE),
        env=bench_env(),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"overhead.py failed: {done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def run_roundtrips(ctx: Context) -> dict[str, Any]:
    n = 20 if ctx.quick else 100
    results: dict[str, Any] = {}
    problems: dict[str, str] = {}
    for variant in ROUNDTRIP_VARIANTS:
        if ctx.peers.get(variant):
            problems[variant] = str(ctx.peers[variant])
            continue
        args = ["--dsn", ctx.db.url, "--variant", variant, "-n", str(n)]
        if ctx.db.log_path:
            args += ["--log", ctx.db.log_path]
        try:
            results[variant] = ctx.script("roundtrips.py", *args)
        except RuntimeError as error:
            problems[variant] = str(error).strip().splitlines()[-1]
    return {"n": n, "results": results, "problems": problems}


Measure = Callable[[Context], dict[str, Any]]
Render = Callable[[dict[str, Any], Context], str]
Judge = Callable[[dict[str, Any]], list[Target]]

# name -> (measure, render, targets), for every name in common.MEASUREMENTS
STEPS: dict[str, tuple[Measure, Render, Judge]] = {
    "roundtrips": (
        run_roundtrips,
        lambda r, ctx: roundtrips.render(r["results"], r["problems"], r["n"]),
        lambda r: roundtrips.targets(r["results"], r["problems"]),
    ),
    "overhead": (run_overhead, lambda r, ctx: overhead.render(r), overhead.targets),
    "endtoend": (endtoend.measure, endtoend.render, endtoend.targets),
    "scale": (scale.measure, scale.render, scale.targets),
    "gc": (purge.measure, purge.render, purge.targets),
    "durability": (durability.measure, lambda r, ctx: durability.render(r), durability.targets),
    "opcodes": (opcodes.measure, lambda r, ctx: opcodes.render(r), opcodes.targets),
}


async def prepare_database(url: str) -> tuple[bool, str]:
    store = PostgresStore(url, min_size=1, max_size=1)  # not opened first: open() refuses an unmigrated database
    try:
        await store.migrate()
        async with store.connection() as connection:
            return await pgserver.has_statement_stats(connection), await pgserver.server_version(connection)
    finally:
        await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter runs; under 10 minutes on 2 cores")
    parser.add_argument("--only", help=f"comma-separated subset of {', '.join(MEASUREMENTS)}")
    parser.add_argument("--seconds", type=float, help="seconds per load run (default 5 quick, 15 full)")
    args = parser.parse_args()
    chosen = [m.strip() for m in args.only.split(",")] if args.only else list(MEASUREMENTS)
    if args.quick and not args.only:
        chosen = [m for m in chosen if m not in QUICK_SKIPS]
    unknown = set(chosen) - set(MEASUREMENTS)
    if unknown:
        parser.error(f"unknown measurement(s): {', '.join(sorted(unknown))}")
    started = time.time()
    python, versions = sys.executable, installed_versions()
    peer_status: dict[str, str | None] = {}
    if set(chosen) - set(IN_PROJECT_VENV):
        loadgen.ensure_wrk()
        log("benchmark venv and peers…")
        python, peer_status, versions = peers.ensure()
        for name, problem in peer_status.items():
            log(f"  {name}: {'ok' if problem is None else problem}")
    eager = peers.ensure_eager(versions) if "endtoend" in chosen else None
    if eager is not None:
        log(f"  Python 3.12+ for the paired measurement with eager tasks: {eager.version or eager.missing}")
    mode = "quick" if args.quick else "full"
    seconds = args.seconds or (5.0 if args.quick else 15.0)
    failed: list[str] = []
    with pgserver.database() as db:
        stats, postgres = asyncio.run(prepare_database(db.url))
        if not stats:
            log("pg_stat_statements is not available on this server: round trips cannot be counted")
        ctx = Context(
            db=db,
            python=python,
            quick=args.quick,
            seconds=seconds,
            repetitions=2 if args.quick else 3,
            peers=peer_status,
            eager=eager,
        )
        for name in chosen:
            if name == "roundtrips" and not stats:
                continue
            log(f"{name}...")
            began, load_before = time.time(), load_average()
            measure, render, judge = STEPS[name]
            try:
                result = measure(ctx)
            except Exception as error:  # one broken measurement must not hide the others
                log(f"{name} FAILED: {error!r}")
                failed.append(name)
                continue
            version, per_run = postgres, seconds
            database = "embedded, shared_buffers=1GB, pg_stat_statements" if db.embedded else "DATABASE_URL"
            if name == "durability":  # measured on a server of its own, with the slow-flush shim, in short slices
                version, database = result["server"]["version"], durability.SERVER_DESCRIPTION
                per_run = result["settings"]["slice_seconds"]
            if name == "opcodes":
                database, per_run = f"{database}; a database per revision", 0.0
            publish(
                name,
                render(result, ctx),
                result,
                judge(result),
                began=began,
                mode=opcodes.MODE if name == "opcodes" else mode,
                postgres=version,
                database=database,
                load_before=load_before,
                versions=versions,
                seconds=per_run,
            )
            log(f"{name} done in {time.time() - began:.0f} s")
    log(f"done in {(time.time() - started) / 60:.1f} min; tables in {RESULTS}")
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
