-- The request's parts, for a 422 that says what changed (explain_mismatch, _parts.py): keyed digests (HMAC-SHA256
-- under a key derived from the fingerprint key, 8 bytes each) of the method, the path, the query, the body, and of
-- the name and value of each body field, at most 64 of them: never a name or a value that can be read without the
-- server's secret, and at most about 1.2 KB. The claim writes them, with the record, only for a route that opts in:
-- NULL otherwise, and NULL costs no bytes. They begin with the tail of the fingerprint they were written with, so
-- that a record whose fingerprint another writer replaced (an instance of the previous version taking an expired
-- record over, which leaves this column as it was) never answers with the parts of its earlier life.
-- Expand only: the previous version's statements name their columns and leave this one alone, so it runs beside
-- this one during a rolling deploy (tests/scenarios/test_rolling_deploy.py). Adding a column without a default
-- rewrites nothing.
ALTER TABLE {schema}.idempotency_records
    ADD COLUMN request_parts bytea;
