-- What a connection lent to code other than the store's (a transactional handler) runs when it comes back, so that
-- it is as a fresh connection would be: one simple query, one round trip. SET SESSION AUTHORIZATION DEFAULT also ends a
-- SET ROLE, and comes first so the rest runs as the login role; RESET ALL leaves role and session authorization
-- alone. Prepared statements made with SQL PREPARE are deallocated; the driver's own (protocol-level, not
-- from_sql) stay, so its statement cache stays valid.
SET SESSION AUTHORIZATION DEFAULT;
RESET ALL;
CLOSE ALL;
UNLISTEN *;
SELECT pg_advisory_unlock_all();
DISCARD TEMP;
DISCARD SEQUENCES;
DO $$
DECLARE statement_name text;
BEGIN
    FOR statement_name IN SELECT name FROM pg_prepared_statements WHERE from_sql LOOP
        EXECUTE format('DEALLOCATE %I', statement_name);
    END LOOP;
END
$$;
