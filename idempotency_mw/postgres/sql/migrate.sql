-- The bookkeeping of migrate(): which migrations a schema has, and the lock that makes concurrent runs take turns.
-- Loaded by name like queries.sql; {schema} is the store's schema.
--
-- migrate() runs everything in transactions that take the lock first: creating the schema and this table, then
-- each migration with its check and its record. A transaction-scoped lock (not a session lock) is released by
-- COMMIT, so it also works through a transaction-pooling PgBouncer, where a session lock could outlive the
-- transaction on a server connection someone else gets next. One key for every schema: migrations are rare, and
-- two schemas created at once must take turns too (CREATE SCHEMA races on the catalog like CREATE TABLE does).

-- name: lock
-- 0x1DE40001, a key of our own in the database's advisory lock space; waits for a concurrent migrate to commit.
SELECT pg_advisory_xact_lock(501481473);

-- name: schema_exists
-- CREATE SCHEMA IF NOT EXISTS needs the CREATE privilege on the database even when the schema exists, so a role
-- that may only create in an existing schema looks first.
SELECT to_regnamespace('{schema}') IS NOT NULL;

-- name: create_schema
CREATE SCHEMA {schema};

-- name: create_table
CREATE TABLE IF NOT EXISTS {schema}.idempotency_schema_migrations (
    version     integer     PRIMARY KEY,
    name        text        NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
);

-- name: is_applied
-- $1 version
SELECT EXISTS (SELECT FROM {schema}.idempotency_schema_migrations WHERE version = $1);

-- name: record
-- $1 version, $2 file name
INSERT INTO {schema}.idempotency_schema_migrations (version, name) VALUES ($1, $2);

-- name: bookkeeping_exists
-- migrate --check reads, and never creates: a database never migrated has no bookkeeping table yet.
SELECT to_regclass('{schema}.idempotency_schema_migrations') IS NOT NULL;

-- name: applied_versions
SELECT version FROM {schema}.idempotency_schema_migrations ORDER BY version;

-- name: create_schema_if_missing
-- In a script (migrate --sql, migration_statements()): for a schema other than public, which always exists.
CREATE SCHEMA IF NOT EXISTS {schema};

-- name: record_in_script
-- record, in a script: the version and the file name are written in (ours: digits, and a file name).
INSERT INTO {schema}.idempotency_schema_migrations (version, name) VALUES ({version}, '{name}');
