"""Measurement 3: end to end over loopback, every variant on the same PostgreSQL, one load generator.

For each repetition, each variant (bare, hand-written, ours, each installed peer) gets a fresh
uvicorn process and empty tables, a warm-up (1 s quick, 2 s full), then a fresh-key run and, after priming
``POOL`` keys, a replay run. The database floor (``floor.py``) runs once per repetition. Odd repetitions run the
variants in reverse order, so slow drift of a shared machine does not favour one side. The tables report medians
over repetitions.

For each run it also keeps what the database did per request: each statement's calls, execution time and WAL
bytes (``pg_stat_statements``), the WAL written in all, and the context switches of the PostgreSQL processes; for
issue 14's question of why PostgreSQL spends more per request under HTTP traffic than under the floor.

Target 14.1 (ours against the hand-written app) is judged on a paired measurement of its own (:func:`run_paired`):
both servers up at once, short fresh-key slices alternating between them, the median of the per-round ratios. On a
shared machine whose speed drifts by tens of percent within a minute, two runs a minute apart can differ more than
the two apps do; two slices seconds apart cannot. The median comes with a distribution-free 95% interval: a goal
inside it is neither met nor missed with confidence.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import uuid
from typing import Any

import loadgen
from common import (
    Context,
    Target,
    median,
    median_interval,
    ratio,
    reset,
    statements,
    statements_per_request,
    table,
    target_table,
    wal_position,
)
from servers import CpuMeter, Server

POOL = 1000  # keys primed for the replay runs
PAIRED_SLICE = 2.0  # seconds per slice of the paired measurement (target 14.1)
PAIRED_GOAL = 0.95  # target 14.1: ours at least this share of the hand-written app's fresh-key requests/s
CPU_PARTS = ("app", "postgres", "client")
CONNECTIONS = 32
LABELS = {
    "bare": "bare app (no middleware)",
    "handwritten": "hand-written: claim + complete inline (asyncpg, prepared, 20 connections)",
    "ours": "idempotency_mw (PostgresStore, defaults)",
    "fastidempotent": "fastidempotent (PostgresBackend)",
    "fastapi-idempotency": "fastapi-idempotency (TortoiseStore)",
    "floor": "database floor: asyncpg claim + complete",
    "floor-contended": "the floor, while the bare app serves wrk on the same cores",
}


def check(load: loadgen.Load, replays: bool) -> str | None:
    """Why a run does not count, or None: every answer must be a 201, replayed exactly when expected."""
    if set(load.statuses) != {"201"} or any(load.errors.values()):
        return f"statuses {load.statuses}, errors {load.errors}"
    odd = f" (first: {load.odd})" if load.odd else ""
    if replays and load.replayed != load.requests:
        return f"only {load.replayed} of {load.requests} answers were replays{odd}"
    if not replays and load.replayed:
        return f"{load.replayed} answers were replays on fresh keys{odd}"
    return None


def warm_up(ctx: Context) -> float:
    """Seconds of traffic a fresh server gets before it is measured: its pool filled, its statements prepared."""
    return 1.0 if ctx.quick else 2.0


def run_variant(ctx: Context, variant: str, rep: int) -> dict[str, Any]:
    reset(ctx.db.url)
    out: dict[str, Any] = {}
    tag = f"{variant}-{rep}-{uuid.uuid4().hex[:6]}"
    with Server(ctx.python, variant, ctx.db.url, log_name=f"e2e-{variant}") as server:
        meter = CpuMeter(server.pid, ctx.db.postmaster_pid)
        loadgen.run(server.url, mode="fresh", prefix=f"warm-{tag}", connections=CONNECTIONS, seconds=warm_up(ctx))
        before = Reading.take(ctx, meter, server)
        fresh = loadgen.run(server.url, mode="fresh", prefix=f"f-{tag}", connections=CONNECTIONS, seconds=ctx.seconds)
        out["fresh"] = {**fresh.as_dict(), **before.per_request(ctx, meter, fresh.requests, server)}
        out["fresh"]["invalid"] = check(fresh, replays=False)
        if variant != "bare":
            primed = asyncio.run(loadgen.prime(server.url, f"p-{tag}", POOL))
            before = Reading.take(ctx, meter, server)
            replay = loadgen.run(
                server.url, mode="replay", prefix=f"p-{tag}", pool=POOL, connections=CONNECTIONS, seconds=ctx.seconds
            )
            invalid = check(replay, replays=True) or (None if set(primed) == {201} else f"priming answered {primed}")
            measured = before.per_request(ctx, meter, replay.requests, server)
            out["replay"] = {**replay.as_dict(), **measured, "invalid": invalid}
    return out


class Reading:
    """CPU, WAL position and statement counters at one moment, to take per-request differences from."""

    def __init__(
        self,
        cpu: dict[str, float | None],
        wal: int,
        stats: dict[str, dict[str, float]] | None,
        collector: dict[str, Any] | None,
    ) -> None:
        self.cpu, self.wal, self.stats, self.collector = cpu, wal, stats, collector

    @classmethod
    def take(cls, ctx: Context, meter: CpuMeter, server: Server | None = None) -> Reading:
        collector = server.collector() if server is not None else None
        return cls(meter.read(), wal_position(ctx.db.url), statements(ctx.db.url), collector)

    def per_request(self, ctx: Context, meter: CpuMeter, requests: int, server: Server | None = None) -> dict[str, Any]:
        after = Reading.take(ctx, meter, server)
        cpu = meter.per_request(self.cpu, after.cpu, requests)
        collector = None
        if self.collector is not None and after.collector is not None and requests:
            collector = {
                "us": (after.collector["seconds"] - self.collector["seconds"]) / requests * 1e6,
                "per_1000": [
                    (a - b) / requests * 1000
                    for a, b in zip(after.collector["collections"], self.collector["collections"], strict=True)
                ],
            }
        return {
            "cpu_us": cpu,
            "postgres_switches": cpu.pop("postgres_switches", None),
            "wal_bytes": (after.wal - self.wal) / requests if requests else None,
            "statements": statements_per_request(self.stats, after.stats, requests),
            "collector": collector,
        }


def run_floor(ctx: Context, contended: bool = False) -> dict[str, Any]:
    """The floor's client (floor.py) is this process's child: its CPU is the "app" part, there is no wrk.

    ``contended``: while the bare app serves wrk on the same cores (HTTP with no database work), so PostgreSQL
    runs the floor's statements while competing for the CPU as it does under the HTTP variants."""
    reset(ctx.db.url)
    with contextlib.ExitStack() as stack:
        if contended:
            server = stack.enter_context(Server(ctx.python, "bare", None, log_name="e2e-contention"))
            background = loadgen.Background(
                server.url, mode="fresh", prefix="contention", connections=CONNECTIONS, limit=ctx.seconds + 60
            ).start()
            stack.callback(background.stop)
        meter = CpuMeter(None, ctx.db.postmaster_pid)
        before = Reading.take(ctx, meter)
        floor = ctx.script("floor.py", "--dsn", ctx.db.url, "--seconds", str(ctx.seconds))
        measured = before.per_request(ctx, meter, floor["requests"])
    if measured["postgres_switches"] is not None:  # its own backends ended before the reading: floor.py counted them
        measured["postgres_switches"] += floor["backend_switches"] / floor["requests"]
    cpu = measured["cpu_us"]
    measured["cpu_us"] = {"app": cpu["client"], "postgres": cpu["postgres"], "client": None}
    return {**floor, **measured, "invalid": None}


