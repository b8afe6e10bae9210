"""What every measurement shares: the run's context (database, venv, mode, durations) and markdown helpers."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
from pgserver import Database
from servers import HERE, bench_env

TABLES = ("idempotency_records", "idempotency_keys", "fastapi_idempotency_requests")


@dataclass
class Context:
    db: Database
    python: str  # the benchmark venv's interpreter (peers, uvloop, httptools)
    quick: bool
    seconds: float  # one measured load run
    repetitions: int  # interleaved repetitions of the end-to-end runs
    peers: dict[str, str | None]  # peer -> None if usable, else why not
    notes: list[str] = field(default_factory=list)

    def usable_peers(self) -> list[str]:
        return [name for name, problem in self.peers.items() if problem is None]

    def script(self, name: str, *args: str, timeout: float = 900) -> Any:
        """Run ``benchmarks/<name>`` in the benchmark venv and return the JSON it prints."""
        done = subprocess.run(
            [self.python, str(HERE / name), *args],
            cwd=str(HERE),
            env=bench_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(done.stdout)


async def reset_tables(url: str) -> None:
    """Empty every idempotency table (ours and the peers') and checkpoint, so runs start alike."""
    connection = await asyncpg.connect(url)
    try:
        existing = await connection.fetch("SELECT tablename FROM pg_tables WHERE tablename = ANY($1::text[])", TABLES)
        for row in existing:
            await connection.execute(f'TRUNCATE "{row["tablename"]}"')
        await connection.execute("CHECKPOINT")
    finally:
        await connection.close()


def reset(url: str) -> None:
    asyncio.run(reset_tables(url))


def median(values: Iterable[float]) -> float:
    return float(statistics.median(list(values)))


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def machine() -> dict[str, str]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = ""
    try:
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        memory = f"{kib / 1024 / 1024:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "memory": memory,
        "os": platform.platform(),
        "python": sys.version.split()[0],
    }


def load_average() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f} (1 min), {five:.1f} (5 min)"
