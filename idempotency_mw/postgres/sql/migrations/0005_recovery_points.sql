-- Recovery points of requests whose handler runs in steps (docs/design.md §10): which steps of a request have
-- finished, each with the small result later steps need, committed in the transaction of the step's own writes, so
-- that a retry resumes after the last one instead of running them again.
-- A point belongs to one life of its record: ``life`` is the record's created_at when the point was written, and a
-- record that expired and was claimed afresh has another, so the points of its earlier life are never resumed (not
-- even by a previous release, whose claim knows nothing of them). They go with their record (ON DELETE CASCADE):
-- forget and the purge need no statement of their own for them.
-- Expand only: a table of its own, which the previous release never reads or writes, so it runs beside this one
-- during a rolling deploy (tests/scenarios/test_rolling_deploy.py). A step's transaction inserts its points and
-- writes nothing of the record row, which renewals and duplicates update meanwhile (as for responses, 0002): it
-- holds under any isolation level, and the primary key lets one claim's point per step land.
CREATE TABLE {schema}.idempotency_recovery_points (
    tenant        text        NOT NULL,
    key           text        NOT NULL,
    life          timestamptz NOT NULL,  -- the record's created_at: the life of the key this point belongs to
    step          text        NOT NULL,
    position      integer     NOT NULL,  -- the order in which the request reached its steps
    done          boolean     NOT NULL,  -- false: an unrepeatable outside step began, and its outcome is unknown
    result        text,                  -- the step's result as JSON text; NULL when sealed, or not done
    sealed        bytea,                 -- the result sealed (AES-256-GCM) by a store with a cipher
    sealed_with   text,                  -- the id of the key it is sealed under; NULL when plain
    fence         bigint      NOT NULL,  -- the claim that committed it
    committed_at  timestamptz NOT NULL,
    PRIMARY KEY (tenant, key, life, step),
    FOREIGN KEY (tenant, key) REFERENCES {schema}.idempotency_records (tenant, key) ON DELETE CASCADE
);
