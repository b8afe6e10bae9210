"""Serve an ASGI app with uvicorn (or Hypercorn, or Granian) on loopback, wait until it answers, and stop it again:
for tests, the fault scenarios and the payments demo.

Two ways, one for each need:

- :func:`serve` runs the app in this process, as a task on the running event loop (cheap; for tests that only
  need a real socket in front of the app);
- :class:`ServerProcess` runs it in a child process that can be killed mid-request (``kill()``) and started again
  on the same port (``start()``): for crash tests, and for the demo, whose client, proxy and server then use both
  cores.

Either way this process binds the listening socket first, so the port is known before the server runs and there
is no window in which another program could take it. A child process inherits the socket, and while it is down
(killed, restarting) connections wait in the socket's backlog instead of being refused.

``ServerProcess(..., server="hypercorn")`` or ``server="granian"`` runs the same app under that server instead,
through the server's own command line, as a user would (``tests/scenarios/test_servers.py``). Hypercorn serves the
inherited socket (``--bind fd://N``). Granian binds its port itself (each of its workers opens its own listener), so for
Granian the port is one that was free when the ``ServerProcess`` was made, and connections made while it is down
are refused rather than kept waiting. Both run their app in a worker process of their own: the child is the
leader of a new process group, and ``kill()`` kills the whole group.

``python -m faults.server module:app --fd N`` is the child's side. The child finds its app by module name with the
repository on its ``PYTHONPATH`` (this harness, ``examples`` and ``tests`` are not installed packages).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import IO

import uvicorn
from starlette.types import ASGIApp

LOOPBACK = "127.0.0.1"
REPOSITORY = str(Path(__file__).resolve().parent.parent)
SERVERS = ("uvicorn", "hypercorn", "granian")
"""The servers :class:`ServerProcess` runs an app under; uvicorn serves in the child itself, the others in a worker
process the child starts."""


CLIENT_KEEP_ALIVE = 15.0
"""Seconds the scenarios' clients keep an idle connection for reuse: half the servers' (``SERVER_KEEP_ALIVE``), and
long enough that a storm's busy connections do not expire while it runs. httpcore (1.0.9) hands an idle connection to a
request, and the request's task clears the connection's expiry only when it runs: a pass of the pool for another
request in between finds it expired and closes it under the first, whose request ends in a ReadError
(``ClosedResourceError``: closed on this side) with no answer and no word in the server's log. On a starved
machine that gap is long; at 2 s the storm through PgBouncer met it about one run in three with four busy loops
beside it, and in none of eight at 15 s."""

SERVER_KEEP_ALIVE = 30
"""Seconds uvicorn keeps an idle connection here (its default is 5): well over the clients' keep-alive, whose clock
starts later (when the client reads the response), so that a client never reuses a connection the server is
closing in the same instant. Idle connections still close at once when a server stops."""


class ServerStartFailed(RuntimeError):
    """The child server exited or did not answer during startup; the message ends with its log."""


def listen(host: str = LOOPBACK, port: int = 0) -> socket.socket:
    """A listening TCP socket (port 0: any free port), inheritable by child processes."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def free_port(host: str = LOOPBACK) -> int:
    """A port nothing listens on right now (for a server that binds its own socket)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


def _config(app: ASGIApp | str, log_level: str, factory: bool = False) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        factory=factory,
        log_level=log_level,
        access_log=False,
        lifespan="on",
        timeout_keep_alive=SERVER_KEEP_ALIVE,
    )


@contextlib.asynccontextmanager
async def serve(
    app: ASGIApp, *, host: str = LOOPBACK, port: int = 0, log_level: str = "warning", patience: float = 30.0
) -> AsyncIterator[str]:
    """Serve ``app`` from this event loop and yield its base URL once its startup (lifespan) has finished."""
    sock = listen(host, port)
    server = uvicorn.Server(_config(app, log_level))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        deadline = time.monotonic() + patience
        while not server.started:
            if task.done():
                task.result()  # re-raise what stopped it, if anything did
                raise RuntimeError("the server stopped during startup (see its log above)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not start within {patience}s")
            await asyncio.sleep(0.01)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(task), patience)
        except TimeoutError:
            server.force_exit = True
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        except Exception:  # it failed to start: already reported above
            pass
        sock.close()


class ServerProcess:
    """An ASGI app (``"package.module:attribute"``) served by uvicorn (or ``server=``) in a child process.

    ``async with ServerProcess("examples.payments.app:app", env={"DATABASE_URL": dsn}) as server:``
    starts it and waits until it answers HTTP; ``server.base_url`` is where. ``kill()`` is a crash (SIGKILL, no
    cleanup); ``stop()`` a graceful shutdown; ``start()`` again brings it back on the same port. The child's
    output goes to a log file, whose end ``log_tail()`` returns (errors quote it). ``library``: a directory holding
    another copy of ``idempotency_mw`` (a previous release's) for the child to run instead of the working tree's.
    """

    def __init__(
        self,
        app: str,
        *,
        env: Mapping[str, str] | None = None,
        factory: bool = False,
        host: str = LOOPBACK,
        port: int = 0,
        log_level: str = "warning",
        ready_timeout: float = 60.0,
        server: str = "uvicorn",
        library: str | os.PathLike[str] | None = None,
    ) -> None:
        if server not in SERVERS:
            raise ValueError(f"unknown server {server!r}: one of {', '.join(SERVERS)}")
        self.app = app
        self.env = _with_repository_on_path({**os.environ, **(env or {})}, first=library)
        # python -m puts its working directory first on sys.path: the repository's, if the child started there
        self.cwd = os.fspath(library) if library is not None else None
        self.factory = factory
        self.log_level = log_level
        self.ready_timeout = ready_timeout
        self.server = server
        self.host = host
        # Granian opens its own listeners; the others serve a socket bound here, which outlives their restarts.
        self.socket: socket.socket | None = None if server == "granian" else listen(host, port)
        self.port: int = self.socket.getsockname()[1] if self.socket is not None else port or free_port(host)
        self.process: asyncio.subprocess.Process | None = None
        self._log: IO[bytes] = tempfile.NamedTemporaryFile(prefix="imw-server-", suffix=".log")  # noqa: SIM115

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def start(self) -> None:
        """Start the child and return once it answers an HTTP request."""
        if self.running:
            raise RuntimeError("the server is already running")
        command = [
            sys.executable,
            "-m",
            "faults.server",
            self.app,
            "--server",
            self.server,
            "--log-level",
            self.log_level,
            "--parent",
            str(os.getpid()),
        ]
        inherited: tuple[int, ...] = ()
        if self.socket is not None:
            inherited = (self.socket.fileno(),)
            command += ["--fd", str(self.socket.fileno())]
        else:
            command += ["--host", self.host, "--port", str(self.port)]
        if self.factory:
            command.append("--factory")
        self.process = await asyncio.create_subprocess_exec(
            *command,
            env=self.env,
            cwd=self.cwd,
            pass_fds=inherited,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=self._log,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=self._has_workers,  # its worker processes die with it (kill() kills the group)
        )
        try:
            await self._wait_until_ready()
        except BaseException:
            await self.stop()
            raise

    async def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if not self.running:
                raise ServerStartFailed(f"the server exited during startup:\n{self.log_tail()}")
            if await answers_http(self.host, self.port, patience=0.5):
                return
        raise ServerStartFailed(f"the server did not answer within {self.ready_timeout}s:\n{self.log_tail()}")

    @property
    def _has_workers(self) -> bool:
        return self.server != "uvicorn"

    def kill(self) -> None:
        """SIGKILL: the process dies mid-whatever, as in a crash. Connections wait in the backlog meanwhile (except
        under Granian, see the module's docstring)."""
        if self.running:
            assert self.process is not None
            self._kill(self.process)

    def _kill(self, process: asyncio.subprocess.Process) -> None:
        if self._has_workers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # the group this child leads: it and its workers
        else:
            process.kill()

    async def stop(self, grace: float = 10.0) -> None:
        """SIGTERM (the server's graceful shutdown), then SIGKILL after ``grace`` seconds."""
        if self.process is None:
            return
        if self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), grace)
            except TimeoutError:
                self._kill(self.process)
        await self.process.wait()
        if self._has_workers:  # a worker that outlived its server (it exited on its own, or was killed alone)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)

    def note_log(self, error: BaseException, name: str = "server") -> None:
        """Add the end of this server's log to ``error`` (a request to it that got no answer: did the server say
        why?)."""
        error.add_note(f"the {name}'s log ends with:\n{self.log_tail() or '(nothing)'}")

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        with open(self._log.name, "rb") as log:
            return b"\n".join(log.read().splitlines()[-lines:]).decode(errors="replace")

    async def close(self) -> None:
        """Stop the child and give the port back."""
        try:
            await self.stop()
        finally:
            if self.socket is not None:
                self.socket.close()
            self._log.close()

    async def __aenter__(self) -> ServerProcess:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await self.close()


