"""What a handler may leave behind on the session of the connection it was lent, and how a test reads a session's
state back: for the tests that a lent connection comes back clean (asyncpg in test_lending.py, SQLAlchemy in
test_sqlalchemy.py)."""

from __future__ import annotations

# What a handler may leave behind on its connection, each surviving the transaction's COMMIT.
SESSION_LEAKS = {
    "role": "SET ROLE imw_leak_role",
    "session_authorization": "SET SESSION AUTHORIZATION imw_leak_role",
    "search_path": "SET search_path = public, pg_catalog",
    "setting": "SET statement_timeout = 12345",
    "temp_table": "CREATE TEMP TABLE imw_leak_temp (x int)",
    "prepared_statement": "PREPARE imw_leak_statement AS SELECT 1",
    "prepared_in_a_block": "DO $$ BEGIN EXECUTE 'PREPARE imw_leak_in_block AS SELECT 1'; END $$",
    "advisory_lock": "SELECT pg_advisory_lock(424242)",
    "listen": "LISTEN imw_leak_channel",
}

SESSION_STATE = """
SELECT current_user::text AS current_user,
       session_user::text AS session_user,
       current_setting('search_path') AS search_path,
       current_setting('statement_timeout') AS statement_timeout,
       (SELECT count(*) FROM pg_class WHERE relnamespace = pg_my_temp_schema()) AS temp_tables,
       (SELECT count(*) FROM pg_prepared_statements WHERE from_sql) AS prepared_statements,
       (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()) AS advisory_locks,
       (SELECT count(*) FROM pg_listening_channels()) AS listening
"""
