"""Measurement 2: the middleware's own cost, in process: no sockets, no database, ``MemoryStore``.

Each request is a call of the ASGI app with a freshly built scope and constant ``receive``/``send`` callables, so
what is timed is Starlette's own stack (error middleware, router, a JSON endpoint) plus, in the covered variants,
the middleware. The variants run interleaved, round after round; a variant's cost is the median over rounds of
(its time per request minus the bare app's time per request in the same round). Prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from benchapp import TENANT_SECRET, Collector, routes
from common import Target, served_record, table, target_table
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message

from idempotency_mw import AuthorizationTenant, IdempotencyMiddleware, MemoryStore

BODY = b'{"amount": 1250, "currency": "eur", "customer": "cus_42"}'
BASE_HEADERS = [
    (b"host", b"bench"),
    (b"content-type", b"application/json"),
    (b"content-length", str(len(BODY)).encode()),
    (b"authorization", b"Bearer bench-token"),
]
SCOPE = {
    "type": "http",
    "asgi": {"version": "3.0", "spec_version": "2.4"},
    "http_version": "1.1",
    "method": "POST",
    "scheme": "http",
    "path": "/orders",
    "raw_path": b"/orders",
    "query_string": b"",
    "root_path": "",
    "client": ("127.0.0.1", 50000),
    "server": ("127.0.0.1", 8000),
}
REQUEST: Message = {"type": "http.request", "body": BODY, "more_body": False}
TENANT = AuthorizationTenant(TENANT_SECRET)  # the default resolver, with the benchmarks' fixed secret

# What each variant sends and what it must answer (checked once per round, outside the timing).
VARIANTS = {
    "bare": "the app without middleware (keyed requests, ignored)",
    "keyless": "with the middleware, a POST without Idempotency-Key (passes through)",
    "fresh": "with the middleware, a new key per request (claim, run, record)",
    "replay": "with the middleware, a completed key (claim, replay; the endpoint does not run)",
    "conflict": "with the middleware, a key still in progress (claim, 409)",
}


class Sink:
    """The ``send`` callable: keeps the last status and whether it was a replay."""

    def __init__(self) -> None:
        self.status = 0
        self.replayed = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.replayed = (b"idempotent-replayed", b"true") in message["headers"]


async def receive() -> Message:
    return REQUEST


def bare_app() -> Starlette:
    return Starlette(routes=routes())


def covered_app(store: MemoryStore) -> Starlette:
    return Starlette(routes=routes(), middleware=[Middleware(IdempotencyMiddleware, store=store, tenant=TENANT)])


async def timed(app: ASGIApp, keys: list[bytes | None], sink: Sink) -> tuple[float, float]:
    """Seconds per request for one pass over ``keys`` (None: no Idempotency-Key header), and of that the cycle
    collector's seconds per request."""
    headers = BASE_HEADERS
    gc.collect()
    with Collector() as collector:
        started = time.process_time()  # CPU time of this process: other processes on a shared machine do not count
        for key in keys:
            scope = {**SCOPE, "headers": headers if key is None else [*headers, (b"idempotency-key", key)]}
            await app(scope, receive, sink.send)
            # Give the loop its turn, as a server does between requests: without it, nothing here ever suspends,
            # and whatever the request scheduled (a lease renewal, a cancelled task) would pile up instead of run.
            await asyncio.sleep(0)
        elapsed = time.process_time() - started
    return elapsed / len(keys), collector.seconds / len(keys)


async def round_of(n: int, serial: int) -> dict[str, tuple[float, float, int, bool]]:
    """One pass of every variant, ``n`` requests each: {variant: (seconds per request, of which the collector's,
    last status, replayed)}."""
    out: dict[str, tuple[float, float, int, bool]] = {}
    fresh_keys: list[bytes | None] = [f"r{serial}-k{i}".encode() for i in range(n)]
    tenant, stored = await served_record()  # this request's tenant and fingerprint, as the middleware stores them

    runs: dict[str, Callable[[], tuple[ASGIApp, list[bytes | None]]]] = {}
    runs["bare"] = lambda: (bare_app(), fresh_keys)
    runs["keyless"] = lambda: (covered_app(MemoryStore()), [None] * n)
    runs["fresh"] = lambda: (covered_app(MemoryStore()), fresh_keys)

    replay_store = MemoryStore()
    replay_app = covered_app(replay_store)
    await replay_app({**SCOPE, "headers": [*BASE_HEADERS, (b"idempotency-key", b"done")]}, receive, Sink().send)
    runs["replay"] = lambda: (replay_app, [b"done"] * n)

    conflict_store = MemoryStore()
    await conflict_store.claim(tenant, "busy", stored, lease=3600.0, ttl=86400.0)
    runs["conflict"] = lambda: (covered_app(conflict_store), [b"busy"] * n)

    for name, make in runs.items():
        app, keys = make()
        sink = Sink()
        seconds, collecting = await timed(app, keys, sink)
        out[name] = (seconds, collecting, sink.status, sink.replayed)
    return out


