"""Measurement 3: end to end over loopback, every variant on the same PostgreSQL, one load generator.

For each repetition, each variant (bare, ours, ours with the pool reset off, each installed peer) gets a fresh
uvicorn process and empty tables, a 2-second warm-up, then a fresh-key run and, after priming ``POOL`` keys, a
replay run. The database floor (``floor.py``) runs once per repetition. Odd repetitions run the variants in reverse
order, so slow drift of a shared machine does not favour one side. The tables report medians over repetitions.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import loadgen
from common import Context, median, ratio, reset, table, verdict
from servers import Server

POOL = 1000  # keys primed for the replay runs
CONNECTIONS = 32
LABELS = {
    "bare": "bare app (no middleware)",
    "ours": "idempotency_mw (PostgresStore, defaults)",
    "ours-noreset": "idempotency_mw, app pool with reset off",
    "fastidempotent": "fastidempotent (PostgresBackend)",
    "fastapi-idempotency": "fastapi-idempotency (TortoiseStore)",
    "floor": "database floor: asyncpg claim + complete",
}


def check(load: loadgen.Load, replays: bool) -> str | None:
    """Why a run does not count, or None: every answer must be a 201, replayed exactly when expected."""
    if set(load.statuses) != {"201"} or any(load.errors.values()):
        return f"statuses {load.statuses}, errors {load.errors}"
    if replays and load.replayed != load.requests:
        return f"only {load.replayed} of {load.requests} answers were replays"
    if not replays and load.replayed:
        return f"{load.replayed} answers were replays on fresh keys"
    return None


def run_variant(ctx: Context, variant: str, rep: int) -> dict[str, Any]:
    reset(ctx.db.url)
    out: dict[str, Any] = {}
    tag = f"{variant}-{rep}-{uuid.uuid4().hex[:6]}"
    with Server(ctx.python, variant, ctx.db.url, log_name=f"e2e-{variant}") as server:
        loadgen.run(server.url, mode="fresh", prefix=f"warm-{tag}", connections=CONNECTIONS, seconds=2)
        fresh = loadgen.run(server.url, mode="fresh", prefix=f"f-{tag}", connections=CONNECTIONS, seconds=ctx.seconds)
        out["fresh"] = {**fresh.as_dict(), "invalid": check(fresh, replays=False)}
        if variant != "bare":
            primed = asyncio.run(loadgen.prime(server.url, f"p-{tag}", POOL))
            replay = loadgen.run(
                server.url, mode="replay", prefix=f"p-{tag}", pool=POOL, connections=CONNECTIONS, seconds=ctx.seconds
            )
            invalid = check(replay, replays=True) or (None if set(primed) == {201} else f"priming answered {primed}")
            out["replay"] = {**replay.as_dict(), "invalid": invalid}
    return out


def measure(ctx: Context) -> dict[str, Any]:
    variants = ["bare", "ours", "ours-noreset", *ctx.usable_peers()]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {v: {"fresh": [], "replay": []} for v in [*variants, "floor"]}
    for rep in range(ctx.repetitions):
        order = variants if rep % 2 == 0 else variants[::-1]
        for position, variant in enumerate(order):
            if position == len(order) // 2:  # the floor sits mid-sequence, between the variants
                reset(ctx.db.url)
                floor = ctx.script("floor.py", "--dsn", ctx.db.url, "--seconds", str(ctx.seconds))
                runs["floor"]["fresh"].append({**floor, "invalid": None})
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
            }
    return {"connections": CONNECTIONS, "seconds": ctx.seconds, "repetitions": ctx.repetitions, "summary": summary}


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The ratios the targets are about."""
    s = result["summary"]
    peers = [p for p in ("fastidempotent", "fastapi-idempotency") if p in s]

    def rps(variant: str, mode: str) -> float:
        value = s.get(variant, {}).get(mode, {}).get("rps")
        return float(value) if value else 0.0

    best_fresh = max((rps(p, "fresh") for p in peers), default=0.0)
    best_replay = max((rps(p, "replay") for p in peers), default=0.0)
    return {
        "fresh_vs_peer": rps("ours", "fresh") / best_fresh if best_fresh else None,
        "fresh_vs_floor": rps("ours", "fresh") / rps("floor", "fresh") if rps("floor", "fresh") else None,
        "replay_vs_peer": rps("ours", "replay") / best_replay if best_replay else None,
        "fresh_vs_bare": rps("ours", "fresh") / rps("bare", "fresh") if rps("bare", "fresh") else None,
        "noreset_fresh_vs_floor": rps("ours-noreset", "fresh") / rps("floor", "fresh")
        if rps("floor", "fresh")
        else None,
        "noreset_replay_vs_peer": rps("ours-noreset", "replay") / best_replay if best_replay else None,
    }