def run_paired(ctx: Context, rounds: int) -> dict[str, Any]:
    """Ours against the hand-written app, both servers up at once: each round one fresh-key slice of each (the order
    alternating), so the two numbers of a round are taken seconds apart on the same machine. With a Python 3.12+
    venv (``ctx.eager``), a second pair of servers runs there, in the same rounds: eager tasks
    (``start_eagerly`` in ``idempotency_mw/_claim.py``)."""
    reset(ctx.db.url)
    tag = uuid.uuid4().hex[:6]
    eager = ctx.eager
    pythons = {"main": ctx.python, **({"eager": eager.python} if eager and eager.python else {})}
    pair = ("handwritten", "ours")
    slices: dict[str, dict[str, list[float]]] = {which: {variant: [] for variant in pair} for which in pythons}
    invalid: dict[str, list[str]] = {which: [] for which in pythons}
    with contextlib.ExitStack() as stack:
        servers = {
            which: {
                variant: stack.enter_context(
                    Server(python, variant, ctx.db.url, log_name=f"e2e-paired-{variant}-{which}")
                )
                for variant in pair
            }
            for which, python in pythons.items()
        }
        for which, variant in itertools.product(pythons, pair):
            loadgen.run(
                servers[which][variant].url,
                mode="fresh",
                prefix=f"pw-{variant}-{which}-{tag}",
                connections=CONNECTIONS,
                seconds=warm_up(ctx),
            )
        for round_ in range(rounds):
            forward = round_ % 2 == 0
            for which in list(pythons) if forward else list(pythons)[::-1]:
                for variant in pair if forward else pair[::-1]:
                    load = loadgen.run(
                        servers[which][variant].url,
                        mode="fresh",
                        prefix=f"p{round_}-{variant}-{which}-{tag}",
                        connections=CONNECTIONS,
                        seconds=PAIRED_SLICE,
                    )
                    problem = check(load, replays=False)
                    if problem:
                        invalid[which].append(f"{variant}, round {round_}: {problem}")
                    slices[which][variant].append(load.rps)
    result = {"rounds": rounds, "slice_seconds": PAIRED_SLICE, **_paired_outcome(slices["main"], invalid["main"])}
    if eager is not None:
        result["eager"] = (
            {"python": eager.version, **_paired_outcome(slices["eager"], invalid["eager"])}
            if eager.python
            else {"missing": eager.missing}
        )
    return result


