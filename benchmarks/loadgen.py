"""The load generator: ``wrk`` (a C HTTP benchmarking tool, Debian package ``wrk``) with ``wrk/idempotency.lua``.

wrk is closed-loop: ``connections`` keep-alive connections, each sending its next request as soon as the previous
answer arrived, for ``seconds``. On a 2-core machine a C client leaves most of the CPU to the server and the
database, which a Python load generator would not. The Lua script sets a new ``Idempotency-Key`` per request
(``fresh``), cycles through primed keys (``replay``) or picks primed keys at random (``sample``), counts status
codes and replay markers, and prints one JSON line that :func:`run` parses.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

SCRIPT = Path(__file__).resolve().parent / "wrk" / "idempotency.lua"
BODY = b'{"amount": 1250, "currency": "eur", "customer": "cus_42"}'
HEADERS = {"content-type": "application/json", "authorization": "Bearer bench-token"}


@dataclass
class Load:
    requests: int
    seconds: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    statuses: dict[str, int]
    replayed: int
    errors: dict[str, int] = field(default_factory=dict)
    odd: list[dict[str, Any]] = field(default_factory=list)  # the first unexpected answers (see the Lua script)

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "rps": self.rps}


def ensure_wrk() -> str:
    """The wrk binary; installed from Debian (as root) when missing, since nothing else here can generate the load."""
    found = shutil.which("wrk")
    if found:
        return found
    try:
        subprocess.run(["apt-get", "install", "-y", "-q", "wrk"], check=True, capture_output=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as error:
        raise SystemExit(f"wrk is needed for the load (apt-get install wrk): {error}") from error
    found = shutil.which("wrk")
    if not found:
        raise SystemExit("wrk is needed for the load (apt-get install wrk)")
    return found


def _command(
    url: str, mode: str, prefix: str, pool: int, connections: int, seconds: float, stride: int = 1
) -> list[str]:
    return [
        ensure_wrk(),
        "-t",
        "1",
        "-c",
        str(connections),
        "-d",
        f"{max(1, round(seconds))}s",
        "--timeout",
        "10s",
        "--latency",
        "-s",
        str(SCRIPT),
        f"{url}/orders",
        "--",
        mode,
        prefix,
        str(pool),
        str(stride),
    ]


def _parse(output: str) -> Load:
    for line in output.splitlines():
        if line.startswith("WRKJSON "):
            data = json.loads(line[len("WRKJSON ") :])
            return Load(
                requests=data["requests"],
                seconds=data["duration_us"] / 1e6,
                p50_ms=data["p50_us"] / 1000,
                p90_ms=data["p90_us"] / 1000,
                p99_ms=data["p99_us"] / 1000,
                max_ms=data["max_us"] / 1000,
                statuses=data["statuses"],
                replayed=data["replayed"],
                errors=data["errors"],
                odd=data.get("odd", []),
            )
    raise RuntimeError(f"wrk printed no result:\n{output[-2000:]}")


def run(
    url: str, *, mode: str, prefix: str, pool: int = 1, stride: int = 1, connections: int = 32, seconds: float = 10
) -> Load:
    """One wrk run, bounded by ``seconds`` (and killed if it overstays by a minute)."""
    command = _command(url, mode, prefix, pool, connections, seconds, stride)
    done = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr[-2000:]}")
    return _parse(done.stdout)


class Background:
    """wrk running until :meth:`stop` (SIGINT: wrk stops and prints its summary), at most ``limit`` seconds."""

    def __init__(self, url: str, *, mode: str, prefix: str, pool: int = 1, connections: int = 8, limit: float = 600):
        self.command = _command(url, mode, prefix, pool, connections, limit)
        self.limit = limit
        self.process: subprocess.Popen[str] | None = None

    def start(self) -> Background:
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return self

    def stop(self) -> Load:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            out, _ = self.process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            out, _ = self.process.communicate()
        return _parse(out)


async def prime(url: str, prefix: str, count: int, *, path: str = "/orders", concurrency: int = 16) -> dict[int, int]:
    """Send ``count`` requests with keys ``<prefix>-0 … <prefix>-(count-1)`` so a replay run finds them completed.

    Returns the count of each status code (all should be 201).
    """
    statuses: dict[int, int] = {}
    queue = iter(range(count))
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:

        async def worker() -> None:
            for i in queue:
                response = await client.post(
                    path, content=BODY, headers={**HEADERS, "idempotency-key": f"{prefix}-{i}"}
                )
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return statuses
