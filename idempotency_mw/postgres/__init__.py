"""The PostgreSQL store: records in tables of its own, on asyncpg, through connections of its own or of the app's.

``PostgresStore`` is the store; ``postgres_url`` turns a deploy's ``DATABASE_URL`` (SQLAlchemy's spelling
included) into one asyncpg takes; ``migration_statements`` and ``removal_statements`` are the store's DDL for a
migration tool of the app's (Alembic) to run. Everything else in this package is how the store works
(``docs/design.md`` §9).
"""

from idempotency_mw.postgres._connector import postgres_url
from idempotency_mw.postgres._sql import migration_statements, removal_statements
from idempotency_mw.postgres._store import PostgresStore

__all__ = ["PostgresStore", "migration_statements", "postgres_url", "removal_statements"]