EXPECTED = {"bare": (201, False), "keyless": (201, False), "fresh": (201, False), "replay": (201, True)}
EXPECTED["conflict"] = (409, False)


async def main(n: int, rounds: int) -> dict[str, Any]:
    await round_of(min(n, 2000), -1)  # warm-up: imports, first-request route scan, allocator
    per_round: list[dict[str, float]] = []
    collector: list[dict[str, float]] = []
    for serial in range(rounds):
        result = await round_of(n, serial)
        for name, (_, _, status, replayed) in result.items():
            if (status, replayed) != EXPECTED[name]:
                raise SystemExit(f"{name}: answered {status} (replayed={replayed}), expected {EXPECTED[name]}")
        per_round.append({name: seconds for name, (seconds, _, _, _) in result.items()})
        collector.append({name: collecting for name, (_, collecting, _, _) in result.items()})
    summary: dict[str, Any] = {}
    for name in VARIANTS:
        us = [r[name] * 1e6 for r in per_round]
        added = [(r[name] - r["bare"]) * 1e6 for r in per_round]
        summary[name] = {
            "description": VARIANTS[name],
            "us_per_request": statistics.median(us),
            "us_min": min(us),
            "us_max": max(us),
            "added_us": statistics.median(added),
            "added_us_min": min(added),
            "added_us_max": max(added),
            "vs_bare": statistics.median(r[name] / r["bare"] for r in per_round),
            "collector_us": statistics.median(r[name] * 1e6 for r in collector),
        }
    return {
        "requests_per_round": n,
        "rounds": rounds,
        "python": sys.version.split()[0],
        "variants": summary,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", type=int, default=5000, help="requests per variant per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    json.dump(asyncio.run(main(args.n, args.rounds)), sys.stdout)


# -- rendering (run.py) -----------------------------------------------------------------------------------------


def targets(result: dict[str, Any]) -> list[Target]:
    v = result["variants"]
    fresh, replay, bare = v["fresh"]["added_us"], v["replay"]["us_per_request"], v["bare"]["us_per_request"]
    return [
        Target("2. in-process cost a fresh request adds (MemoryStore)", "< 30 µs", f"{fresh:.1f} µs", fresh < 30),
        Target(
            "2. a replay costs less than the bare request", "cheaper", f"{replay:.1f} vs {bare:.1f} µs", replay < bare
        ),
    ]


def render(result: dict[str, Any]) -> str:
    v = result["variants"]
    rows = [
        [
            name,
            entry["description"],
            f"{entry['us_per_request']:.1f}",
            "-"
            if name == "bare"
            else f"{entry['added_us']:+.1f} ({entry['added_us_min']:+.1f} … {entry['added_us_max']:+.1f})",
            f"{entry['vs_bare']:.2f}x",
            f"{entry['collector_us']:.1f}" if "collector_us" in entry else "-",
        ]
        for name, entry in v.items()
    ]
    parts = [
        "# The middleware's own cost, in process",
        f"Python {result['python']}, no sockets, no database: `MemoryStore`, a bare Starlette app with one JSON "
        "endpoint, the ASGI app called directly with a freshly built scope and constant receive/send, one event-loop "
        f"turn between requests (as a server gives). {result['rounds']} interleaved rounds of "
        f"{result['requests_per_round']:,} requests per variant; a fresh MemoryStore per round. Cost added = median "
        "over rounds of (variant - bare in the same round); min … max over rounds in brackets. The collector's share "
        "is the time the cycle collector ran during the pass (gc.callbacks), per request, median over rounds.",
        target_table(targets(result)),
        table(
            ["variant", "what", "µs per request", "added vs bare, µs", "vs bare", "of which the collector, µs"], rows
        ),
    ]
    return "\n\n".join(parts)
