-- What a connection lent to code other than the store's (a transactional handler) runs when it comes back, so that
-- it is as a fresh connection would be; loaded by name like queries.sql, sent as one simple query, one round trip.

-- name: reset
-- SET SESSION AUTHORIZATION DEFAULT also ends a SET ROLE, and comes first so the rest runs as the login role; RESET
-- ALL leaves role and session authorization alone.
SET SESSION AUTHORIZATION DEFAULT;
RESET ALL;
CLOSE ALL;
UNLISTEN *;
SELECT pg_advisory_unlock_all();
DISCARD TEMP;
DISCARD SEQUENCES;

-- name: deallocate
-- Prepared statements made with SQL PREPARE are deallocated; the driver's own (protocol-level, not from_sql) stay,
-- so its statement cache stays valid. Only after a loan whose SQL said PREPARE (_lending.py), or whose SQL the
-- store cannot see (SQLAlchemy's): reading pg_prepared_statements and compiling the block cost the server about
-- 80 us, more than three times the rest of the reset (benchmarks/results/tail.md).
DO $$
DECLARE statement_name text;
BEGIN
    FOR statement_name IN SELECT name FROM pg_prepared_statements WHERE from_sql LOOP
        EXECUTE format('DEALLOCATE %I', statement_name);
    END LOOP;
END
$$;
