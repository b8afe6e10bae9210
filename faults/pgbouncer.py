"""A PgBouncer of our own in front of a PostgreSQL, listening on loopback: the pooler most deployments put there.

``with PgBouncer(upstream_dsn, pool_mode="transaction") as bouncer: bouncer.dsn`` writes a configuration file into
a temporary directory, starts ``pgbouncer`` in the foreground on a free loopback port, and waits until it accepts
connections. Clients log in without a password (``auth_type = trust``, the user listed in the auth file); PgBouncer
logs in to the server as that user, with the upstream DSN's password if it has one. The embedded PostgreSQL of the
test suite listens on a Unix socket only, which PgBouncer reaches the same way.

The binary comes from the system (Debian's ``pgbouncer`` package). :class:`PgBouncer` only looks for it: when it
is missing, :class:`PgBouncerUnavailable` names the command that installs it. Installing is a set-up step, never a
side effect of a test: ``./dev test`` installs it with apt-get when it is missing and it runs as root, and the
soak's own entry point calls :func:`install_pgbouncer`. PgBouncer refuses to run as root, so as root it runs as the
owner of the server's socket directory (the embedded server's system user) or, for a server over TCP, as
``nobody``.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.parse
from pathlib import Path
from types import TracebackType

from faults.server import free_port

LOOPBACK = "127.0.0.1"


class PgBouncerUnavailable(RuntimeError):
    """PgBouncer is not installed and could not be installed, or did not start (the message says why)."""


MISSING = (
    "pgbouncer is not installed. `./dev test` installs it when run as root (apt-get install pgbouncer); elsewhere "
    "install it yourself (Debian/Ubuntu: sudo apt-get install pgbouncer) and run again"
)


def find_pgbouncer() -> str | None:
    """The path of ``pgbouncer`` (Debian installs it in /usr/sbin, which a user's PATH may lack), or None."""
    return shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin:/usr/local/sbin")


def pgbouncer_binary() -> str:
    """The path of ``pgbouncer``; :class:`PgBouncerUnavailable`, naming the command that installs it, if missing."""
    found = find_pgbouncer()
    if found is None:
        raise PgBouncerUnavailable(MISSING)
    return found


def install_pgbouncer() -> str:
    """Install ``pgbouncer`` with apt-get if it is missing (as root), and return its path: for entry points that set
    up their own machine (the soak), never for a test fixture."""
    found = find_pgbouncer()
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise PgBouncerUnavailable(MISSING)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "pgbouncer"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:  # a fresh machine may have no package lists yet
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, text=True, timeout=600)
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    found = find_pgbouncer()
    if done.returncode != 0 or not found:
        raise PgBouncerUnavailable(f"apt-get install pgbouncer failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return found


def pgbouncer_version(binary: str) -> tuple[int, ...]:
    """``(1, 18, 0)`` from ``pgbouncer --version``."""
    output = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    match = re.search(r"PgBouncer (\d+)\.(\d+)(?:\.(\d+))?", output)
    if match is None:
        raise PgBouncerUnavailable(f"cannot read the version of {binary}: {output!r}")
    return tuple(int(part or 0) for part in match.groups())


class PgBouncer:
    """PgBouncer on a free loopback port, in front of the PostgreSQL at ``upstream_dsn``.

    ``pool_mode`` is PgBouncer's (``transaction`` is what managed poolers use); ``pool_size`` is its number of server
    connections per database and user. ``max_prepared_statements`` > 0 turns on PgBouncer's tracking of
    protocol-level prepared statements, which needs PgBouncer 1.21 or newer (refused otherwise).
    """

    def __init__(
        self,
        upstream_dsn: str,
        *,
        pool_mode: str = "transaction",
        pool_size: int = 20,
        max_client_conn: int = 1000,
        max_prepared_statements: int = 0,
    ) -> None:
        if pool_mode not in ("session", "transaction", "statement"):
            raise ValueError(f"pool_mode is session, transaction or statement, got {pool_mode!r}")
        self.binary = pgbouncer_binary()
        self.version = pgbouncer_version(self.binary)
        if max_prepared_statements and self.version < (1, 21):
            raise PgBouncerUnavailable(
                f"max_prepared_statements needs PgBouncer 1.21 or newer; this one is {'.'.join(map(str, self.version))}"
            )
        upstream = urllib.parse.urlsplit(upstream_dsn)
        query = urllib.parse.parse_qs(upstream.query)
        self.user = urllib.parse.unquote(upstream.username or "") or pwd.getpwuid(os.geteuid()).pw_name
        password = urllib.parse.unquote(upstream.password or "")
        self.database = urllib.parse.unquote(upstream.path.lstrip("/")) or self.user
        host = query.get("host", [upstream.hostname or "localhost"])[0]
        port = query.get("port", [str(upstream.port or 5432)])[0]
        self.pool_mode = pool_mode
        self._directory = Path(tempfile.mkdtemp(prefix="imw-pgbouncer-", dir="/tmp"))
        self.port = free_port()
        self.log = self._directory / "pgbouncer.log"
        settings = {
            "listen_addr": LOOPBACK,
            "listen_port": str(self.port),
            "unix_socket_dir": "",  # TCP on loopback only
            "auth_type": "trust",
            "auth_file": str(self._directory / "users.txt"),
            "pool_mode": pool_mode,
            "default_pool_size": str(pool_size),
            "max_client_conn": str(max_client_conn),
            "logfile": str(self.log),
            "log_connections": "0",
            "log_disconnections": "0",
        }
        if max_prepared_statements:
            settings["max_prepared_statements"] = str(max_prepared_statements)
        target = f"host={host} port={port} dbname={self.database}"
        # Any other database of the same server, by its own name (tests reach databases of their own through it).
        lines = ["[databases]", f"{self.database} = {target}", f"* = host={host} port={port}", "", "[pgbouncer]"]
        lines += [f"{name} = {value}" for name, value in settings.items()]
        self.config = self._directory / "pgbouncer.ini"
        self.config.write_text("\n".join(lines) + "\n")
        (self._directory / "users.txt").write_text(f'"{self.user}" "{password}"\n')
        self._run_as = _unprivileged_user(host) if os.geteuid() == 0 else None
        if self._run_as is not None:
            uid, gid = pwd.getpwnam(self._run_as).pw_uid, pwd.getpwnam(self._run_as).pw_gid
            for path in (self._directory, *self._directory.iterdir()):
                os.chown(path, uid, gid)
        self.process: subprocess.Popen[bytes] | None = None
        netloc = f"{urllib.parse.quote(self.user)}@{LOOPBACK}:{self.port}"
        self.dsn = f"postgresql://{netloc}/{urllib.parse.quote(self.database)}"

    def start(self, patience: float = 30.0) -> None:
        """Start PgBouncer and return once it accepts connections."""
        self.process = subprocess.Popen(
            [self.binary, str(self.config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            user=self._run_as,
            start_new_session=True,
        )
        deadline = time.monotonic() + patience
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise PgBouncerUnavailable(f"pgbouncer exited ({self.process.returncode}):\n{self.log_tail()}")
            try:
                socket.create_connection((LOOPBACK, self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise PgBouncerUnavailable(f"pgbouncer did not listen within {patience}s:\n{self.log_tail()}")

    def stop(self) -> None:
        """Shut it down at once (SIGTERM: PgBouncer's immediate shutdown), SIGKILL if it lingers."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def close(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self._directory, ignore_errors=True)

    def __enter__(self) -> PgBouncer:
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


def _unprivileged_user(host: str) -> str:
    """Who PgBouncer runs as when we are root: the owner of a Unix socket directory (only it may enter the embedded
    server's data directory), else ``nobody``."""
    if host.startswith("/"):
        owner = pwd.getpwuid(os.stat(host).st_uid).pw_name
        if owner != "root":
            return owner
    return "nobody"