def render(result: dict[str, Any], ctx: Context) -> str:
    s = result["summary"]
    floor = s["floor"]["fresh"]["rps"] or 0.0
    ours_fresh = s["ours"]["fresh"]["rps"] or 0.0

    def cells(variant: str, mode: str) -> list[str]:
        entry = s.get(variant, {}).get(mode)
        if not entry:
            return ["-"] * 6
        if entry["rps"] is None:
            return ["invalid: " + "; ".join(entry["invalid"]), "", "", "", "", ""]
        return [
            f"{entry['rps']:.0f}",
            ratio(entry["rps"], ours_fresh) if mode == "fresh" else "",
            ratio(entry["rps"], floor),
            f"{entry['p50_ms']:.1f}",
            f"{entry['p99_ms']:.1f}",
            ", ".join(str(x) for x in entry["each_rps"]),
        ]

    rows = []
    for variant in ("bare", "ours", "ours-noreset", "fastidempotent", "fastapi-idempotency", "floor"):
        if variant not in s and variant not in ctx.peers:
            continue
        if variant in ctx.peers and ctx.peers[variant] is not None:
            rows.append([LABELS[variant], "fresh/replay", f"could not run: {ctx.peers[variant]}", "", "", "", "", ""])
            continue
        for mode in ("fresh", "replay"):
            if mode in s.get(variant, {}):
                label = "claim+complete pairs" if variant == "floor" else ("fresh keys" if mode == "fresh" else mode)
                if variant == "bare":
                    label = "keyed POST, ignored"
                rows.append([LABELS[variant], label, *cells(variant, mode)])
    h = headline(result)
    fmt = lambda x: f"{x:.2f}x" if x is not None else "n/a"  # noqa: E731
    targets = table(
        ["target", "measured", "verdict"],
        [
            [
                "fresh-key throughput ≥ 2x the best peer",
                fmt(h["fresh_vs_peer"]),
                verdict((h["fresh_vs_peer"] or 0) >= 2),
            ],
            [
                "fresh-key throughput ≥ 60% of the floor",
                fmt(h["fresh_vs_floor"]),
                verdict((h["fresh_vs_floor"] or 0) >= 0.6),
            ],
            [
                "replay throughput ≥ 2x the best peer",
                fmt(h["replay_vs_peer"]),
                verdict((h["replay_vs_peer"] or 0) >= 2),
            ],
        ],
    )
    return "\n\n".join(
        [
            "# End to end over loopback",
            f"uvicorn (1 process, uvloop + httptools) on 127.0.0.1, wrk with {result['connections']} keep-alive "
            f"connections (1 thread), {result['seconds']:.0f} s per run, {result['repetitions']} interleaved "
            "repetitions (odd ones in reverse order); medians shown, every run's requests/s in the last column. "
            "Every variant talks to the same PostgreSQL over its Unix socket. Fresh runs send a new key per "
            f"request; replay runs cycle through {POOL} keys primed just before. A run counts only if every answer "
            "was a 201 and replayed exactly when it should be.",
            targets,
            table(
                ["variant", "traffic", "requests/s", "vs ours fresh", "vs floor", "p50 ms", "p99 ms", "each run"], rows
            ),
        ]
    )