def _with_repository_on_path(env: dict[str, str], *, first: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """``env`` with the repository on ``PYTHONPATH``, after ``first``: a directory holding another copy of
    ``idempotency_mw`` (a previous release's), which the child then imports instead of the working tree's."""
    path = env.get("PYTHONPATH")
    front = [os.fspath(first)] if first is not None else []
    return {**env, "PYTHONPATH": os.pathsep.join([*front, REPOSITORY, *([path] if path else [])])}


async def answers_http(host: str, port: int, *, patience: float) -> bool:
    """Whether something at ``host:port`` answers an HTTP request (any status) within ``patience`` seconds."""
    writer: asyncio.StreamWriter | None = None
    try:
        reader, opened = await asyncio.wait_for(asyncio.open_connection(host, port), patience)
        writer = opened
        opened.write(b"GET / HTTP/1.1\r\nHost: ready\r\nConnection: close\r\n\r\n")
        line = await asyncio.wait_for(reader.readline(), patience)
        return line.startswith(b"HTTP/")
    except (OSError, TimeoutError):
        await asyncio.sleep(min(patience, 0.05))
        return False
    finally:
        if writer is not None:
            writer.close()


# -- the child's side --------------------------------------------------------------------------------------------


def _exit_with_parent(parent: int) -> None:
    """Stop (SIGTERM to ourselves) when the parent that started us is gone, so no server outlives its owner."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _run_uvicorn(args: argparse.Namespace) -> int:
    sock = socket.socket(fileno=args.fd)
    server = uvicorn.Server(_config(args.app, args.log_level, args.factory))
    server.run(sockets=[sock])
    return 0 if server.started else 1


def _run_hypercorn(args: argparse.Namespace) -> int:
    """Hypercorn's command line with its defaults (one worker process, lifespan on), on the inherited socket."""
    from hypercorn.__main__ import main as hypercorn

    target = f"{args.app}()" if args.factory else args.app  # Hypercorn calls a factory written as a call
    return hypercorn([target, "--bind", f"fd://{args.fd}", "--log-level", args.log_level])


def _run_granian(args: argparse.Namespace) -> int:
    """Granian's command line: ASGI with lifespan, one worker, asyncio's event loop (as uvicorn here)."""
    from granian.cli import cli as granian

    command = [args.app, "--interface", "asgi", "--host", args.host, "--port", str(args.port)]
    command += ["--loop", "asyncio", "--log-level", args.log_level]
    if args.factory:
        command.append("--factory")
    granian.main(command, prog_name="granian")  # exits with Granian's status
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve an ASGI app on loopback, under the server asked for.")
    parser.add_argument("app", help="module:attribute of the ASGI app")
    parser.add_argument("--server", choices=SERVERS, default="uvicorn")
    parser.add_argument("--fd", type=int, help="file descriptor of the listening socket (uvicorn, hypercorn)")
    parser.add_argument("--host", default=LOOPBACK, help="where to listen (granian, which binds its own)")
    parser.add_argument("--port", type=int, help="the port to listen on (granian)")
    parser.add_argument("--factory", action="store_true", help="the attribute is a factory returning the app")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--parent", type=int, help="exit when this process is no longer our parent")
    args = parser.parse_args(argv)
    if args.server == "granian" and args.port is None:
        parser.error("granian binds its own socket: give --port")
    if args.server != "granian" and args.fd is None:
        parser.error(f"{args.server} serves an inherited socket: give --fd")
    if args.parent:
        _exit_with_parent(args.parent)
    runners = {"uvicorn": _run_uvicorn, "hypercorn": _run_hypercorn, "granian": _run_granian}
    return runners[args.server](args)


if __name__ == "__main__":
    raise SystemExit(main())
