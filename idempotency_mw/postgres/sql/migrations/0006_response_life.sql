-- The first half of retiring the foreign keys to the records (0002's from the responses, 0005's from the recovery
-- points): each is checked for every record deleted, and made the purge ten times slower than a table of records
-- alone. What they guaranteed, the statements now keep themselves (docs/design.md §7): a response belongs to one
-- life of its record, as a recovery point does (0005): ``life`` is the record's created_at when it completed, and
-- every read matches it, so that a response can never answer for a record purged or expired and claimed again. A
-- statement that writes a response or a point locks its record row FOR KEY SHARE, the lock the foreign key's check
-- took; a release asks idempotency_settled, which reads with a snapshot taken after its lock, as the foreign key's
-- check on a delete did; every statement that deletes a record deletes its responses and points with it.
-- Expand only: a nullable column and a function, which the previous release never reads; it keeps its foreign keys
-- to rely on while it runs beside this one (tests/scenarios/test_rolling_deploy.py). Its responses have no life
-- (NULL): the foreign key tied them to the record's current life, and a read takes them as such. The contract
-- step, dropping both foreign keys, ships with the next release (sql/contract/, docs/operations.md).
ALTER TABLE {schema}.idempotency_responses
    ADD COLUMN life timestamptz;

-- Whether the record's life has a response or a recovery point, read with a snapshot of its own: a VOLATILE
-- function takes a fresh one for each query it runs, so a release that has just locked the record row sees a
-- completion or a step that committed while it waited, or in the moment before (see release in queries.sql).
CREATE FUNCTION {schema}.idempotency_settled(p_tenant text, p_key text, p_life timestamptz) RETURNS boolean
    LANGUAGE sql VOLATILE
    AS $$ SELECT EXISTS (SELECT FROM {schema}.idempotency_responses AS s WHERE s.tenant = p_tenant AND s.key = p_key AND (s.life = p_life OR s.life IS NULL)) OR EXISTS (SELECT FROM {schema}.idempotency_recovery_points AS p WHERE p.tenant = p_tenant AND p.key = p_key AND p.life = p_life) $$;
