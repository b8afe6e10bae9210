"""SQL kept in ``.sql`` files (``sql/``) and loaded by name, so every statement the store runs can be read in one
place; the migrations applied in order (:func:`migrate`), or written out as statements for another tool to run
(:func:`migration_statements`, :func:`removal_statements`).

Every table and sequence in them is written ``{schema}.name``, and the loader puts the store's schema there as a
quoted identifier. Fully qualified names keep the statements independent of the session's ``search_path``, which
a transactional handler may change (schema-per-tenant apps do) on the very connection the store then completes on.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncpg

_SQL = resources.files("idempotency_mw.postgres").joinpath("sql")  # every statement, in .sql files
_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
_COMMENT = re.compile(r"--[^\n]*")  # our files hold no "--" inside a string literal
_STATEMENT_END = re.compile(r";\s*$", re.MULTILINE)
_SCHEMA = re.compile(r"[a-z_][a-z0-9_]*")
PLACEHOLDER = "{schema}"
MAX_IDENTIFIER_BYTES = 63  # PostgreSQL's NAMEDATALEN - 1: a longer name would be truncated, not refused


def check_schema(schema: str) -> str:
    """``schema`` if it is a name the store accepts, else ValueError saying which names are.

    Plain lower-case identifiers only: they need no escaping, and quoted they mean what they mean unquoted (a
    name with capitals would name a different schema with and without quotes)."""
    if not isinstance(schema, str) or not _SCHEMA.fullmatch(schema) or len(schema) > MAX_IDENTIFIER_BYTES:
        raise ValueError(
            f"idempotency store schema must be a plain lower-case identifier: a letter a-z or '_', then letters, "
            f"digits or '_', at most {MAX_IDENTIFIER_BYTES} characters; got {schema!r}"
        )
    if schema.startswith("pg_"):
        raise ValueError(f"idempotency store schema {schema!r}: names starting with 'pg_' are reserved by PostgreSQL")
    return schema


def _load(filename: str, schema: str) -> str:
    text = _SQL.joinpath(filename).read_text()
    checked = check_schema(schema)  # a plain lower-case identifier: safe quoted, and inside a string literal
    return text.replace(PLACEHOLDER, f'"{checked}"').replace("{schema_name}", checked)


def _split(text: str) -> dict[str, str]:
    """A file split on its ``-- name: x`` lines."""
    parts = _NAME.split(text)
    return {name: body.strip() for name, body in zip(parts[1::2], parts[2::2], strict=True)}


@cache
def queries(schema: str) -> dict[str, str]:
    """The statements of ``queries.sql`` (one per store operation), by name, for a store in ``schema``."""
    return _split(_load("queries.sql", schema))


@cache
def bookkeeping(schema: str) -> dict[str, str]:
    """The statements of ``migrate.sql`` (the lock, the migrations table), by name, for a store in ``schema``."""
    return _split(_load("migrate.sql", schema))


@cache
def migrations(schema: str) -> list[tuple[int, str, str]]:
    """``(version, name, sql)`` for every file in ``migrations/``, in order, for a store in ``schema``."""
    found = []
    for entry in _SQL.joinpath("migrations").iterdir():
        if entry.name.endswith(".sql"):
            version = int(entry.name.split("_", 1)[0])
            found.append((version, entry.name, _load(f"migrations/{entry.name}", schema)))
    return sorted(found)


@cache
def reset_session() -> dict[str, str]:
    """The parts of ``reset_session.sql``: the reset of a connection lent to a handler, and the deallocation of its
    SQL-level prepared statements (neither names a table)."""
    return _split(_SQL.joinpath("reset_session.sql").read_text())


@cache
def session() -> dict[str, str]:
    """The statements of ``session.sql``: what the store asks of, and sets on, its connections' sessions."""
    return _split(_SQL.joinpath("session.sql").read_text())


