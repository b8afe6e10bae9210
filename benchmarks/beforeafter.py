"""Before/after pairs: the end-to-end benchmark on the library of a base revision and on the working tree's, in the
same run, with the noise of the benchmark measured beside it. Two are published: ``beforeafter`` against the round's
base (what this round costs against 0.1.0) and ``redesign`` against the library just before the redesign (what the
redesign and the features after it cost).

The redesign is to change nothing a user sees, and to move the end-to-end benchmark by no more than its noise. Two
runs of the end-to-end benchmark minutes apart differ by more than that on a shared machine, so the pair is measured
the way target 14.1 is (``endtoend.run_paired``), with three servers up at once:

- **before**: the library of the pair's base (``PAIRS``; or ``--before``), extracted with ``git archive`` into
  ``benchmarks/.work/library/<commit>/`` and put first on its server's ``PYTHONPATH`` (``common.library_copy``);
- **after**: the working tree's library;
- **after-again**: a second server of the working tree's library. after-again / after is what the benchmark reads
  when nothing changed: the noise that after / before is judged against.

All three serve ``benchapp``'s ``ours`` variant (plain mode, ``PostgresStore`` with its defaults) from one
PostgreSQL, each on a database of its own: the two libraries' schemas differ (the base keeps responses in the
records table; the working tree adds ``idempotency_responses``), so each database is created here and migrated by
the library that serves it, in a process that imports that copy. Each server says where it imported
``idempotency_mw`` from (``GET /_library``), and the run stops if it is not the copy meant.

Rounds: each round runs one fresh-key slice and one replay slice (keys primed before the first round) of each
server, the three servers in one of the six orders in turn and fresh and replay alternating which goes first, so
no server is favoured by its place. Ratios are taken round by round and read through their median, with the
distribution-free 95% interval of ``common.median_interval``.

The verdict (:func:`judge`): after / before moves by no more than the noise when its median's 95% interval overlaps
the noise band, which is the 95% interval of the median of after-again / after, stretched to hold 1.0 if it does
not. Met means this run cannot tell before and after apart any better than it tells two servers of one library
apart; missed means that even the 95% interval of after / before lies outside the band.

    .venv/bin/python benchmarks/beforeafter.py --quick           # about 2 minutes: 12 rounds of 1-second slices
    .venv/bin/python benchmarks/beforeafter.py                   # about 4 minutes: 18 rounds of 2-second slices
    .venv/bin/python benchmarks/beforeafter.py --pair redesign   # the redesign's own pair
    .venv/bin/python benchmarks/beforeafter.py --before <ref>    # another "before" than the pair's base
    ./dev bench --quick --only beforeafter,redesign              # the same through run.py
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg
import loadgen
import peers
import pgserver
from common import (
    Context,
    Target,
    check_copy,
    database_url,
    library_copy,
    library_digest,
    load_average,
    median_interval,
    migrate_with,
    recreate_databases,
    table,
    target_table,
    working_tree,
)
from endtoend import CONNECTIONS, POOL, check
from servers import REPO, Server

BASE = "43f0f80"  # the round's base (0.1.0): before this round's fixes, features and redesign
REDESIGN_BASE = "7440d2a"  # the library just before the redesign: the round's isolation fixes in, nothing after
# A pair is published under its name: the round's (what 0.2.0 costs against 0.1.0), and the redesign's own.
PAIRS = {"beforeafter": BASE, "redesign": REDESIGN_BASE}
TITLES = {
    "beforeafter": ("Before and after this round", "the round's base"),
    "redesign": ("Before and after the redesign", "the library just before the redesign"),
}
NAMES = ("after", "after-again", "before")
DATABASES = {"after": "beforeafter_after", "after-again": "beforeafter_after_again", "before": "beforeafter_before"}
MODES = ("fresh", "replay")
CHANGE = ("after", "before")  # top / bottom of the ratio judged
NOISE = ("after-again", "after")  # the same library on both sides
MODE_LABELS = {"fresh": "fresh keys", "replay": "replays"}
ORDERS = list(itertools.permutations(NAMES))  # one per round, in turn
DATABASE_NOTE = "a database per server"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] beforeafter: {message}", file=sys.stderr, flush=True)


@dataclass
class Settings:
    rounds: int
    slice_seconds: float
    warm_up: float
    before: str = BASE
    quick: bool = True
    name: str = "beforeafter"  # the pair (PAIRS) the result is published as


def settings_for(quick: bool, seconds: float | None = None, name: str = "beforeafter") -> Settings:
    """12 rounds of 1-second slices (quick) or 18 of 2 s; ``seconds`` shortens the slices, never lengthens them.
    ``name``: the pair, whose base is the default ``before``."""
    slice_seconds = 1.0 if quick else 2.0
    if seconds:
        slice_seconds = min(seconds, slice_seconds)
    return Settings(
        rounds=12 if quick else 18,
        slice_seconds=slice_seconds,
        warm_up=1.0 if quick else 2.0,
        before=PAIRS[name],
        quick=quick,
        name=name,
    )


# --- the databases ------------------------------------------------------------------------------------------------


def create_databases(url: str) -> None:
    """An empty database per server (one left by an interrupted run is dropped first)."""
    asyncio.run(recreate_databases(url, list(DATABASES.values()), create=True))


def drop_databases(url: str) -> None:
    asyncio.run(recreate_databases(url, list(DATABASES.values()), create=False))


async def _tables(url: str) -> list[str]:
    connection = await asyncpg.connect(url)
    try:
        rows = await connection.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1")
        return [str(row["tablename"]) for row in rows]
    finally:
        await connection.close()


async def _server_version(url: str) -> str:
    connection = await asyncpg.connect(url)
    try:
        await connection.execute("CHECKPOINT")  # the rounds start without one pending from the set-up
        return str(await connection.fetchval("SHOW server_version"))
    finally:
        await connection.close()


# --- the measurement ----------------------------------------------------------------------------------------------


def slice_result(load: loadgen.Load, mode: str) -> dict[str, Any]:
    return {
        "requests": load.requests,
        "seconds": load.seconds,
        "rps": load.rps,
        "p50_ms": load.p50_ms,
        "p99_ms": load.p99_ms,
        "invalid": check(load, replays=mode == "replay"),
    }


def time_rounds(servers: dict[str, Server], settings: Settings, primed: dict[str, str]) -> list[dict[str, Any]]:
    """Rounds of one fresh-key and one replay slice of every server; the order of the servers runs through the six
    permutations, and fresh and replay alternate which goes first."""
    tag = uuid.uuid4().hex[:6]
    rounds: list[dict[str, Any]] = []
    for number in range(settings.rounds):
        order = ORDERS[number % len(ORDERS)]
        modes = MODES if number % 2 == 0 else MODES[::-1]
        entry: dict[str, Any] = {"order": list(order), "modes": list(modes)}
        for mode in modes:
            entry[mode] = {}
            for name in order:
                load = loadgen.run(
                    servers[name].url,
                    mode=mode,
                    prefix=primed[name] if mode == "replay" else f"r{number}-{name}-{tag}",
                    pool=POOL,
                    connections=CONNECTIONS,
                    seconds=settings.slice_seconds,
                )
                entry[mode][name] = slice_result(load, mode)
        rounds.append(entry)
        ratios = ", ".join(
            f"{mode} {entry[mode]['after']['rps'] / entry[mode]['before']['rps']:.3f}"
            for mode in MODES
            if entry[mode]["before"]["rps"]
        )
        log(f"round {number + 1}/{settings.rounds}: after / before {ratios}")
    return rounds


def measure_with(python: str, url: str, settings: Settings) -> dict[str, Any]:
    """The whole measurement on the server of ``url`` (its databases created here and dropped at the end); the raw
    result that ``render`` and ``targets`` read."""
    commit, copy = library_copy(settings.before)
    now = working_tree()
    roots = {"after": REPO, "after-again": REPO, "before": copy}
    digests = {"before": library_digest(copy), "after": library_digest(REPO)}
    log(
        f"before: {settings.before} = {commit[:12]}; after: the working tree at {now['commit'][:12]}"
        + (" with changes" if now["dirty"] else "")
        + (" (the same library code)" if digests["before"] == digests["after"] else "")
    )
    result: dict[str, Any] = {
        "settings": {**settings.__dict__, "connections": CONNECTIONS, "pool": POOL},
        "library": {
            "before": {"ref": settings.before, "commit": commit, "path": str(copy), "digest": digests["before"]},
            "after": {**now, "path": str(REPO), "digest": digests["after"]},
            "identical": digests["before"] == digests["after"],
        },
        "servers": {},
    }
    urls = {name: database_url(url, DATABASES[name]) for name in NAMES}
    create_databases(url)
    try:
        for name in NAMES:
            migrated = migrate_with(python, urls[name], roots[name])
            check_copy(f"{name} (migration)", migrated["path"], roots[name])
            result["servers"][name] = {
                "database": DATABASES[name],
                "migrations": migrated["applied"],
                "tables": asyncio.run(_tables(urls[name])),
            }
            log(f"{name}: migrated {DATABASES[name]} ({', '.join(migrated['applied'])})")
        with contextlib.ExitStack() as stack:
            servers: dict[str, Server] = {}
            for name in NAMES:
                server = stack.enter_context(
                    Server(python, "ours", urls[name], log_name=f"beforeafter-{name}", python_path=roots[name])
                )
                imported = server.library()
                check_copy(name, imported, roots[name])
                result["servers"][name]["library"] = imported
                servers[name] = server
            primed: dict[str, str] = {}
            for name in NAMES:  # pools filled, statements prepared, replay keys stored
                address, warm = servers[name].url, f"warm-{name}-{uuid.uuid4().hex[:6]}"
                loadgen.run(address, mode="fresh", prefix=warm, connections=CONNECTIONS, seconds=settings.warm_up)
                primed[name] = f"primed-{name}-{uuid.uuid4().hex[:6]}"
                statuses = asyncio.run(loadgen.prime(servers[name].url, primed[name], POOL))
                result["servers"][name]["primed"] = {str(status): n for status, n in statuses.items()}
                if set(statuses) != {201}:
                    raise RuntimeError(f"priming {name} answered {statuses}")
            result["server"] = {"version": asyncio.run(_server_version(url))}
            log(f"{settings.rounds} rounds of {settings.slice_seconds:g}-second slices")
            result["rounds"] = time_rounds(servers, settings, primed)
    finally:
        drop_databases(url)
    return result


def measure(ctx: Context) -> dict[str, Any]:
    """run.py's entry for the round's pair: the run's server and venv; ``--seconds`` shortens the slices."""
    return measure_with(ctx.python, ctx.db.url, settings_for(ctx.quick, ctx.seconds))


