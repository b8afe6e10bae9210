"""Where a :class:`~idempotency_mw.postgres.PostgresStore`'s connections come from, and what it asks of them: the
connector interface (procrastinate's ``connector.py`` is the model), and what every connector shares.

A connector is chosen once, when the store is built: a pool of the store's own (``_pool.py``), the app's asyncpg
pool (``_apppool.py``), or the app's SQLAlchemy engine for the transactions lent to handlers
(``idempotency_mw.sqlalchemy``). Each keeps the same promises, so the store above never asks which one it has:

- the store's statements run under READ COMMITTED whatever the database's default isolation level
  (``sql/session.sql``), and a statement's deadline is the store's ``timeout``;
- claims and lent transactions take all but one of the pool's connections: the last one stays for the work that
  finishes requests (renewals, completions, releases), which a burst of new requests or handlers holding every
  connection must not keep waiting until a lease lapses;
- a connection lent to a handler comes back as the pool gave it (``_lending.py``).

Also here: PostgreSQL URLs as a deploy spells them (one ``DATABASE_URL`` often serves a SQLAlchemy engine too).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import parse_qs, urlsplit

import asyncpg

from idempotency_mw.postgres._sql import session
from idempotency_mw.store import Transaction

if TYPE_CHECKING:
    from idempotency_mw.postgres._records import Records

# asyncpg's names of the isolation levels, by PostgreSQL's.
ASYNCPG_ISOLATION = {
    "read committed": "read_committed",
    "repeatable read": "repeatable_read",
    "serializable": "serializable",
    "read uncommitted": "read_uncommitted",
}

Listener = Callable[[Any, int, str, object], None]  # asyncpg's: (connection, pid, channel, payload)


class Connector(Protocol):
    """What a PostgresStore asks of where its connections come from."""

    @property
    def timeout(self) -> float:
        """Seconds any one call may take, waiting for a connection included."""

    @property
    def database_isolation(self) -> str | None:
        """The default isolation level of the database's sessions, once a connection has told it."""

    async def open(self) -> None:
        """Connect ahead, where the pool is the store's own (and check what else needs checking at startup)."""

    async def close(self) -> None:
        """Close what the store opened itself (an app's pool is the app's to close)."""

    async def run(self, name: str, args: tuple[Any, ...], *, urgent: bool = False, status: bool = False) -> Any:
        """One of the store's statements on a connection of its own: its first row, or with ``status`` its status
        ("UPDATE 1"). ``urgent``: it finishes a request, and goes before new claims for a connection."""

    def transaction(self, records: Records) -> contextlib.AbstractAsyncContextManager[Transaction]:
        """A connection lent to one transactional request (the key is claimed on it, then the handler's
        transaction begins on it), given back with the session its pool gave it when the block ends;
        :class:`~idempotency_mw.store.PoolExhausted` when none comes free in time."""

    def connection(self) -> contextlib.AbstractAsyncContextManager[asyncpg.Connection]:
        """A connection for code other than the store's, as its pool gave it, refused once the block has ended."""

    def session(self) -> contextlib.AbstractAsyncContextManager[asyncpg.Connection]:
        """A connection for the store's own multi-statement work (migrations); closed after an error."""

    def listening(
        self, channel: str, notified: Listener
    ) -> contextlib.AbstractAsyncContextManager[asyncpg.Connection | None]:
        """A connection of its own (never one a request could need) that LISTENs on ``channel`` (``notified`` gets
        each notification) for as long as the block lasts; None where no session can listen (a proxy)."""


async def default_isolation(connection: asyncpg.Connection, deadline: float) -> str:
    """The default isolation level of a session the store does not set up (an app's pool, a proxy's), asked within
    ``deadline`` seconds."""
    level: str = await connection.fetchval(session()["default_isolation"], timeout=deadline)
    return level


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


def address_of(url: str) -> str:
    """Where a connection to ``url`` goes, for error messages: ``host:port``, or a Unix socket's path; never the
    user or the password. What the URL leaves out is what libpq (and asyncpg) default to: ``PGHOST`` and ``PGPORT``,
    else the local sockets and then localhost, on 5432."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    try:
        port = str(parts.port or query.get("port", [""])[0] or os.environ.get("PGPORT") or 5432)
    except ValueError:  # not a number: asyncpg says so itself
        port = "5432"
    host = parts.hostname or query.get("host", [""])[0] or os.environ.get("PGHOST", "")
    if not host:
        return f"the default local socket or localhost:{port}"
    if host.startswith("/"):
        return f"{host.rstrip('/')}/.s.PGSQL.{port}"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def naming_address(error: OSError, url: str) -> OSError:
    """``error`` (of the same class, so callers catch it as before), with the address it failed to reach when its
    message does not name one: a missing Unix socket says only "No such file or directory"."""
    where = address_of(url)
    message = error.strerror or str(error)
    host = where.rsplit(":", 1)[0].strip("[]")  # "[::1]:5432" -> "::1"; a socket's path has no port to cut
    if isinstance(error, TimeoutError) or host in message:
        return error
    named = type(error)(error.errno, f"{message} (connecting to {where})")
    named.__cause__ = error
    return named
