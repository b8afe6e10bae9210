-- Removing the store from a schema (docs/operations.md, "Removing the store"; removal_statements()): the
-- function that reads them, the replay counts, responses and recovery points (the foreign keys, until the
-- contract step, point at the records), then the records, then what migrate() kept of its own. The sequence is
-- gone since 0002; a schema migrated by an older version may still have it. The schema itself stays: it may hold
-- other tables (DROP SCHEMA it yourself if the store had it alone).
DROP FUNCTION IF EXISTS {schema}.idempotency_settled(text, text, timestamptz);
DROP TABLE IF EXISTS {schema}.idempotency_replays;
DROP TABLE IF EXISTS {schema}.idempotency_recovery_points;
DROP TABLE IF EXISTS {schema}.idempotency_responses;
DROP TABLE IF EXISTS {schema}.idempotency_records;
DROP SEQUENCE IF EXISTS {schema}.idempotency_fence;
DROP TABLE IF EXISTS {schema}.idempotency_schema_migrations;