def statements(script: str) -> list[str]:
    """A migration file as its statements, comments dropped: each ends with a semicolon at the end of a line."""
    return [part.strip() for part in _STATEMENT_END.split(_COMMENT.sub("", script)) if part.strip()]


def migration_statements(schema: str = "public", *, applied: Collection[int] = ()) -> list[str]:
    """What :func:`migrate` runs, as statements for another tool to run in one transaction (Alembic's
    ``op.execute``, a reviewed script): the lock, the schema and the bookkeeping table, then each migration not in
    ``applied`` (versions) with its record, so that the store and ``idempotency-mw migrate`` see it as applied."""
    sql = {name: statements(text)[0] for name, text in bookkeeping(schema).items()}  # without their comments
    found = [sql["lock"]]
    if schema != "public":
        found.append(sql["create_schema_if_missing"])
    found.append(sql["create_table"])
    for version, name, migration in migrations(schema):
        if version not in applied:
            found += statements(migration)
            found.append(sql["record_in_script"].replace("{version}", str(version)).replace("{name}", name))
    return found


def contract_statements(schema: str = "public") -> list[str]:
    """The contract step of migration 0006 (``contract/``): what the next release runs as a migration once no
    instance of a release relying on the foreign keys can be running. Not run by :func:`migrate` in this one; the
    tests and the purge benchmark apply it to run the statements on the shape they are written for."""
    found = []
    for entry in sorted(_SQL.joinpath("contract").iterdir(), key=lambda entry: entry.name):
        if entry.name.endswith(".sql"):
            found += statements(_load(f"contract/{entry.name}", schema))
    return found


def removal_statements(schema: str = "public") -> list[str]:
    """The statements that remove the store's tables from ``schema``, in the order their keys allow."""
    return statements(_load("remove.sql", schema))


async def applied_versions(connection: asyncpg.Connection, schema: str) -> list[int]:
    """The migrations ``schema`` has, read only (a schema never migrated has none)."""
    sql = bookkeeping(schema)
    if not await connection.fetchval(sql["bookkeeping_exists"]):
        return []
    return [row["version"] for row in await connection.fetch(sql["applied_versions"])]


async def migrate(connection: asyncpg.Connection, schema: str) -> list[str]:
    """Create ``schema`` if it is missing and apply the migrations it lacks, in order, each in its own transaction;
    return their names.

    Safe to run repeatedly and from several processes at once: every transaction here, the one that creates the
    schema and the bookkeeping table included, first takes a transaction-scoped advisory lock, so concurrent runs
    take turns and each migration is applied once (see ``migrate.sql``).
    """
    sql = bookkeeping(schema)
    applied: list[str] = []
    async with connection.transaction():
        await connection.execute(sql["lock"])
        if not await connection.fetchval(sql["schema_exists"]):
            await connection.execute(sql["create_schema"])
        await connection.execute(sql["create_table"])
    for version, name, migration in migrations(schema):
        async with connection.transaction():
            await connection.execute(sql["lock"])
            if await connection.fetchval(sql["is_applied"], version):
                continue
            await connection.execute(migration)
            await connection.execute(sql["record"], version, name)
            applied.append(name)
    return applied


async def stamp(connection: asyncpg.Connection, schema: str) -> list[str]:
    """Record every migration as applied without running it, for tables that another tool created from them (a
    copy of the DDL made before :func:`migration_statements` recorded its work); return the names recorded. Refuses
    a schema without the store's tables: stamping is for tables that exist."""
    sql = bookkeeping(schema)
    recorded: list[str] = []
    async with connection.transaction():
        await connection.execute(sql["lock"])
        if not await connection.fetchval(queries(schema)["migrated"]):
            raise ValueError(
                f'schema "{schema}" has no idempotency tables of this version to record (none, or older ones): '
                "run migrate instead"
            )
        await connection.execute(sql["create_table"])
        for version, name, _ in migrations(schema):
            if not await connection.fetchval(sql["is_applied"], version):
                await connection.execute(sql["record"], version, name)
                recorded.append(name)
    return recorded
