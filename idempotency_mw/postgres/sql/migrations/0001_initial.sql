-- One row per (tenant, key). The tenant leads the primary key, so a table sharded by tenant (Citus) keeps
-- every statement on one shard. Names are qualified with the store's schema (see sql/__init__.py).
-- Unused since fences became random tokens drawn by the store (queries.sql, claim); kept so that instances of the
-- versions that drew fences from it keep working during a rolling upgrade.
CREATE SEQUENCE {schema}.idempotency_fence AS bigint;

CREATE TABLE {schema}.idempotency_records (
    tenant            text        NOT NULL,
    key               text        NOT NULL,
    fingerprint       bytea       NOT NULL,
    state             text        NOT NULL CHECK (state IN ('in_progress', 'completed')),
    fence             bigint      NOT NULL,
    lease_expires_at  timestamptz,
    status            smallint,
    headers           jsonb,
    body              bytea,
    body_size         bigint,
    attempts          integer     NOT NULL DEFAULT 0,
    created_at        timestamptz NOT NULL,
    completed_at      timestamptz,
    expires_at        timestamptz NOT NULL,
    PRIMARY KEY (tenant, key)
) WITH (fillfactor = 90);  -- room for HOT updates: replays only bump attempts, an unindexed column

CREATE INDEX idempotency_records_expires_at ON {schema}.idempotency_records (expires_at);