def measure_redesign(ctx: Context) -> dict[str, Any]:
    """run.py's entry for the redesign's own pair."""
    return measure_with(ctx.python, ctx.db.url, settings_for(ctx.quick, ctx.seconds, "redesign"))


# --- reading the result -------------------------------------------------------------------------------------------


def round_ratios(result: dict[str, Any], mode: str, top: str, bottom: str) -> list[float]:
    """Requests/s of ``top`` over ``bottom`` round by round, in the rounds where both slices count."""
    ratios = []
    for entry in result["rounds"]:
        a, b = entry[mode][top], entry[mode][bottom]
        if a["invalid"] is None and b["invalid"] is None and a["rps"] and b["rps"]:
            ratios.append(float(a["rps"]) / float(b["rps"]))
    return ratios


def noise_band(noise: Sequence[float]) -> tuple[float, float] | None:
    """The 95% interval of the median of the now/now ratios, stretched to hold 1.0; None with too few rounds."""
    interval = median_interval(noise)
    if interval is None:
        return None
    return min(interval[0], 1.0), max(interval[1], 1.0)


def judge(change: Sequence[float], noise: Sequence[float]) -> bool | None:
    """Whether after / before (``change``) moved by no more than the noise: its median's 95% interval overlaps
    :func:`noise_band`. None when either has too few rounds for a 95% interval (6)."""
    interval, band = median_interval(change), noise_band(noise)
    if interval is None or band is None:
        return None
    return interval[0] <= band[1] and interval[1] >= band[0]


