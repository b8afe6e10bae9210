"""PostgreSQL URLs as a deploy spells them: one ``DATABASE_URL`` often serves a SQLAlchemy engine too.

SQLAlchemy names the driver in the scheme (``postgresql+asyncpg://``, ``postgresql+psycopg://``,
``postgres+psycopg2://``); asyncpg takes only ``postgresql://`` and ``postgres://``. The rest of the URL means the
same to both, so the driver is dropped, and a URL of another database is refused here with a message that says
what to give, rather than by asyncpg at the first connection.
"""

from __future__ import annotations

import re

_SCHEME = re.compile(r"(?P<base>postgres(?:ql)?)(?:\+[a-z0-9_]+)?", re.IGNORECASE)
EXPECTED = "postgresql://user:password@host:port/database, or SQLAlchemy's spelling such as postgresql+asyncpg://…"


def postgres_url(url: str) -> str:
    """``url`` as asyncpg takes it: ``postgresql+<driver>://…`` and ``postgres+<driver>://…`` become
    ``postgresql://…`` and ``postgres://…``. Any other scheme is a ``ValueError`` that names the scheme, never the
    rest of the URL (it may hold a password)."""
    scheme, separator, rest = url.partition("://")
    match = _SCHEME.fullmatch(scheme) if separator else None
    if match is None:
        got = f"scheme {scheme!r}" if separator else "no scheme"
        raise ValueError(f"not a PostgreSQL URL ({got}): expected {EXPECTED}")
    return f"{match['base'].lower()}://{rest}"
