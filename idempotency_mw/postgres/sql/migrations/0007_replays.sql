-- How often, and about when last, each record's response was replayed, for inspect and list. A replay writes
-- nothing: each store counts its replays in memory and writes them in batches (count_replays in queries.sql). They
-- have a table of their own so that a batch changes none of the records' pages: replays of many keys scattered over
-- a large records table changed a page each, and the first change of a page after a checkpoint writes all of it to
-- the WAL (about 8 KiB a replayed record; benchmarks/results/scale.md). Here the rows of the records replayed lie
-- together, a batch touches few pages, and an update of a row stays on its page (no column of it that a batch
-- changes is indexed; the fill factor leaves room for the new version).
-- A row counts the replays of one life of its record (life: the record's created_at), so that a record that
-- expired and was claimed afresh starts again from nothing without a write here; every statement that deletes a
-- record deletes its row with it. Expand only: the previous release never reads or writes it (nor deletes from
-- it: the rows of the records its purge deletes during a roll stay, never read; docs/operations.md).
CREATE TABLE {schema}.idempotency_replays (
    tenant            text        NOT NULL,
    key               text        NOT NULL,
    life              timestamptz NOT NULL,
    replays           integer     NOT NULL,
    last_replayed_at  timestamptz NOT NULL,
    PRIMARY KEY (tenant, key)
) WITH (fillfactor = 70);
