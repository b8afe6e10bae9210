"""Starting and stopping the servers under test: one uvicorn process per variant, on 127.0.0.1 only.

Every variant runs in the benchmark venv (``benchmarks/.work/venv``: the peers, uvloop, httptools) with this
repository on ``PYTHONPATH``, so bare, ours and the peers share one interpreter, one Starlette, one uvicorn and one
event loop implementation. ``Server`` is a context manager: the process is always terminated, then killed.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORK = HERE / ".work"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def bench_env(python_path: str = str(REPO)) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("IDEMPOTENCY_")}  # fastidempotent reads these
    env["PYTHONPATH"] = python_path
    return env


class Server:
    """``uvicorn benchapp:create_app`` (or another ``app`` factory) for one variant; ``url`` is its base URL once
    started. ``python_path`` is where it imports ``idempotency_mw`` from: the working tree, or a copy of a git
    revision (``common.library_copy``)."""

    def __init__(
        self,
        python: str,
        variant: str,
        dsn: str | None,
        *,
        log_name: str | None = None,
        app: str = "benchapp:create_app",
        python_path: Path = REPO,
    ) -> None:
        self.python = python
        self.variant = variant
        self.dsn = dsn
        self.app = app
        self.python_path = python_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = WORK / "logs" / f"{log_name or variant}.log"

    def __enter__(self) -> Server:
        env = bench_env(str(self.python_path))
        env["BENCH_VARIANT"] = self.variant
        if self.dsn:
            env["BENCH_DSN"] = self.dsn
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [
                    self.python,
                    "-m",
                    "uvicorn",
                    self.app,
                    "--factory",
                    "--app-dir",
                    str(HERE),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--loop",
                    "uvloop",
                    "--http",
                    "httptools",
                    "--no-access-log",
                    "--log-level",
                    "warning",
                ],
                cwd=str(HERE),  # no .env here: fastidempotent would read one from the working directory
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            self._wait_ready(timeout=30.0)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object | TracebackType) -> None:
        self.stop()

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.variant} server exited: {self.log_path.read_text()[-2000:]}")
            try:
                connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                connection.request("GET", "/")
                connection.getresponse().read()
                connection.close()
                return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"{self.variant} server did not answer within {timeout} s")

    def library(self) -> str:
        """The directory this server imported ``idempotency_mw`` from (``GET /_library``)."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            connection.request("GET", "/_library")
            return str(json.loads(connection.getresponse().read())["path"])
        finally:
            connection.close()

    def collector(self) -> dict[str, Any]:
        """The server's cycle collector so far: ``{"seconds": …, "collections": [gen0, gen1, gen2]}``."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            connection.request("GET", "/_gc")
            return dict(json.loads(connection.getresponse().read()))
        finally:
            connection.close()

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def rss(self) -> int:
        return int(psutil.Process(self.pid).memory_info().rss)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)  # uvicorn shuts down gracefully: lifespan closes the pools
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)


class CpuMeter:
    """CPU seconds (user + system) used so far by the processes of one run, read before and after a load run.

    ``app``: the server process (or nothing); ``postgres``: the postmaster and every process under it, those that
    have exited included (their time is added to the postmaster's children times when it reaps them), so a backend
    that ends mid-run is counted once; ``client``: this process's finished children (wrk, floor.py).
    """

    def __init__(self, app_pid: int | None, postmaster_pid: int | None) -> None:
        self.app = psutil.Process(app_pid) if app_pid else None
        self.postmaster = psutil.Process(postmaster_pid) if postmaster_pid else None

    @staticmethod
    def _own(process: psutil.Process) -> float:
        times = process.cpu_times()
        return float(times.user + times.system)

    def read(self) -> dict[str, float | None]:
        postgres: float | None = None
        switches: float | None = None
        if self.postmaster is not None:
            times = self.postmaster.cpu_times()
            total = float(times.user + times.system + times.children_user + times.children_system)
            switches = 0.0
            for child in self.postmaster.children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):  # ended just now: in the children times soon
                    total += self._own(child)
                    switches += sum(child.num_ctx_switches())
            postgres = total
        own = os.times()
        return {
            "app": self._own(self.app) if self.app else None,
            "postgres": postgres,
            "client": own.children_user + own.children_system,
            # Context switches of the PostgreSQL processes alive at the reading (voluntary + involuntary): a count
            # per request, not µs (those that ended in between are not in it).
            "postgres_switches": switches,
        }

    @staticmethod
    def per_request(
        before: dict[str, float | None], after: dict[str, float | None], requests: int
    ) -> dict[str, float | None]:
        """Microseconds of CPU per request for each part (context switches: a count), between two readings."""
        out: dict[str, float | None] = {}
        for part, start in before.items():
            end = after[part]
            scale = 1.0 if part.endswith("_switches") else 1e6
            out[part] = None if start is None or end is None or not requests else (end - start) / requests * scale
        return out


class PeakRss:
    """Samples a process's resident set size every few milliseconds in a thread; ``peak`` is the largest seen."""

    def __init__(self, pid: int, interval: float = 0.002) -> None:
        self.process = psutil.Process(pid)
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(self.interval)

    def __enter__(self) -> PeakRss:
        self.peak = self.process.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