def _paired_outcome(rps: dict[str, list[float]], invalid: list[str]) -> dict[str, Any]:
    ratios = [o / h for o, h in zip(rps["ours"], rps["handwritten"], strict=True) if o and h]
    return {
        "rps": rps,
        "ratios": ratios,
        "median_ratio": median(ratios) if ratios and not invalid else None,
        "invalid": invalid,
    }


def measure(ctx: Context) -> dict[str, Any]:
    variants = ["bare", "handwritten", "ours", *ctx.usable_peers()]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        v: {"fresh": [], "replay": []} for v in [*variants, "floor", "floor-contended"]
    }
    for rep in range(ctx.repetitions):
        order = variants if rep % 2 == 0 else variants[::-1]
        for position, variant in enumerate(order):
            if position == len(order) // 2:  # the floor sits mid-sequence, between the variants
                runs["floor"]["fresh"].append(run_floor(ctx))
                runs["floor-contended"]["fresh"].append(run_floor(ctx, contended=True))
            for mode, result in run_variant(ctx, variant, rep).items():
                runs[variant][mode].append(result)
    summary: dict[str, Any] = {}
    for variant, modes in runs.items():
        for mode, results in modes.items():
            valid = [r for r in results if not r["invalid"]]
            if not results:
                continue
            summary.setdefault(variant, {})[mode] = {
                "rps": median(r["rps"] for r in valid) if valid else None,
                "p50_ms": median(r["p50_ms"] for r in valid) if valid else None,
                "p99_ms": median(r["p99_ms"] for r in valid) if valid else None,
                "runs": len(results),
                "invalid": [r["invalid"] for r in results if r["invalid"]],
                "each_rps": [round(r["rps"]) for r in results],
                "cpu_us": {
                    part: median(r["cpu_us"][part] for r in valid)
                    if valid and valid[0]["cpu_us"][part] is not None
                    else None
                    for part in CPU_PARTS
                },
                "postgres_switches": median(r["postgres_switches"] for r in valid)
                if valid and valid[0].get("postgres_switches") is not None
                else None,
                "wal_bytes": median(r["wal_bytes"] for r in valid) if valid else None,
                "statements": median_statements([r["statements"] for r in valid if r.get("statements")]),
                "collector": median_collector([r["collector"] for r in valid if r.get("collector")]),
            }
    paired = run_paired(ctx, rounds=8 if ctx.quick else 20)
    return {
        "connections": CONNECTIONS,
        "seconds": ctx.seconds,
        "repetitions": ctx.repetitions,
        "summary": summary,
        "paired": paired,
    }


