"""Measurement 4: does a request get slower as the table grows? 10⁴, 10⁶ and (full mode) 10⁷ stored records.

At each size the table is topped up with :mod:`bulk` (completed records, 24 h to live), then a fresh server takes
fresh-key traffic (new random keys go into the big primary-key index) and replay traffic on keys picked uniformly at
random among the stored ones of its tenant (so the larger the table, the larger and colder the set of rows a replay
may touch). Both run ``REPETITIONS`` times, alternating, with few connections so latency is not mostly queueing.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import bulk
import loadgen
from common import Context, median, ratio, reset, table, verdict
from endtoend import check
from servers import Server

CONNECTIONS = 8
REPETITIONS = 2


def measure(ctx: Context) -> dict[str, Any]:
    levels = [10**4, 10**6] if ctx.quick else [10**4, 10**6, 10**7]
    reset(ctx.db.url)
    have = 0
    out: dict[str, Any] = {"levels": [], "connections": CONNECTIONS, "repetitions": REPETITIONS}
    for level in levels:
        load_seconds = asyncio.run(bulk.add_records(ctx.db.url, have, level, prefix="bulk"))
        have = level
        rows, size = asyncio.run(bulk.table_size(ctx.db.url))
        runs: dict[str, list[loadgen.Load]] = {"fresh": [], "replay": []}
        invalid: list[str] = []
        tag = uuid.uuid4().hex[:6]
        with Server(ctx.python, "ours", ctx.db.url, log_name=f"scale-{level}") as server:
            loadgen.run(server.url, mode="fresh", prefix=f"warm-{tag}", connections=CONNECTIONS, seconds=2)
            for rep in range(REPETITIONS):
                fresh = loadgen.run(
                    server.url, mode="fresh", prefix=f"s{rep}-{tag}", connections=CONNECTIONS, seconds=ctx.seconds
                )
                replay = loadgen.run(
                    server.url,
                    mode="sample",
                    prefix="bulk",
                    pool=level // bulk.REPLAYABLE_EVERY,
                    stride=bulk.REPLAYABLE_EVERY,
                    connections=CONNECTIONS,
                    seconds=ctx.seconds,
                )
                for mode, load, replays in (("fresh", fresh, False), ("replay", replay, True)):
                    problem = check(load, replays=replays)
                    if problem:
                        invalid.append(f"{mode}: {problem}")
                    else:
                        runs[mode].append(load)
        level_out: dict[str, Any] = {
            "records": level,
            "rows": rows,
            "bytes": size,
            "load_seconds": load_seconds,
            "invalid": invalid,
        }
        for mode, loads in runs.items():
            level_out[mode] = {
                "rps": median(x.rps for x in loads) if loads else None,
                "p50_ms": median(x.p50_ms for x in loads) if loads else None,
                "p99_ms": median(x.p99_ms for x in loads) if loads else None,
            }
        out["levels"].append(level_out)
    return out


def worst(result: dict[str, Any]) -> float | None:
    """The largest latency ratio (p50 or p99, fresh or replay) of any size against the smallest size."""
    base = result["levels"][0]
    ratios = []
    for level in result["levels"][1:]:
        for mode in ("fresh", "replay"):
            for q in ("p50_ms", "p99_ms"):
                if level[mode][q] and base[mode][q]:
                    ratios.append(level[mode][q] / base[mode][q])
    return max(ratios) if ratios else None


def render(result: dict[str, Any], ctx: Context) -> str:
    base = result["levels"][0]
    rows = []
    for level in result["levels"]:
        for mode in ("fresh", "replay"):
            entry = level[mode]
            if entry["rps"] is None:
                rows.append([f"{level['records']:,}", mode, "invalid", "", "", "", "", ""])
                continue
            rows.append(
                [
                    f"{level['records']:,}",
                    mode,
                    f"{entry['rps']:.0f}",
                    f"{entry['p50_ms']:.2f}",
                    ratio(entry["p50_ms"], base[mode]["p50_ms"]),
                    f"{entry['p99_ms']:.2f}",
                    ratio(entry["p99_ms"], base[mode]["p99_ms"]),
                    f"{level['bytes'] / 2**20:,.0f} MiB, loaded in {level['load_seconds']:.0f} s",
                ]
            )
    w = worst(result)
    sizes = ", ".join(f"{level['records']:,}" for level in result["levels"])
    note = (
        "Quick mode: 10⁴ and 10⁶ records only; the full mode adds 10⁷."
        if ctx.quick
        else "Full mode: 10⁴, 10⁶ and 10⁷ records."
    )
    problems = [f"- {level['records']:,}: {p}" for level in result["levels"] for p in level["invalid"]]
    return "\n\n".join(
        [
            "# Scale: latency against the number of stored records",
            f"{note} Sizes measured: {sizes}. One uvicorn process with idempotency_mw (PostgresStore), wrk with "
            f"{result['connections']} connections, {ctx.seconds:.0f} s per run, {result['repetitions']} alternating "
            "fresh/replay repetitions per size; medians. Replays pick a stored key of the load generator's tenant "
            "uniformly at random (1 in 100 stored records), fresh requests insert new random keys.",
            table(
                ["target", "measured", "verdict"],
                [
                    [
                        "p50 and p99 flat within 25% from the smallest to the largest table",
                        f"worst ratio {w:.2f}x" if w else "n/a",
                        verdict(w is not None and w <= 1.25),
                    ]
                ],
            ),
            table(
                [
                    "stored records",
                    "traffic",
                    "requests/s",
                    "p50 ms",
                    "p50 vs smallest",
                    "p99 ms",
                    "p99 vs smallest",
                    "table + indexes",
                ],
                rows,
            ),
            *(["Runs that did not count:", *problems] if problems else []),
        ]
    )
