"""Two revisions side by side: the end-to-end benchmark on the library of a git revision (BASE) and on the working
tree's, in the same run, with the benchmark's noise measured beside it.

Two runs of the end-to-end benchmark minutes apart differ by more than most changes move it on a shared machine, so
the comparison is measured the way the end-to-end benchmark pairs ours with the hand-written app
(``endtoend.run_paired``), with three servers up at once:

- **base**: the library of BASE, extracted with ``git archive`` into ``benchmarks/.work/library/<commit>/`` and put
  first on its server's ``PYTHONPATH`` (``common.library_copy``);
- **now**: the working tree's library;
- **now-again**: a second server of the working tree's library. now-again / now is what the benchmark reads when
  nothing changed: the noise that now / base is judged against.

All three serve ``benchapp``'s ``ours`` variant (plain mode, ``PostgresStore`` with its defaults) from one
PostgreSQL, each on a database of its own, created here and migrated by the library that serves it, in a process
that imports that copy (two revisions' schemas may differ). Each server says where it imported ``idempotency_mw``
from (``GET /_library``), and the run stops if it is not the copy meant.

Rounds: each round runs one fresh-key slice and one replay slice (keys primed before the first round) of each
server, the three servers in one of the six orders in turn and fresh and replay alternating which goes first, so
no server is favoured by its place. Ratios are taken round by round and read through their median, with the
distribution-free 95% interval of ``common.median_interval``.

The verdict (:func:`judge`): now / base moves by no more than the noise when its median's 95% interval overlaps the
noise band, which is the 95% interval of the median of now-again / now, stretched to hold 1.0 if it does not. Met
means this run cannot tell BASE and the working tree apart any better than it tells two servers of one library
apart; missed means that even the 95% interval of now / base lies outside the band.

    .venv/bin/python benchmarks/compare.py main --quick          # about 2 minutes: 12 rounds of 1-second slices
    .venv/bin/python benchmarks/compare.py v0.1.0                # about 4 minutes: 18 rounds of 2-second slices
    .venv/bin/python benchmarks/compare.py HEAD~3 --rounds 8 --seconds 1 --no-write

It writes ``results/compare.md`` and ``results/raw/compare.json`` (and the summary); ``--no-write`` only prints.
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
    Target,
    check_copy,
    database_url,
    library_copy,
    library_digest,
    load_average,
    median_interval,
    migrate_with,
    publish,
    recreate_databases,
    table,
    target_table,
    working_tree,
)
from endtoend import CONNECTIONS, POOL, check
from servers import REPO, Server

NAMES = ("now", "now-again", "base")
DATABASES = {"now": "compare_now", "now-again": "compare_now_again", "base": "compare_base"}
MODES = ("fresh", "replay")
CHANGE = ("now", "base")  # top / bottom of the ratio judged
NOISE = ("now-again", "now")  # the same library on both sides
MODE_LABELS = {"fresh": "fresh keys", "replay": "replays"}
ORDERS = list(itertools.permutations(NAMES))  # one per round, in turn
DATABASE_NOTE = "a database per server"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] compare: {message}", file=sys.stderr, flush=True)


@dataclass
class Settings:
    base: str  # the git revision compared with the working tree
    rounds: int
    slice_seconds: float
    warm_up: float
    quick: bool = True


def settings_for(base: str, quick: bool) -> Settings:
    """12 rounds of 1-second slices (quick) or 18 of 2 s."""
    return Settings(
        base=base,
        rounds=12 if quick else 18,
        slice_seconds=1.0 if quick else 2.0,
        warm_up=1.0 if quick else 2.0,
        quick=quick,
    )


# --- the databases ------------------------------------------------------------------------------------------------


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
            f"{mode} {entry[mode]['now']['rps'] / entry[mode]['base']['rps']:.3f}"
            for mode in MODES
            if entry[mode]["base"]["rps"]
        )
        log(f"round {number + 1}/{settings.rounds}: now / base {ratios}")
    return rounds


def measure_with(python: str, url: str, settings: Settings) -> dict[str, Any]:
    """The whole measurement on the server of ``url`` (its databases created here and dropped at the end); the raw
    result that ``render`` and ``targets`` read."""
    commit, copy = library_copy(settings.base)
    now = working_tree()
    roots = {"now": REPO, "now-again": REPO, "base": copy}
    digests = {"base": library_digest(copy), "now": library_digest(REPO)}
    log(
        f"base: {settings.base} = {commit[:12]}; now: the working tree at {now['commit'][:12]}"
        + (" with changes" if now["dirty"] else "")
        + (" (the same library code)" if digests["base"] == digests["now"] else "")
    )
    result: dict[str, Any] = {
        "settings": {**settings.__dict__, "connections": CONNECTIONS, "pool": POOL},
        "library": {
            "base": {"ref": settings.base, "commit": commit, "path": str(copy), "digest": digests["base"]},
            "now": {**now, "path": str(REPO), "digest": digests["now"]},
            "identical": digests["base"] == digests["now"],
        },
        "servers": {},
    }
    urls = {name: database_url(url, DATABASES[name]) for name in NAMES}
    asyncio.run(recreate_databases(url, list(DATABASES.values()), create=True))
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
                    Server(python, "ours", urls[name], log_name=f"compare-{name}", python_path=roots[name])
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
        asyncio.run(recreate_databases(url, list(DATABASES.values()), create=False))
    return result


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
    """Whether now / base (``change``) moved by no more than the noise: its median's 95% interval overlaps
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
    base = result["library"]["base"]
    named = f"`{base['ref']}`" + ("" if base["commit"].startswith(base["ref"]) else f" ({base['commit'][:7]})")
    out = []
    for mode in MODES:
        change, noise = round_ratios(result, mode, *CHANGE), round_ratios(result, mode, *NOISE)
        out.append(
            Target(
                f"compare: {MODE_LABELS[mode]}, requests/s of the working tree / {named}, paired slices",
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


def render(result: dict[str, Any]) -> str:
    settings = result["settings"]
    library = result["library"]
    base, now = library["base"], library["now"]
    same = " **The two are the same library code.**" if library["identical"] else ""
    ratio_rows = []
    for mode in MODES:
        change, noise = round_ratios(result, mode, *CHANGE), round_ratios(result, mode, *NOISE)
        for label, ratios, reading in (
            ("now / base", change, _reading(change, noise)),
            ("now-again / now (now/now)", noise, ""),
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
        round_headers += ["now / base", "now/now"]
    invalid = [
        f"round {number + 1}, {mode}, {name}: {entry[mode][name]['invalid']}"
        for number, entry in enumerate(result["rounds"])
        for mode in MODES
        for name in NAMES
        if entry[mode][name]["invalid"]
    ]
    return "\n\n".join(
        [
            f"# `{base['ref']}` against the working tree",
            "The end-to-end benchmark on two libraries in one run ([README](../README.md#two-revisions), "
            "`compare.py`): three servers of `benchapp`'s `ours` variant (plain mode, `PostgresStore` with its "
            "defaults) up at once on one PostgreSQL, each on a database of its own migrated by its own library: "
            "*base*, *now*, and *now-again*, a second server of the working tree whose ratio to *now* is the "
            f"benchmark's noise. {settings['rounds']} rounds, each one {settings['slice_seconds']:g}-second "
            f"fresh-key slice and one replay slice ({settings['pool']} keys primed before the first round) of every "
            f"server, wrk with {settings['connections']} connections; the servers take the six orders in turn and "
            "fresh and replay alternate which goes first. A slice counts only if every answer was a 201, replayed "
            "exactly when it should be.",
            f"Base: `{base['ref']}` at {base['commit'][:12]} (library digest {base['digest'][:12]}). Now: the working "
            f"tree at {now['commit'][:12]}{' with changes not committed' if now['dirty'] else ''} (library digest "
            f"{now['digest'][:12]}).{same}",
            "## Verdict",
            "now / base is within the noise when the 95% interval of its median overlaps the noise band: the 95% "
            "interval of the median of now-again / now, stretched to hold 1.0. The intervals are distribution-free "
            "(the k-th smallest and largest round).",
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
    parser.add_argument("base", metavar="BASE", help="the git revision whose library the working tree is compared with")
    parser.add_argument("--quick", action="store_true", help="12 rounds of 1-second slices instead of 18 of 2 s")
    parser.add_argument("--rounds", type=int, help="rounds of slices (at least 6 for a verdict)")
    parser.add_argument("--seconds", type=float, help="seconds per slice (wrk counts whole seconds)")
    parser.add_argument("--no-write", action="store_true", help="print the tables, leave results/ as it is")
    parser.add_argument(
        "--name", default="compare", help="the results' name: results/NAME.md and raw/NAME.json (default: compare)"
    )
    args = parser.parse_args()
    settings = settings_for(args.base, args.quick)
    settings.rounds = args.rounds or settings.rounds
    settings.slice_seconds = args.seconds or settings.slice_seconds
    began, load_before = time.time(), load_average()
    loadgen.ensure_wrk()
    python, _, versions = peers.ensure()
    with pgserver.database() as db:
        result = measure_with(python, db.url, settings)
        database = "embedded, shared_buffers=1GB, pg_stat_statements" if db.embedded else "DATABASE_URL"
    markdown = render(result)
    print(markdown)
    if args.no_write:
        return
    written = publish(
        args.name,
        markdown,
        result,
        targets(result),
        began=began,
        mode="quick" if args.quick else "full",
        postgres=result["server"]["version"],
        database=f"{database}; {DATABASE_NOTE}",
        load_before=load_before,
        versions=versions,
        seconds=settings.slice_seconds,
    )
    log(f"written to {written}")


if __name__ == "__main__":
    main()
