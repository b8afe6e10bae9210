"""Connections lent to code other than the store's: for the loan only, and given back as they were lent.

A transactional handler writes through a connection of the store's (or of the app's pool or engine) for one request.
Two things keep one request's use of it from reaching the next user of the connection:

- :class:`LentConnection` is what the handler holds: an asyncpg connection that refuses every call once the loan
  has ended, as asyncpg's own pool refuses a connection used after its release. A task that outlived its request
  could otherwise read another tenant's uncommitted writes, or write into its transaction.
- :func:`reset_sql` is what the connection runs when it comes back, in one round trip: ``sql/reset_session.sql``
  clears whatever the handler did to the session (role, settings, temp tables, prepared statements, advisory
  locks, LISTEN), then the SQL that restores what the pool established when it opened the connection (an asyncpg
  pool's ``init``, a SQLAlchemy ``connect`` event, the store's own settings). That state is read once per
  connection, the first time it is lent (:func:`remember`), and kept with the connection.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any

import asyncpg

from idempotency_mw.sql import reset_session, session

# The SQL that restores each connection's state as its pool made it, by the driver connection it belongs to.
_restores: weakref.WeakKeyDictionary[asyncpg.Connection, str] = weakref.WeakKeyDictionary()


def driver_connection(connection: Any) -> asyncpg.Connection:
    """The asyncpg connection itself, behind an asyncpg pool's proxy if ``connection`` is one."""
    driver: asyncpg.Connection = getattr(connection, "_con", None) or connection  # where an asyncpg pool's proxy has it
    return driver


def set_restore(connection: asyncpg.Connection, sql: str) -> None:
    """Record the SQL that gives ``connection`` back the state its pool established (the store's own pool sets it
    as it opens a connection, since it knows what it set)."""
    _restores[driver_connection(connection)] = sql


async def remember(connection: Any, *, time_limit: float) -> None:
    """Read the session state the pool gave ``connection`` (once per connection), before it is first lent."""
    driver = driver_connection(connection)
    if driver not in _restores:
        _restores[driver] = await connection.fetchval(session()["capture"], timeout=time_limit) or ""


def reset_sql(connection: Any) -> str:
    """What a lent connection runs when it comes back: the full reset, then its pool's state again."""
    return reset_session() + "\n" + _restores.get(driver_connection(connection), "")


class LentConnection:
    """An asyncpg connection for the length of a loan: every method of ``asyncpg.Connection`` works on the
    connection until :meth:`end`, and raises ``asyncpg.InterfaceError`` after it (a method looked up before the end
    and called after it too). Like asyncpg's pool proxy, it guards the connection's methods, not the objects they
    returned during the loan (a prepared statement, a cursor)."""

    __slots__ = ("_connection",)

    def __init__(self, connection: asyncpg.Connection) -> None:
        self._connection: asyncpg.Connection | None = connection

    def end(self) -> None:
        self._connection = None

    def _live(self, name: str) -> asyncpg.Connection:
        connection = self._connection
        if connection is None:
            raise asyncpg.InterfaceError(
                f"cannot call Connection.{name}(): the connection was lent to a request that has ended (a task that "
                "outlives its request needs a connection of its own)"
            )
        return connection

    def __getattr__(self, name: str) -> Any:
        return getattr(self._live(name), name)

    def __repr__(self) -> str:
        state = "ended" if self._connection is None else repr(self._connection)
        return f"<LentConnection {state}>"


def _forwarding(name: str) -> Any:
    def method(self: LentConnection, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._live(name), name)(*args, **kwargs)

    return functools.update_wrapper(method, getattr(asyncpg.Connection, name))


for _name, _member in inspect.getmembers(asyncpg.Connection, inspect.isfunction):
    if not _name.startswith("_"):
        setattr(LentConnection, _name, _forwarding(_name))