def ratio_summary(ratios: Sequence[float]) -> str:
    """``0.987x (95% interval 0.96 to 1.01x, 18 rounds)``: the median to three digits, the interval to two."""
    if not ratios:
        return "n/a (no round where both slices count)"
    interval = median_interval(ratios)
    spread = (
        f"95% interval {interval[0]:.2f} to {interval[1]:.2f}x"
        if interval
        else f"rounds {min(ratios):.2f} to {max(ratios):.2f}x, too few for a 95% interval"
    )
    return f"{statistics.median(ratios):.3f}x ({spread}, {len(ratios)} rounds)"


def targets(result: dict[str, Any]) -> list[Target]:
    before = result["library"]["before"]
    label = "before/after" if result["settings"].get("name", "beforeafter") == "beforeafter" else "redesign"
    out = []
    for mode in MODES:
        change, noise = round_ratios(result, mode, *CHANGE), round_ratios(result, mode, *NOISE)
        out.append(
            Target(
                f"{label}: {MODE_LABELS[mode]}, requests/s after / before ({before['commit'][:7]}), paired slices",
                "within the now/now noise",
                f"{ratio_summary(change)}; now/now {ratio_summary(noise)}",
                judge(change, noise),
            )
        )
    return out


def _median(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.0f}" if values else "-"


