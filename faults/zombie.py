"""Zombie worker: a handler frozen past its lease (a long GC pause) wakes after another worker took its key over.

Worker A receives the request and enters the handler, which writes its effect and then works for a moment. A is
frozen with SIGSTOP (its whole process: the handler and its lease heartbeat alike) until the lease has lapsed in
the database. The client, having heard nothing, retries on worker B, which takes the claim over with a newer
fence, runs the handler and answers. Then A is thawed with SIGCONT and finishes its handler.

Transactional mode: A's completion names a stale fence, so it is refused, A's transaction (its effect included)
rolls back, and A answers 409. Exactly one effect: B's. Plain mode: the fence still keeps A from overwriting B's
record, but A's effect was committed before the pause and stays: two effects (reported, not hidden).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import asyncpg
import httpx

from faults.report import Result
from faults.workers import effects_per_key, ledger_worker, violations
from idempotency_mw.client import AsyncIdempotentClient, Retry


@dataclass
class ZombieFindings:
    zombie_status: int  # what A finally answered
    zombie_body: bytes
    retry_status: int  # what the retry through B got
    retry_replayed: bool
    effects: int  # effects of the key, all told
    effect_pids: list[int]  # which workers' effects survived
    worker_pids: tuple[int, int]  # (A, B)
    record_body: bytes | None  # the response the completed record holds
    retry_body: bytes
    violations: list[str]
    paused_for: float


async def run_zombie(
    dsn: str, *, transactional: bool, lease: float = 1.0, work: float = 0.5
) -> tuple[Result, ZombieFindings]:
    key = f"zombie-{uuid.uuid4().hex[:12]}"
    zombie_worker = ledger_worker(dsn, transactional=transactional, lease=lease)
    other_worker = ledger_worker(dsn, transactional=transactional, lease=lease)
    connection = await asyncpg.connect(dsn)
    try:
        async with contextlib.AsyncExitStack() as stack:
            zombie = await stack.enter_async_context(zombie_worker)
            other = await stack.enter_async_context(other_worker)
            assert zombie.process is not None
            assert other.process is not None
            pids = (zombie.process.pid, other.process.pid)
            http = await stack.enter_async_context(httpx.AsyncClient(base_url=zombie.base_url, timeout=60))
            first = asyncio.create_task(
                http.post(f"/effects?delay={work}", json={"key": key}, headers={"Idempotency-Key": key})
            )
            await _until(lambda: connection.fetchval("SELECT count(*) FROM faults_entries WHERE key = $1", key))
            os.kill(pids[0], signal.SIGSTOP)
            paused = time.monotonic()
            try:
                await _until(
                    lambda: connection.fetchval(
                        "SELECT lease_expires_at < now() FROM idempotency_records WHERE key = $1", key
                    )
                )
                retry = Retry(attempts=20, deadline=30, backoff=0.05, max_backoff=0.5)
                async with AsyncIdempotentClient(other.base_url, retry=retry) as client:
                    again = await client.post(f"/effects?delay={work}", json={"key": key}, idempotency_key=key)
            finally:
                os.kill(pids[0], signal.SIGCONT)
            paused_for = time.monotonic() - paused
            answer = await asyncio.wait_for(first, 60)
            # Plain mode settles the record after the answer has gone out: wait for the new owner's completion.
            await _until(
                lambda: connection.fetchval("SELECT EXISTS (SELECT FROM idempotency_responses WHERE key = $1)", key),
                patience=10.0,
            )
            record = await connection.fetchrow("SELECT body FROM idempotency_responses WHERE key = $1", key)
            assert record is not None
            survivors = await connection.fetch("SELECT pid FROM faults_effects WHERE key = $1 ORDER BY id", key)
    finally:
        await connection.close()
    counts = await effects_per_key(dsn, [key])
    findings = ZombieFindings(
        zombie_status=answer.status_code,
        zombie_body=answer.content,
        retry_status=again.status_code,
        retry_replayed=again.replayed,
        effects=counts.get(key, 0),
        effect_pids=[row["pid"] for row in survivors],
        worker_pids=pids,
        record_body=None if record["body"] is None else bytes(record["body"]),
        retry_body=again.content,
        violations=await violations(dsn, [key]),
        paused_for=paused_for,
    )
    mode = "transactional" if transactional else "plain"
    result = Result(
        f"zombie worker, {mode}",
        operations=1,
        faults=f"SIGSTOP {paused_for:.1f} s past a {lease:g} s lease, takeover by a second worker, SIGCONT",
        duplicates=max(findings.effects - 1, 0),
        lost=0 if findings.effects else 1,
        notes=[
            f"the zombie answered {findings.zombie_status} after waking; the record kept "
            + ("the new owner's response" if findings.record_body == findings.retry_body else "the zombie's response")
        ],
        measures={"pauses": 1},
    )
    return result, findings


async def _until(probe: Callable[[], Awaitable[Any]], patience: float = 30.0) -> None:
    """Poll an async predicate until it is truthy, for at most ``patience`` seconds."""
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        if await probe():
            return
        await asyncio.sleep(0.02)
    raise TimeoutError(f"condition not met within {patience}s")