def median_collector(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not runs:
        return None
    return {
        "us": median(r["us"] for r in runs),
        "per_1000": [median(r["per_1000"][generation] for r in runs) for generation in range(3)],
    }


def median_statements(runs: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]] | None:
    """Per statement and field, the median over runs (a statement missing from a run counts as 0 there)."""
    if not runs:
        return None
    names = sorted({name for run in runs for name in run})
    fields = ("calls", "exec_us", "wal_bytes")
    return {name: {f: median(run.get(name, {}).get(f, 0.0) for run in runs) for f in fields} for name in names}


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The ratios the targets are about, and the best peer each is taken against."""
    s = result["summary"]
    peers = [p for p in ("fastidempotent", "fastapi-idempotency") if p in s]

    def rps(variant: str, mode: str) -> float:
        value = s.get(variant, {}).get(mode, {}).get("rps")
        return float(value) if value else 0.0

    def over(a: float, b: float) -> float | None:
        return a / b if a and b else None

    best_fresh = max(peers, key=lambda p: rps(p, "fresh"), default=None)
    best_replay = max(peers, key=lambda p: rps(p, "replay"), default=None)
    return {
        "best_fresh_peer": best_fresh,
        "best_replay_peer": best_replay,
        "fresh_vs_peer": over(rps("ours", "fresh"), rps(best_fresh, "fresh")) if best_fresh else None,
        "fresh_vs_floor": over(rps("ours", "fresh"), rps("floor", "fresh")),
        "replay_vs_peer": over(rps("ours", "replay"), rps(best_replay, "replay")) if best_replay else None,
        "fresh_vs_bare": over(rps("ours", "fresh"), rps("bare", "fresh")),
        "fresh_vs_handwritten": over(rps("ours", "fresh"), rps("handwritten", "fresh")),
        "replay_vs_handwritten": over(rps("ours", "replay"), rps("handwritten", "replay")),
    }


def targets(result: dict[str, Any]) -> list[Target]:
    h = headline(result)

    def judged(what: str, goal: str, value: float | None, least: float, against: str) -> Target:
        if value is None:
            return Target(what, goal, f"n/a (no valid {against} runs)", None)
        return Target(what, goal, f"{value:.2f}x {against}", value >= least)

    def paired(what: str, run: dict[str, Any]) -> Target:
        goal = f"≥ {PAIRED_GOAL:.2f}x"
        if "missing" in run:
            return Target(what, goal, f"not measured: {run['missing']}", None)
        if run["median_ratio"] is None:
            return Target(what, goal, "n/a (no valid hand-written runs)", None)
        return Target(what, goal, paired_summary(run), run["median_ratio"] >= PAIRED_GOAL)

    main = result.get("paired") or {"median_ratio": None}
    eager = main.get("eager")
    return [
        judged(
            "3. fresh-key throughput vs the best peer", "≥ 2x", h["fresh_vs_peer"], 2, h["best_fresh_peer"] or "peer"
        ),
        paired("14.1 fresh-key throughput vs the hand-written app (inline asyncpg; paired slices, median ratio)", main),
        *([paired(f"14.1 on Python {eager.get('python', '3.12+')}, tasks started eagerly", eager)] if eager else []),
        judged("3. fresh-key throughput vs the database floor", "≥ 0.60x", h["fresh_vs_floor"], 0.6, "floor"),
        judged(
            "3. replay throughput vs the best peer", "≥ 2x", h["replay_vs_peer"], 2, h["best_replay_peer"] or "peer"
        ),
    ]


def render(result: dict[str, Any], ctx: Context) -> str:
    s = result["summary"]
    floor = s.get("floor", {}).get("fresh", {}).get("rps") or 0.0
    ours_fresh = s.get("ours", {}).get("fresh", {}).get("rps") or 0.0

    def us(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    def cells(variant: str, mode: str) -> list[str]:
        entry = s.get(variant, {}).get(mode)
        if not entry:
            return ["-"] * 11
        if entry["rps"] is None:
            return ["invalid: " + "; ".join(entry["invalid"]), *[""] * 10]
        handwritten = s.get("handwritten", {}).get(mode, {}).get("rps") or 0.0
        cpu = entry.get("cpu_us") or {}
        parts = [cpu.get(part) for part in CPU_PARTS]
        total = sum(x for x in parts if x is not None) if cpu.get("postgres") is not None else None
        return [
            f"{entry['rps']:.0f}",
            ratio(entry["rps"], ours_fresh) if mode == "fresh" else "",
            ratio(entry["rps"], handwritten) if not variant.startswith("floor") else "",
            ratio(entry["rps"], floor),
            f"{entry['p50_ms']:.1f}",
            f"{entry['p99_ms']:.1f}",
            *(us(x) for x in parts),
            us(total),
            ", ".join(str(x) for x in entry["each_rps"]),
        ]

    rows = []
    for variant in ("bare", "handwritten", "ours", "fastidempotent", "fastapi-idempotency", "floor", "floor-contended"):
        if variant in ctx.peers and ctx.peers[variant] is not None:
            rows.append([LABELS[variant], "fresh/replay", f"could not run: {ctx.peers[variant]}", *[""] * 10])
            continue
        for mode in ("fresh", "replay"):
            if mode in s.get(variant, {}):
                label = (
                    "claim+complete pairs"
                    if variant.startswith("floor")
                    else ("fresh keys" if mode == "fresh" else mode)
                )
                if variant == "bare":
                    label = "keyed POST, ignored"
                rows.append([LABELS[variant], label, *cells(variant, mode)])
    return "\n\n".join(
        [
            "# End to end over loopback",
            f"uvicorn (1 process, uvloop + httptools) on 127.0.0.1, wrk with {result['connections']} keep-alive "
            f"connections (1 thread), {result['seconds']:g} s per run, {result['repetitions']} interleaved "
            "repetitions (odd ones in reverse order); medians shown, every run's requests/s in the last column. "
            "Every variant talks to the same PostgreSQL over its Unix socket. Fresh runs send a new key per "
            f"request; replay runs cycle through {POOL} keys primed just before. A run counts only if every answer "
            "was a 201 and replayed exactly when it should be. The floor is `floor.py`: 20 asyncpg connections "
            "looping over the store's own claim and complete statements, no HTTP, no pool; the contended floor is "
            "the same while the bare app serves wrk on the same cores (HTTP, no database work), which puts "
            "PostgreSQL in the competition for the CPU that it meets under the HTTP variants.",
            target_table(targets(result)),
            table(
                [
                    "variant",
                    "traffic",
                    "requests/s",
                    "vs ours fresh",
                    "vs hand-written",
                    "vs floor",
                    "p50 ms",
                    "p99 ms",
                    "CPU µs/req: app",
                    "postgres",
                    "wrk",
                    "total",
                    "each run",
                ],
                rows,
            ),
            "CPU µs per request: CPU time (user + system) each part used during the run, divided by the requests "
            "answered. *app* is the uvicorn process (for the floor: the floor.py client), *postgres* every server "
            "process, *wrk* the load generator. Server, database and load generator share this machine's "
            f"{os.cpu_count()} cores, so when they keep them busy, throughput follows the total: a variant's "
            "requests/s relative to the floor is close to the floor's total CPU per request over the variant's.",
            *paired_section(result.get("paired")),
            *collector_section(s),
            "## What the database did per request",
            "Medians over the runs above. *statements*: calls and execution time per request of each statement, "
            "from `pg_stat_statements` (execution only: parsing, the protocol, waking up and commit are outside "
            "it); *WAL*: bytes of WAL the server wrote during the run per request, from the WAL position; "
            "*switches*: context switches of the PostgreSQL processes per request.",
            table(
                ["variant", "traffic", "postgres CPU µs", "switches", "WAL bytes", "statements: calls x exec µs"],
                database_rows(s),
            ),
        ]
    )


def collector_section(s: dict[str, Any]) -> list[str]:
    """The cycle collector's share of the app process's CPU, per variant (``benchapp.CollectorStats``)."""
    rows = []
    for variant in ("bare", "handwritten", "ours", "fastidempotent", "fastapi-idempotency"):
        for mode in ("fresh", "replay"):
            entry = s.get(variant, {}).get(mode)
            collector = entry.get("collector") if entry else None
            if not collector:
                continue
            app = (entry.get("cpu_us") or {}).get("app")
            per_1000 = collector["per_1000"]
            rows.append(
                [
                    LABELS[variant],
                    "fresh keys" if mode == "fresh" else mode,
                    f"{collector['us']:.1f}",
                    "-" if not app else f"{collector['us'] / app:.0%}",
                    " / ".join(f"{n:.1f}" for n in per_1000),
                ]
            )
    if not rows:
        return []
    return [
        "## The cycle collector in the app process",
        "Time the server process's cycle collector ran during each run (gc.callbacks in the uvicorn process, the "
        "same for every variant), per request, and collections per 1,000 requests by generation; medians over the "
        "runs above. A collection of the oldest generation walks the whole heap.",
        table(
            ["variant", "traffic", "collector µs/req", "of the app's CPU", "collections per 1,000 (gen 0 / 1 / 2)"],
            rows,
        ),
    ]


def paired_summary(paired: dict[str, Any]) -> str:
    """The paired median to three digits (0.899 is not the 0.90 it misses) with its 95% interval, e.g.
    ``0.899x hand-written (95% interval 0.87 to 0.97x, 20 rounds)``."""
    interval = median_interval(paired["ratios"])
    spread = f"95% interval {interval[0]:.2f} to {interval[1]:.2f}x, " if interval else ""
    return f"{paired['median_ratio']:.3f}x hand-written ({spread}{len(paired['ratios'])} rounds)"


def paired_section(paired: dict[str, Any] | None) -> list[str]:
    """Target 14.1's own measurement: the paired slices, every round shown, on each interpreter measured."""
    if not paired:
        return []
    eager = paired.get("eager") or {}
    runs = [paired, *([eager] if "rps" in eager else [])]
    rows = [
        [str(n + 1), *(cell for run in runs for cell in _round_cells(run["rps"], n))] for n in range(paired["rounds"])
    ]
    headers = ["round", "hand-written requests/s", "ours requests/s", "ours / hand-written"]
    notes = []
    if "rps" in eager:
        headers += [f"{header}, Python {eager['python']}" for header in headers[1:]]
        notes.append(
            f"A second pair of servers runs the same two apps on Python {eager['python']} in the same rounds, where "
            "asyncio starts a task eagerly: the claim and the settlement, each in a task of its own so that a "
            "cancellation cannot lose them (`start_eagerly`, idempotency_mw/_claim.py), run in the request's turn "
            f"of the event loop up to their first wait instead of costing a turn each. {_paired_verdict(eager)}"
        )
    elif "missing" in eager:
        notes.append(f"Python 3.12 or later was not measured: {eager['missing']}.")
    return [
        "## Ours against the hand-written app, paired (target 14.1)",
        f"Both servers up at once on the same PostgreSQL; {paired['rounds']} rounds, each one "
        f"{paired['slice_seconds']:g} s fresh-key slice of each (order alternating), so the two numbers of a "
        "round are seconds apart. The runs above are a minute apart, and this machine's speed drifts by more than "
        f"the two apps differ within that; the target is judged here. {_paired_verdict(paired)}",
        *notes,
        table(headers, rows),
    ]