def _median_ms(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.1f}" if values else "-"


def _valid(result: dict[str, Any], mode: str, name: str, field: str) -> list[float]:
    return [float(e[mode][name][field]) for e in result["rounds"] if e[mode][name]["invalid"] is None]


def _reading(change: Sequence[float], noise: Sequence[float]) -> str:
    interval, band = median_interval(change), noise_band(noise)
    if interval is None or band is None:
        return "too few rounds to judge"
    band_text = f"band {band[0]:.2f} to {band[1]:.2f}x"
    if not judge(change, noise):
        return f"**outside the noise** ({band_text})"
    return "within the noise (" + ("its interval holds 1.0" if interval[0] <= 1.0 <= interval[1] else band_text) + ")"


def render(result: dict[str, Any], ctx: Context | None = None) -> str:
    settings = result["settings"]
    library = result["library"]
    before, after = library["before"], library["after"]
    same = " **The two are the same library code.**" if library["identical"] else ""
    ratio_rows = []
    for mode in MODES:
        change, noise = round_ratios(result, mode, *CHANGE), round_ratios(result, mode, *NOISE)
        for label, ratios, reading in (
            ("after / before", change, _reading(change, noise)),
            ("after-again / after (now/now)", noise, ""),
        ):
            spread = f"{min(ratios):.2f} to {max(ratios):.2f}x" if ratios else "-"
            ratio_rows.append([MODE_LABELS[mode], label, ratio_summary(ratios), spread, reading])
    server_rows = []
    for name in NAMES:
        served = result["servers"][name]
        cells = []
        for mode in MODES:
            cells += [
                _median(_valid(result, mode, name, "rps")),
                _median_ms(_valid(result, mode, name, "p50_ms")),
                _median_ms(_valid(result, mode, name, "p99_ms")),
            ]
        server_rows.append([name, *cells, ", ".join(served["tables"]), ", ".join(served["migrations"])])
    round_rows = []
    for number, entry in enumerate(result["rounds"]):
        cells = []
        for mode in MODES:
            rps = {name: entry[mode][name]["rps"] for name in NAMES}
            cells += [f"{rps[name]:.0f}" for name in NAMES]
            cells += [f"{rps[top] / rps[bottom]:.3f}" if rps[bottom] else "-" for top, bottom in (CHANGE, NOISE)]
        round_rows.append([str(number + 1), " ".join(entry["order"]), *cells])
    round_headers = ["round", "order"]
    for mode in MODES:
        round_headers += [f"{MODE_LABELS[mode]}: {name}" for name in NAMES]
        round_headers += ["after / before", "now/now"]
    invalid = [
        f"round {number + 1}, {mode}, {name}: {entry[mode][name]['invalid']}"
        for number, entry in enumerate(result["rounds"])
        for mode in MODES
        for name in NAMES
        if entry[mode][name]["invalid"]
    ]
    title, base = TITLES[settings.get("name", "beforeafter")]
    return "\n\n".join(
        [
            f"# {title}",
            f"The end-to-end benchmark on {base} and on the working tree, in one run "
            f"([README](../README.md#before-and-after-the-redesign), `beforeafter.py`): three servers of "
            "`benchapp`'s `ours` variant (plain mode, `PostgresStore` with its defaults) up at once on one "
            "PostgreSQL, each on a database of its own migrated by its own library: *before*, *after*, and "
            "*after-again*, a second server of the working tree whose ratio to *after* is the benchmark's noise. "
            f"{settings['rounds']} rounds, each one {settings['slice_seconds']:g}-second fresh-key slice and one "
            f"replay slice ({settings['pool']} keys primed before the first round) of every server, wrk with "
            f"{settings['connections']} connections; the servers take the six orders in turn and fresh and replay "
            "alternate which goes first. A slice counts only if every answer was a 201, replayed exactly when it "
            "should be.",
            f"Before: `{before['ref']}` at {before['commit'][:12]} (library digest {before['digest'][:12]}). After: "
            f"the working tree at {after['commit'][:12]}{' with changes not committed' if after['dirty'] else ''} "
            f"(library digest {after['digest'][:12]}).{same}",
            "## Verdict",
            "after / before is within the noise when the 95% interval of its median overlaps the noise band: the 95% "
            "interval of the median of after-again / after, stretched to hold 1.0. The intervals are "
            "distribution-free (the k-th smallest and largest round).",
            target_table(targets(result)),
            "## Ratios over rounds",
            table(["traffic", "ratio", "median (interval, rounds)", "rounds' range", "reading"], ratio_rows),
            "## Per server",
            "Medians over the rounds whose slice counts; the tables and the migrations each library made in its "
            "own database.",
            table(
                [
                    "server",
                    "fresh req/s",
                    "fresh p50 ms",
                    "fresh p99 ms",
                    "replay req/s",
                    "replay p50 ms",
                    "replay p99 ms",
                    "tables",
                    "migrations applied",
                ],
                server_rows,
            ),
            "## Rounds",
            table(round_headers, round_rows),
            *(["Slices that do not count: " + "; ".join(invalid)] if invalid else []),
        ]
    )


