-- What the store asks of, and sets on, the sessions of its connections; loaded by name like queries.sql. None of
-- these names a table.

-- name: pin_read_committed
-- Run once on each connection the store opens itself (not behind a transaction-pooling proxy, where a session
-- setting would land on whichever server connection the proxy picked). The store's own statements are
-- single-statement transactions that update rows other sessions update too; under REPEATABLE READ or SERIALIZABLE
-- such an update fails once the other commits ("could not serialize access"), and under SERIALIZABLE they would
-- also take part in the handlers' conflict detection. READ COMMITTED waits and re-reads instead. It returns the
-- default the session had, so that the transactions lent to handlers keep the database's level.
SELECT current_setting('default_transaction_isolation') AS database_isolation,
       set_config('default_transaction_isolation', 'read committed', false) AS pinned;

-- name: default_isolation
-- The default isolation level of a session the store does not own (an app's pool, a transaction-pooling proxy).
SELECT current_setting('default_transaction_isolation');

-- name: capture
-- The session state a pool established when it opened a connection (an asyncpg pool's init, a SQLAlchemy
-- "connect" event: SET SESSION AUTHORIZATION, SET ROLE, SET search_path, other SETs), as the SQL that restores it
-- after reset_session.sql, which ends both as the login role. The settings come first, set as the login role (who
-- set them in the first place, or a role below it); then the session authorization, when it is not the role that
-- logged in (pg_stat_activity keeps that one; pg_settings lists neither); then the role.
-- Read once per connection, the first time it is lent to a handler.
SELECT coalesce(string_agg(format('SELECT set_config(%L, %L, false);', name, setting), ' ' ORDER BY name), '')
       || CASE WHEN session_user IS DISTINCT FROM (
               SELECT usename FROM pg_catalog.pg_stat_activity WHERE pid = pg_catalog.pg_backend_pid()
          ) THEN format(' SET SESSION AUTHORIZATION %I;', session_user) ELSE '' END
       || CASE WHEN current_setting('role') <> 'none' THEN format(' SET ROLE %I;', current_setting('role')) ELSE '' END
FROM pg_settings
WHERE source = 'session';

-- name: mark_transaction
-- Sent after the BEGIN of a transactional request's transaction, in its round trip (on a SQLAlchemy engine, whose
-- adapter sends its BEGIN alone, as the transaction's first statement): a mark that lasts as long as that
-- transaction (SET LOCAL), which complete_in_transaction and record_steps look for. A handler that ends the
-- transaction and begins another (ROLLBACK; BEGIN) leaves the connection in a transaction without it. A SET, not a
-- SELECT set_config(): a SELECT would take the transaction's snapshot, after which the handler could no longer
-- choose its isolation level (SET TRANSACTION ISOLATION LEVEL must come before any query).
SET LOCAL idempotency_mw.transaction = 'begun';

-- name: transaction_ended
-- Whether the transaction marked as it began (mark_transaction) has ended: asked only when a statement that writes
-- in a marked transaction alone wrote nothing, to tell a handler that ended it from a newer claim's fence.
SELECT current_setting('idempotency_mw.transaction', true) IS DISTINCT FROM 'begun';
