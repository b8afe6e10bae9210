-- The response of a completed request moves to a table of its own. A transactional handler's transaction writes
-- it, while lease renewals and duplicates' attempts keep updating the record row: under REPEATABLE READ or
-- SERIALIZABLE, an update of a row that changed after the transaction's snapshot is a serialization failure, so
-- that transaction must not write the record row at all. It inserts the response instead, which nothing else
-- writes: the primary key lets one completion per record land, the foreign key keeps a record from being deleted
-- under a completion still on its way (every statement that deletes records deletes their responses first).
-- Instances of an earlier version cannot run beside this one: stop them before migrating.
-- A response is stored plain, or sealed by a store with a cipher (encryption.py): then status, headers and body are
-- in ``sealed``, under the operator's key ``sealed_with``, and only body_size stays readable.
CREATE TABLE {schema}.idempotency_responses (
    tenant        text        NOT NULL,
    key           text        NOT NULL,
    fence         bigint      NOT NULL,  -- the claim that completed it
    status        smallint,              -- NULL when sealed
    headers       jsonb,                 -- NULL when sealed
    body          bytea,                 -- NULL when not stored in full (over the cap, or cut short), or sealed
    body_size     bigint      NOT NULL,
    sealed        bytea,                 -- status, headers and body, sealed (AES-256-GCM); NULL when plain
    sealed_with   text,                  -- the id of the key it is sealed under; NULL when plain
    completed_at  timestamptz NOT NULL,
    PRIMARY KEY (tenant, key),
    FOREIGN KEY (tenant, key) REFERENCES {schema}.idempotency_records (tenant, key),
    CONSTRAINT idempotency_responses_plain_or_sealed CHECK (
        (sealed IS NULL AND sealed_with IS NULL AND status IS NOT NULL AND headers IS NOT NULL)
        OR (sealed IS NOT NULL AND sealed_with IS NOT NULL AND status IS NULL AND headers IS NULL AND body IS NULL)
    )
);

INSERT INTO {schema}.idempotency_responses (tenant, key, fence, status, headers, body, body_size, completed_at)
SELECT tenant, key, fence, status, headers, body, body_size, completed_at
FROM {schema}.idempotency_records
WHERE state = 'completed';

ALTER TABLE {schema}.idempotency_records
    DROP COLUMN state,
    DROP COLUMN status,
    DROP COLUMN headers,
    DROP COLUMN body,
    DROP COLUMN body_size,
    DROP COLUMN completed_at;

-- Fences are random tokens drawn by the store (queries.sql, claim); no version draws them from it any more.
DROP SEQUENCE IF EXISTS {schema}.idempotency_fence;