# --- standalone ---------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="12 rounds of 1-second slices instead of 18 of 2 s")
    parser.add_argument("--rounds", type=int, help="rounds of slices")
    parser.add_argument("--seconds", type=float, help="seconds per slice (wrk counts whole seconds)")
    parser.add_argument("--pair", choices=sorted(PAIRS), default="beforeafter", help="the pair to measure and publish")
    parser.add_argument("--before", help="another git revision for 'before' than the pair's base")
    parser.add_argument("--no-write", action="store_true", help="print the tables, leave results/ as it is")
    args = parser.parse_args()
    settings = settings_for(args.quick, name=args.pair)
    settings.rounds = args.rounds or settings.rounds
    settings.slice_seconds = args.seconds or settings.slice_seconds
    settings.before = args.before or settings.before
    began, load_before = time.time(), load_average()
    loadgen.ensure_wrk()
    python, _, versions = peers.ensure()
    with pgserver.database() as db:
        result = measure_with(python, db.url, settings)
        database = ("embedded, shared_buffers=1GB, pg_stat_statements" if db.embedded else "DATABASE_URL") + (
            f"; {DATABASE_NOTE}"
        )
    markdown = render(result)
    print(markdown)
    if args.no_write:
        return
    import run  # here, not above: run.py imports this module

    written = run.publish(
        args.pair,
        markdown,
        result,
        began=began,
        mode="quick" if args.quick else "full",
        postgres=result["server"]["version"],
        database=database,
        load_before=load_before,
        versions=versions,
        seconds=settings.slice_seconds,
    )
    log(f"written to {written}")


if __name__ == "__main__":
    main()
