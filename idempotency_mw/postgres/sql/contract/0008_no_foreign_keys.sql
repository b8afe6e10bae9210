-- The contract step of 0006, for the release after the one that brought it: once no instance of a release that
-- relies on the foreign keys can be running, they go, and with them their check on every deleted record. Not run
-- by migrate() in this release: the next one moves this file into migrations/ (docs/operations.md, "Upgrading
-- while instances of the previous version run"); the tests and the purge benchmark apply it to see the shape the
-- statements are written for.
ALTER TABLE {schema}.idempotency_responses
    DROP CONSTRAINT IF EXISTS idempotency_responses_tenant_key_fkey;
ALTER TABLE {schema}.idempotency_recovery_points
    DROP CONSTRAINT IF EXISTS idempotency_recovery_points_tenant_key_fkey;
