"""Run every benchmark of issue 5 in one go and write the tables to ``benchmarks/results/``.

    .venv/bin/python benchmarks/run.py --quick      # under 10 minutes on 2 cores
    .venv/bin/python benchmarks/run.py              # longer runs, more repetitions, 10⁷ records, 1M purge

Steps: the load generator (wrk) and the benchmark venv with the peers are made ready; the in-process overhead runs;
then one PostgreSQL (embedded, restarted with pg_stat_statements; or ``DATABASE_URL``) serves every other
measurement: round trips, end to end, scale, garbage collection, memory. Each measurement writes
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
from typing import Any

import endtoend
import loadgen
import overhead
import peers
import pgserver
import purge
import roundtrips
import rss
import scale
from common import Context, load_average, machine, table, verdict
from servers import HERE, bench_env

from idempotency_mw import PostgresStore

RESULTS = HERE / "results"
RAW = RESULTS / "raw"
MEASUREMENTS = ("overhead", "roundtrips", "endtoend", "scale", "gc", "memory")
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
ROUNDTRIP_VARIANTS = ("ours", "ours-noreset", "fastidempotent", "fastapi-idempotency")


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


def render_roundtrips(result: dict[str, Any], ctx: Context) -> str:
    return roundtrips.render(result["results"], result["problems"], result["n"])


# name -> (measure, render)
STEPS: dict[str, tuple[Callable[[Context], dict[str, Any]], Callable[[dict[str, Any], Context], str]]] = {
    "overhead": (run_overhead, lambda result, ctx: overhead.render(result)),
    "roundtrips": (run_roundtrips, render_roundtrips),
    "endtoend": (endtoend.measure, endtoend.render),
    "scale": (scale.measure, scale.render),
    "gc": (purge.measure, purge.render),
    "memory": (rss.measure, rss.render),
}


async def prepare_database(url: str) -> tuple[bool, str]:
    async with PostgresStore(url, min_size=1, max_size=1) as store:
        await store.migrate()
        async with store.connection() as connection:
            return await pgserver.has_statement_stats(connection), await pgserver.server_version(connection)


def header(meta: dict[str, Any]) -> str:
    m = meta["machine"]
    return (
        f"_Measured {meta['started']} ({meta['mode']} mode, {meta['minutes']:.1f} min) on {m['cpu']}, "
        f"{m['cores']} cores, {m['memory']}, {m['os']}; Python {m['python']}, PostgreSQL {meta['postgres']} "
        f"({meta['database']}). Load average before {meta['load_start']}, after {meta['load_end']}: this is a "
        "shared machine, so compare ratios within one run, not absolute numbers across runs._"
    )


def write(name: str, markdown: str, result: dict[str, Any], meta: dict[str, Any]) -> None:
    RAW.mkdir(parents=True, exist_ok=True)
    (RAW / f"{name}.json").write_text(json.dumps({"meta": meta, "result": result}, indent=1, default=str) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown + "\n\n" + header(meta) + "\n")


def summary(ctx: Context) -> str:
    """``results/README.md``: every target, measured, from the raw results on disk."""
    raw = {p.stem: json.loads(p.read_text()) for p in sorted(RAW.glob("*.json"))}
    rows: list[list[str]] = []
    if "roundtrips" in raw:
        res = raw["roundtrips"]["result"]["results"]
        for variant, label in (("ours", "defaults"), ("ours-noreset", "pool reset off")):
            if variant in res:
                trips = [res[variant][s]["round_trips"] for s in ("fresh", "replay", "conflict", "mismatch")]
                rows.append(
                    [
                        f"1. round trips fresh/replay/conflict/mismatch ({label})",
                        "2 / 1 / 1 / 1",
                        " / ".join(f"{t:g}" for t in trips),
                        verdict(trips == [2, 1, 1, 1]),
                        "[roundtrips.md](roundtrips.md)",
                    ]
                )
    if "overhead" in raw:
        v = raw["overhead"]["result"]["variants"]
        rows.append(
            [
                "2. in-process cost of a fresh request",
                "< 30 µs",
                f"{v['fresh']['added_us']:.1f} µs",
                verdict(v["fresh"]["added_us"] < 30),
                "[overhead.md](overhead.md)",
            ]
        )
        rows.append(
            [
                "2. replay vs the bare request",
                "cheaper",
                f"{v['replay']['us_per_request']:.1f} vs {v['bare']['us_per_request']:.1f} µs",
                verdict(v["replay"]["us_per_request"] < v["bare"]["us_per_request"]),
                "[overhead.md](overhead.md)",
            ]
        )
    if "endtoend" in raw:
        h = endtoend.headline(raw["endtoend"]["result"])
        f = lambda x: f"{x:.2f}x" if x is not None else "n/a"  # noqa: E731
        for label, key, target, ok in (
            ("3. fresh throughput vs best peer", "fresh_vs_peer", "≥ 2x", lambda x: x >= 2),
            ("3. fresh throughput vs database floor", "fresh_vs_floor", "≥ 0.60x", lambda x: x >= 0.6),
            ("3. replay throughput vs best peer", "replay_vs_peer", "≥ 2x", lambda x: x >= 2),
        ):
            rows.append(
                [label, target, f(h[key]), verdict(h[key] is not None and ok(h[key])), "[endtoend.md](endtoend.md)"]
            )
        rows.append(
            [
                "3. (pool reset off) fresh vs floor, replay vs best peer",
                "≥ 0.60x, ≥ 2x",
                f"{f(h['noreset_fresh_vs_floor'])}, {f(h['noreset_replay_vs_peer'])}",
                "context",
                "[endtoend.md](endtoend.md)",
            ]
        )
    if "scale" in raw:
        w = scale.worst(raw["scale"]["result"])
        sizes = ", ".join(f"{lv['records']:.0e}".replace("e+0", "e") for lv in raw["scale"]["result"]["levels"])
        rows.append(
            [
                f"4. latency flat across table sizes ({sizes})",
                "≤ 1.25x",
                f"worst {w:.2f}x" if w else "n/a",
                verdict(w is not None and w <= 1.25),
                "[scale.md](scale.md)",
            ]
        )
    if "gc" in raw:
        g = raw["gc"]["result"]
        r = purge.p99_ratio(g)
        rate = g["purged"] / g["purge_seconds"] if g["purge_seconds"] else 0
        rows.append(
            [
                f"5. p99 while purging {g['records']:,} expired records ({rate:,.0f}/s)",
                "≤ 2x quiet",
                f"{r:.2f}x",
                verdict(r <= 2),
                "[gc.md](gc.md)",
            ]
        )
    if "memory" in raw:
        v = raw["memory"]["result"]["variants"]
        grow = {k: (e["peak"] - e["idle"]) / 2**20 for k, e in v.items()}
        rows.append(
            [
                "6. peak RSS growth, 64 x 1 MiB responses",
                "(no target)",
                f"bare {grow['bare']:.0f} MiB, ours {grow['ours']:.0f} MiB, ours replay {grow['ours replay']:.0f} MiB",
                "context",
                "[memory.md](memory.md)",
            ]
        )
    runs = ", ".join(
        f"{name} {data['meta']['started']} ({data['meta']['mode']})" for name, data in raw.items() if "meta" in data
    )
    return "\n\n".join(
        [
            "# Benchmark results",
            "Produced by `python benchmarks/run.py` (see [../README.md](../README.md) for what is measured and how). "
            "Ratios are the headline: every ratio compares numbers taken side by side in the same run on the same "
            "machine. Absolute numbers in the linked files are context for that machine only.",
            table(["measurement", "target", "measured", "verdict", "details"], rows),
            f"Runs: {runs}.",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter runs; under 10 minutes on 2 cores")
    parser.add_argument("--only", help=f"comma-separated subset of {', '.join(MEASUREMENTS)}")
    parser.add_argument("--seconds", type=float, help="seconds per load run (default 6 quick, 15 full)")
    args = parser.parse_args()
    chosen = [m.strip() for m in args.only.split(",")] if args.only else list(MEASUREMENTS)
    unknown = set(chosen) - set(MEASUREMENTS)
    if unknown:
        parser.error(f"unknown measurement(s): {', '.join(sorted(unknown))}")
    started = time.time()
    loadgen.ensure_wrk()
    log("benchmark venv and peers…")
    python, peer_status, versions = peers.ensure()
    for name, problem in peer_status.items():
        log(f"  {name}: {'ok' if problem is None else problem}")
    mode = "quick" if args.quick else "full"
    seconds = args.seconds or (6.0 if args.quick else 15.0)
    failed: list[str] = []
    with pgserver.database() as db:
        stats, postgres = asyncio.run(prepare_database(db.url))
        if not stats:
            log("pg_stat_statements is not available on this server: round trips cannot be counted")
        ctx = Context(db, python, args.quick, seconds, 2 if args.quick else 3, peer_status)
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
            meta = {
                "started": datetime.datetime.fromtimestamp(began).strftime("%Y-%m-%d %H:%M"),
                "mode": mode,
                "minutes": (time.time() - began) / 60,
                "machine": machine(),
                "postgres": postgres,
                "database": "embedded, shared_buffers=1GB, pg_stat_statements" if db.embedded else "DATABASE_URL",
                "load_start": load_before,
                "load_end": load_average(),
                "versions": {k: versions.get(k) for k in VERSIONS},
                "seconds_per_run": seconds,
            }
            write(name, STEPS[name][1](result, ctx), result, meta)
            log(f"{name} done in {time.time() - began:.0f} s")
    (RESULTS / "README.md").write_text(summary(ctx) + "\n")
    log(f"done in {(time.time() - started) / 60:.1f} min; tables in {RESULTS}")
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
