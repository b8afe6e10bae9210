"""Pieces of a request's path timed alone, on whichever ``idempotency_mw`` comes first on the path.

    PYTHONPATH=<a library copy> python benchmarks/fixpieces.py -n 20000    # prints JSON: µs per call, and the library

``fixes.py`` runs it on the working tree and on a copy of the library before a round's fixes (``common.library_copy``),
one process per round and library, alternating, so each piece is compared with the code it replaced as that code was.
It uses only what both libraries have under the same names: ``canonical_body``, ``canonical_query``,
``ResponseRecorder`` and ``LeaseKeeper``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import idempotency_mw
from idempotency_mw import MemoryStore
from idempotency_mw.capture import ResponseRecorder
from idempotency_mw.fingerprint import canonical_body, canonical_query
from idempotency_mw.leases import LeaseKeeper

FORM = b"application/x-www-form-urlencoded"
FORM_ASCII = b"amount=1250&currency=eur&customer=cus_42&description=Order+42+for+a+customer"
FORM_ESCAPED = b"amount=1250&currency=eur&name=%C3%89ric+M%C3%BCller&city=K%C3%B6ln&note=caf%C3%A9"
QUERY_ESCAPED = b"q=%C3%A9t%C3%A9+%C3%A0+Paris&page=2&sort=-created"
START = {
    "type": "http.response.start",
    "status": 201,
    "headers": [(b"content-type", b"application/json"), (b"content-length", b"20")],
}
BODY = {"type": "http.response.body", "body": b'{"status":"accepted"}'}
PIECES = (
    "fingerprint: a small form body, ASCII",
    "fingerprint: a small form body, UTF-8 escapes",
    "fingerprint: a query string, UTF-8 escapes",
    "recorder: the response start (headers in a list) and its final body",
    "lease keeper: hold + drop",
)


async def _send(message: Any) -> None:
    return None


def _record() -> None:
    recorder = ResponseRecorder(_send, max_body=1 << 20)
    recorder.record(START)
    recorder.record(BODY)


async def measure(n: int) -> dict[str, Any]:
    """µs per call of each piece (CPU time of this process, the cycle collector paused while a piece runs)."""
    keeper = LeaseKeeper(MemoryStore())

    def lease() -> None:
        keeper.drop(keeper.hold("t", "k", 1, 30.0))

    calls: dict[str, Callable[[], object]] = {
        PIECES[0]: lambda: canonical_body(FORM, FORM_ASCII),
        PIECES[1]: lambda: canonical_body(FORM, FORM_ESCAPED),
        PIECES[2]: lambda: canonical_query(QUERY_ESCAPED),
        PIECES[3]: _record,
        PIECES[4]: lease,
    }
    out: dict[str, float] = {}
    for name, call in calls.items():
        for _ in range(n // 10):  # warm-up
            call()
        gc.disable()
        try:
            started = time.process_time()
            for _ in range(n):
                call()
            out[name] = (time.process_time() - started) / n * 1e6
        finally:
            gc.enable()
    return {"library": str(Path(idempotency_mw.__file__).parent), "us": out}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=20000, help="calls of each piece")
    args = parser.parse_args()
    try:
        from uvloop import run as run_loop
    except ImportError:
        run_loop = asyncio.run  # type: ignore[assignment]
    json.dump(run_loop(measure(args.n)), sys.stdout)