def _round_cells(rps: dict[str, list[float]], n: int) -> list[str]:
    hand, ours = rps["handwritten"][n], rps["ours"][n]
    return [f"{hand:.0f}", f"{ours:.0f}", f"{ours / hand:.2f}x" if hand else "-"]


def _paired_verdict(paired: dict[str, Any]) -> str:
    ratios = paired["ratios"]
    if paired["median_ratio"] is None:
        return "No verdict: " + "; ".join(paired["invalid"])
    verdict = (
        f"Median of the per-round ratios: **{paired['median_ratio']:.3f}x** (rounds {min(ratios):.2f} to "
        f"{max(ratios):.2f}x)."
    )
    interval = median_interval(ratios)
    if interval:
        low, high = interval
        verdict += (
            f" A 95% confidence interval for the median, from the order of the rounds alone, runs from "
            f"{low:.3f} to {high:.3f}x"
            + (
                f": the goal of {PAIRED_GOAL:.2f}x lies inside it, so this run can neither confirm nor rule "
                "out that the goal is met."
                if low <= PAIRED_GOAL <= high
                else "."
            )
        )
    return verdict


def database_rows(s: dict[str, Any]) -> list[list[str]]:
    rows = []
    for variant in ("handwritten", "ours", "floor", "floor-contended"):
        for mode in ("fresh", "replay"):
            entry = s.get(variant, {}).get(mode)
            if not entry or entry.get("rps") is None:
                continue
            found = entry.get("statements") or {}
            listed = "; ".join(
                f"{name} {v['calls']:.2f} x {v['exec_us'] / v['calls']:.0f}"
                for name, v in sorted(found.items(), key=lambda kv: -kv[1]["exec_us"])
                if v["calls"] >= 0.01
            )
            postgres = (entry.get("cpu_us") or {}).get("postgres")
            switches = entry.get("postgres_switches")
            wal = entry.get("wal_bytes")
            rows.append(
                [
                    LABELS[variant],
                    "claim+complete pairs"
                    if variant.startswith("floor")
                    else ("fresh keys" if mode == "fresh" else mode),
                    "-" if postgres is None else f"{postgres:.0f}",
                    "-" if switches is None else f"{switches:.1f}",
                    "-" if wal is None else f"{wal:.0f}",
                    listed or "-",
                ]
            )
    return rows
