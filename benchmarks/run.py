"""Run every benchmark of issue 5 in one go and write the tables to ``benchmarks/results/``.

    ./dev bench --quick                             # about 10 minutes on 2 cores (8.6 in the published run)
    .venv/bin/python benchmarks/run.py --quick      # the same
    .venv/bin/python benchmarks/run.py              # the full run: 15 s load runs, more repetitions

Both modes measure the same sizes (10⁴, 10⁶ and 10⁷ stored records; 1,000,000 expired records purged); the quick
mode runs each load for 5 s instead of 15 and repeats less (``--seconds`` overrides the run length).

Steps: the load generator (wrk) and the benchmark venv with the peers are made ready; the in-process overhead and
the fingerprint's cost per body shape (issue 10) run;
then one PostgreSQL (embedded, restarted with pg_stat_statements; or ``DATABASE_URL``) serves every other
measurement: round trips, end to end, scale, garbage collection, memory, and (in the full run, or with
``--only instructions``) the instructions per request that valgrind counts, and (in the full run, or with ``--only
beforeafter,redesign,opcodes``) the before/after pairs of this round and of its redesign, and the Python
opcodes per request of each library revision of the round. The durable commits of transactional
requests (``durability.py``; in the full run, or with ``--only durability``) run on a PostgreSQL of their own, with
a shim that slows its flushes. Each measurement writes
``results/<name>.md`` and its raw numbers to ``results/raw/<name>.json``; ``results/README.md`` is the summary.
``--only name,name`` re-runs some measurements and keeps the others' previous results.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import beforeafter
import durability
import encryption
import endtoend
import fingerprint
import fixes
import instructions
import loadgen
import opcodes
import overhead
import peers
import pgserver
import purge
import roundtrips
import rss
import scale
import storepath
import waiting
from common import Context, Target, load_average, machine, table
from servers import HERE, bench_env

from idempotency_mw import PostgresStore

RESULTS = HERE / "results"
RAW = RESULTS / "raw"
MEASUREMENTS = (
    "overhead",
    "fingerprint",
    "roundtrips",
    "storepath",
    "fixes",
    "endtoend",
    "beforeafter",
    "redesign",
    "opcodes",
    "scale",
    "gc",
    "memory",
    "instructions",
    "durability",
    "encryption",
    "waiting",
)  # the order they run in
# About 3, 4, 2, 2 and 2 minutes: in the full run, or the quick one with --only instructions / durability /
# beforeafter / redesign / opcodes.
QUICK_SKIPS = ("instructions", "durability", "beforeafter", "redesign", "opcodes")
# issue 5's, then 10's and 14's
ISSUE_ORDER = (
    "roundtrips",
    "overhead",
    "endtoend",
    "scale",
    "gc",
    "memory",
    "fingerprint",
    "storepath",
    "fixes",
    "instructions",
    "durability",
    "encryption",
    "waiting",
    "beforeafter",
    "redesign",
    "opcodes",
)
VERSIONS = (
    "starlette",
    "uvicorn",
    "uvloop",
    "httptools",
    "asyncpg",
    "fastidempotent",
    "fastapi-idempotency",
    "sqlalchemy",
    "tortoise-orm",
)
ROUNDTRIP_VARIANTS = ("ours", "fastidempotent", "fastapi-idempotency")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def run_overhead(ctx: Context) -> dict[str, Any]:
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


def run_fingerprint(ctx: Context) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(HERE / "fingerprint.py"), "--json", *(["--quick"] if ctx.quick else [])],
        cwd=str(HERE),
        env=bench_env(),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"fingerprint.py failed: {done.stderr[-3000:]}")
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


def run_storepath(ctx: Context) -> dict[str, Any]:
    rounds = "7" if ctx.quick else "15"
    result: dict[str, Any] = ctx.script("storepath.py", "--dsn", ctx.db.url, "--rounds", rounds, "--pairs", "3200")
    return result


def run_fixes(ctx: Context) -> dict[str, Any]:
    pid = ["--postmaster-pid", str(ctx.db.postmaster_pid)] if ctx.db.postmaster_pid else []
    result: dict[str, Any] = ctx.script("fixes.py", "--dsn", ctx.db.url, *pid, *(["--quick"] if ctx.quick else []))
    return result


def run_instructions(ctx: Context) -> dict[str, Any]:
    result: dict[str, Any] = ctx.script("instructions.py", "--dsn", ctx.db.url, *(["--quick"] if ctx.quick else []))
    return result


def run_in_project_venv(script: str, *args: str) -> dict[str, Any]:
    """``benchmarks/<script>`` on this interpreter (the project's venv: the encryption extra, no peers), its JSON."""
    done = subprocess.run(
        [sys.executable, str(HERE / script), *args],
        cwd=str(HERE),
        env=bench_env(),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{script} failed: {done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def run_encryption(ctx: Context) -> dict[str, Any]:
    n, rounds = ("500", "7") if ctx.quick else ("2000", "9")
    return run_in_project_venv("encryption.py", "--dsn", ctx.db.url, "-n", n, "--rounds", rounds)


def run_waiting(ctx: Context) -> dict[str, Any]:
    return run_in_project_venv("waiting.py", "--dsn", ctx.db.url, "--rounds", "3" if ctx.quick else "5")


def render_roundtrips(result: dict[str, Any], ctx: Context) -> str:
    return roundtrips.render(result["results"], result["problems"], result["n"])


# name -> (measure, render)
STEPS: dict[str, tuple[Callable[[Context], dict[str, Any]], Callable[[dict[str, Any], Context], str]]] = {
    "overhead": (run_overhead, lambda result, ctx: overhead.render(result)),
    "fingerprint": (run_fingerprint, lambda result, ctx: fingerprint.render(result)),
    "roundtrips": (run_roundtrips, render_roundtrips),
    "storepath": (run_storepath, lambda result, ctx: storepath.render(result)),
    "fixes": (run_fixes, lambda result, ctx: fixes.render(result)),
    "endtoend": (endtoend.measure, endtoend.render),
    "beforeafter": (beforeafter.measure, beforeafter.render),
    "redesign": (beforeafter.measure_redesign, beforeafter.render),
    "opcodes": (opcodes.measure, opcodes.render),
    "scale": (scale.measure, scale.render),
    "gc": (purge.measure, purge.render),
    "memory": (rss.measure, rss.render),
    "instructions": (run_instructions, lambda result, ctx: instructions.render(result)),
    "durability": (durability.measure, durability.render),
    "encryption": (run_encryption, lambda result, ctx: encryption.render(result)),
    "waiting": (run_waiting, lambda result, ctx: waiting.render(result)),
}


async def prepare_database(url: str) -> tuple[bool, str]:
    store = PostgresStore(url, min_size=1, max_size=1)  # not opened first: open() refuses an unmigrated database
    try:
        await store.migrate()
        async with store.connection() as connection:
            return await pgserver.has_statement_stats(connection), await pgserver.server_version(connection)
    finally:
        await store.close()


def header(meta: dict[str, Any]) -> str:
    m = meta["machine"]
    return (
        f"_Measured {meta['started']} ({meta['mode']} mode, {meta['minutes']:.1f} min) on {m['cpu']}, "
        f"{m['cores']} cores, {m['memory']}, {m['os']}; Python {m['python']}, PostgreSQL {meta['postgres']} "
        f"({meta['database']}). Load average before {meta['load_start']}, after {meta['load_end']}: this is a "
        "shared machine, so compare ratios within one run, not absolute numbers across runs._"
    )


def measurement_meta(
    *,
    began: float,
    mode: str,
    postgres: str,
    database: str,
    load_before: str,
    versions: dict[str, str],
    seconds: float,
) -> dict[str, Any]:
    """What ``write`` records beside a measurement's result: when, how, on what."""
    return {
        "started": datetime.datetime.fromtimestamp(began).strftime("%Y-%m-%d %H:%M"),
        "mode": mode,
        "minutes": (time.time() - began) / 60,
        "machine": machine(),
        "postgres": postgres,
        "database": database,
        "load_start": load_before,
        "load_end": load_average(),
        "versions": {k: versions.get(k) for k in VERSIONS},
        "seconds_per_run": seconds,
    }


def write(name: str, markdown: str, result: dict[str, Any], meta: dict[str, Any]) -> None:
    RAW.mkdir(parents=True, exist_ok=True)
    (RAW / f"{name}.json").write_text(json.dumps({"meta": meta, "result": result}, indent=1, default=str) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown + "\n\n" + header(meta) + "\n")


def publish(name: str, markdown: str, result: dict[str, Any], **meta: Any) -> Path:
    """Write a measurement that ran on its own (its script's ``main``, not this run) as this run would, with
    ``measurement_meta(**meta)``, and the summary again; return its markdown file."""
    write(name, markdown, result, measurement_meta(**meta))
    (RESULTS / "README.md").write_text(summary() + "\n")
    return RESULTS / f"{name}.md"


# name -> the targets of issue 5 that measurement is judged on, computed from its raw result on disk
TARGETS: dict[str, Callable[[dict[str, Any]], list[Target]]] = {
    "roundtrips": lambda r: roundtrips.targets(r["results"], r["problems"]),
    "overhead": overhead.targets,
    "fingerprint": fingerprint.targets,
    "storepath": storepath.targets,
    "fixes": fixes.targets,
    "endtoend": endtoend.targets,
    "scale": scale.targets,
    "gc": purge.targets,
    "memory": rss.targets,
    "instructions": lambda r: [],  # attribution of 14.1 and 14.2, judged on time elsewhere
    "durability": durability.targets,
    "encryption": encryption.targets,
    "waiting": waiting.targets,
    "beforeafter": beforeafter.targets,
    "redesign": beforeafter.targets,
    "opcodes": lambda r: [],  # attribution of the pairs, judged end to end there
}


def summary() -> str:
    """``results/README.md``: every target of every measurement, judged from the raw results on disk."""
    raw = {p.stem: json.loads(p.read_text()) for p in sorted(RAW.glob("*.json"))}
    rows: list[list[str]] = []
    for name in sorted(MEASUREMENTS, key=lambda m: ISSUE_ORDER.index(m)):
        link = f"[{name}.md]({name}.md)"
        if name not in raw:
            rows.append([name, "", "not measured yet: run.py --only " + name, "n/a", ""])
            continue
        data = raw[name]
        mode = data.get("meta", {}).get("mode", "?")
        try:
            found = TARGETS[name](data["result"])
        except (KeyError, TypeError, IndexError) as error:  # raw file written by an older harness
            rows.append([name, "", f"cannot read raw/{name}.json ({error!r}): re-run it", "n/a", link])
            continue
        for t in found:
            rows.append([t.what, t.goal, t.measured, t.verdict, f"{link} ({mode})"])
    runs = [
        f"{name} {data['meta']['started']} ({data['meta']['mode']} mode, {data['meta']['minutes']:.1f} min)"
        for name, data in raw.items()
        if "meta" in data
    ]
    modes = {data["meta"]["mode"] for data in raw.values() if "meta" in data}
    mixed = (
        [
            "**These results come from runs in different modes** "
            f"({', '.join(sorted(modes))}): see each measurement's mode in the table."
        ]
        if len(modes) > 1
        else []
    )
    return "\n\n".join(
        [
            "# Benchmark results",
            "Produced by `./dev bench --quick` (`.venv/bin/python benchmarks/run.py --quick`; without `--quick` the "
            "full run), see [../README.md](../README.md) for what is measured and how. Every verdict below is "
            "computed by `run.py` from the raw results in `raw/`, and every ratio compares numbers taken side by "
            "side in the same run on the same machine. Absolute numbers in the linked files are context for that "
            "machine only.",
            table(["target (issue 5, 10, 14)", "goal", "measured", "verdict", "details (mode)"], rows),
            *mixed,
            f"Runs: {'; '.join(runs)}.",
        ]
    )


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
    loadgen.ensure_wrk()
    log("benchmark venv and peers…")
    python, peer_status, versions = peers.ensure()
    for name, problem in peer_status.items():
        log(f"  {name}: {'ok' if problem is None else problem}")
    eager = peers.ensure_eager(versions) if "endtoend" in chosen else None
    if eager is not None:
        log(f"  Python 3.12+ for target 14.1 with eager tasks: {eager.version or eager.missing}")
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
            try:
                result = STEPS[name][0](ctx)
            except Exception as error:  # one broken measurement must not hide the others
                log(f"{name} FAILED: {error!r}")
                failed.append(name)
                continue
            version, database, per_run = postgres, "embedded, shared_buffers=1GB, pg_stat_statements", seconds
            if not db.embedded:
                database = "DATABASE_URL"
            if name == "durability":  # measured on a server of its own, with the slow-flush shim, in short slices
                version, database = result["server"]["version"], durability.SERVER_DESCRIPTION
                per_run = result["settings"]["slice_seconds"]
            if name in beforeafter.PAIRS:  # in short slices, on databases of its own on the run's server
                version, database = result["server"]["version"], f"{database}; {beforeafter.DATABASE_NOTE}"
                per_run = result["settings"]["slice_seconds"]
            meta = measurement_meta(
                began=began,
                mode=mode,
                postgres=version,
                database=database,
                load_before=load_before,
                versions=versions,
                seconds=per_run,
            )
            write(name, STEPS[name][1](result, ctx), result, meta)
            log(f"{name} done in {time.time() - began:.0f} s")
    (RESULTS / "README.md").write_text(summary() + "\n")
    log(f"done in {(time.time() - started) / 60:.1f} min; tables in {RESULTS}")
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
