"""Measurement 6: peak resident memory of the server with 64 concurrent requests, each answered with 1 MiB.

For each variant a fresh server is warmed up, its idle RSS read, then ``BURSTS`` bursts of 64 simultaneous
``POST /big`` requests (new keys; or, for "replay", the 64 keys of a primed burst) are sent while a thread samples
the server's RSS every 2 ms. The client reads every body in full. Reported: idle RSS, peak RSS, and the growth.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
from common import Context, Target, reset, table, target_table
from loadgen import BODY, HEADERS
from servers import PeakRss, Server

CONCURRENT = 64
BURSTS = 3
MiB = 1024 * 1024


async def burst(url: str, keys: list[str]) -> dict[int, int]:
    limits = httpx.Limits(max_connections=CONCURRENT, max_keepalive_connections=CONCURRENT)
    statuses: dict[int, int] = {}
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def one(key: str) -> None:
            response = await client.post("/big", content=BODY, headers={**HEADERS, "idempotency-key": key})
            assert len(response.content) == MiB, f"got {len(response.content)} bytes"
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

        await asyncio.gather(*(one(key) for key in keys))
    return statuses


def measure_variant(ctx: Context, variant: str, replay: bool) -> dict[str, Any]:
    reset(ctx.db.url)
    tag = uuid.uuid4().hex[:6]
    server_variant = variant.removesuffix(" replay")
    primed = [f"primed-{tag}-{i}" for i in range(CONCURRENT)]
    if replay:  # stored by another process, so the measured one starts from the same idle state as the others
        with Server(ctx.python, server_variant, ctx.db.url, log_name=f"rss-{server_variant}-prime") as server:
            asyncio.run(burst(server.url, primed))
    with Server(ctx.python, server_variant, ctx.db.url, log_name=f"rss-{server_variant}") as server:
        asyncio.run(burst(server.url, [f"warm-{tag}-{i}" for i in range(4)]))
        idle = server.rss()
        statuses: dict[int, int] = {}
        with PeakRss(server.pid) as peak:
            for b in range(BURSTS):
                keys = primed if replay else [f"b{b}-{tag}-{i}" for i in range(CONCURRENT)]
                for status, n in asyncio.run(burst(server.url, keys)).items():
                    statuses[status] = statuses.get(status, 0) + n
        return {"idle": idle, "peak": peak.peak, "statuses": statuses}


def measure(ctx: Context) -> dict[str, Any]:
    variants = [("bare", False), ("ours", False), ("ours replay", True)]
    variants += [(peer, False) for peer in ctx.usable_peers()]
    return {"variants": {name: measure_variant(ctx, name, replay) for name, replay in variants}}


def growth_mib(entry: dict[str, Any]) -> float:
    return float(entry["peak"] - entry["idle"]) / MiB


def targets(result: dict[str, Any]) -> list[Target]:
    """Issue 5 sets no number for memory: the row reports, it does not judge."""
    v = result["variants"]
    parts = [f"{name} {v[name]['peak'] / MiB:.0f} (+{growth_mib(v[name]):.0f})" for name in v]
    return [
        Target(
            f"6. peak RSS, MiB (growth over idle), {CONCURRENT} concurrent 1 MiB responses",
            "none set (reported)",
            ", ".join(parts),
            None,
        )
    ]


def render(result: dict[str, Any], ctx: Context) -> str:
    v = result["variants"]
    bare = growth_mib(v["bare"])
    rows = []
    for name, entry in v.items():
        growth = growth_mib(entry)
        rows.append(
            [
                name,
                f"{entry['idle'] / MiB:.0f}",
                f"{entry['peak'] / MiB:.0f}",
                f"{growth:.0f}",
                f"{growth - bare:+.0f}",
                f"{(growth - bare) / CONCURRENT:+.2f}",
                ", ".join(f"{n}x{s}" for s, n in sorted(entry["statuses"].items())),
            ]
        )
    return "\n\n".join(
        [
            "# Memory: peak RSS with 64 concurrent 1 MiB responses",
            f"One uvicorn process per variant; {BURSTS} bursts of {CONCURRENT} simultaneous `POST /big` requests, "
            "each answered with a freshly built 1 MiB body (so 64 MiB of response bodies are in flight per burst); "
            'RSS sampled every 2 ms. "ours" uses new keys (each response is captured and written to PostgreSQL); '
            '"ours replay" repeats 64 primed keys (each 1 MiB body is read back from PostgreSQL). '
            "Growth = peak - idle. The bare app barely grows: it builds each body, hands it to the socket (on "
            "loopback the kernel takes it at once) and drops it in the same turn of the event loop, so hardly any "
            "are held at the same time. A middleware that keeps the body (to store it, or read back from the "
            "database) holds it across awaits, so its growth over bare, per concurrent request, is what each "
            "in-flight 1 MiB response costs it.",
            target_table(targets(result)),
            table(
                [
                    "variant",
                    "idle MiB",
                    "peak MiB",
                    "growth MiB",
                    "growth over bare, MiB",
                    "per request, MiB",
                    "answers",
                ],
                rows,
            ),
        ]
    )
