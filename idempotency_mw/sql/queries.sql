-- Every statement the PostgreSQL store runs for requests and operators, loaded by name (the "-- name:" lines);
-- migrate() runs migrate.sql and migrations/. Parameters are numbered; each statement is one round trip and is
-- prepared once per connection. {schema} is the store's schema (PostgresStore(schema=...)), so no statement
-- depends on the session's search_path.

-- name: claim
-- Insert a fresh in_progress record; or take over an expired record, or a lapsed lease of the same request; or
-- count the attempt on a record that is still running or was made by a different request (409, 422); or, for a
-- completed record of the same request, only read it: a replay writes nothing (no new row version, no WAL, no
-- transaction id), so a storm of retries stays a storm of reads.
-- $6 is the fence of this claim: a random 63-bit token the store draws (see postgres.py, new_fence), not a
-- sequence value, because a sequence can hand out a value again after a restore or the promotion of a standby
-- that missed its last values, and a stale worker's fence would then own the newer claim.
-- ON CONFLICT DO NOTHING sees a row committed after this statement's snapshot (it waits for a concurrent insert
-- to commit), but the UPDATE and the SELECT below see only the snapshot. So in a race with a concurrent claim the
-- statement can return no row, or the snapshot's version of a row another claim has just changed (a replayable
-- row that is no longer one): the store then runs claim_locked, which always answers (postgres.py, claim).
-- $1 tenant, $2 key, $3 fingerprint, $4 lease seconds, $5 ttl seconds (at least $4, see renew), $6 fence
WITH inserted AS (
    INSERT INTO {schema}.idempotency_records AS r
        (tenant, key, fingerprint, state, fence, lease_expires_at, created_at, expires_at)
    VALUES ($1, $2, $3, 'in_progress', $6, now() + make_interval(secs => $4), now(), now() + make_interval(secs => $5))
    ON CONFLICT (tenant, key) DO NOTHING
    RETURNING r.fence, r.state, r.fingerprint, r.attempts, r.status, r.headers, r.body, r.body_size
), updated AS (
    UPDATE {schema}.idempotency_records AS r SET
        fingerprint      = CASE WHEN r.expires_at <= now() OR (r.state = 'in_progress' AND r.lease_expires_at <= now() AND r.fingerprint = $3) THEN $3 ELSE r.fingerprint END,
        state            = CASE WHEN r.expires_at <= now() OR (r.state = 'in_progress' AND r.lease_expires_at <= now() AND r.fingerprint = $3) THEN 'in_progress' ELSE r.state END,
        fence            = CASE WHEN r.expires_at <= now() OR (r.state = 'in_progress' AND r.lease_expires_at <= now() AND r.fingerprint = $3) THEN $6 ELSE r.fence END,
        lease_expires_at = CASE WHEN r.expires_at <= now() OR (r.state = 'in_progress' AND r.lease_expires_at <= now() AND r.fingerprint = $3) THEN now() + make_interval(secs => $4) ELSE r.lease_expires_at END,
        status           = CASE WHEN r.expires_at <= now() THEN NULL ELSE r.status END,
        headers          = CASE WHEN r.expires_at <= now() THEN NULL ELSE r.headers END,
        body             = CASE WHEN r.expires_at <= now() THEN NULL ELSE r.body END,
        body_size        = CASE WHEN r.expires_at <= now() THEN NULL ELSE r.body_size END,
        completed_at     = CASE WHEN r.expires_at <= now() THEN NULL ELSE r.completed_at END,
        created_at       = CASE WHEN r.expires_at <= now() THEN now() ELSE r.created_at END,
        expires_at       = CASE WHEN r.expires_at <= now() THEN now() + make_interval(secs => $5)
                                WHEN r.state = 'in_progress' AND r.lease_expires_at <= now() AND r.fingerprint = $3 THEN GREATEST(r.expires_at, now() + make_interval(secs => $4))
                                ELSE r.expires_at END,
        attempts         = CASE WHEN r.expires_at <= now() THEN 0 ELSE r.attempts + 1 END
    WHERE r.tenant = $1 AND r.key = $2 AND NOT EXISTS (SELECT FROM inserted)
      AND NOT (r.state = 'completed' AND r.fingerprint = $3 AND r.expires_at > now())
    RETURNING r.fence, r.state, r.fingerprint, r.attempts, r.status, r.headers, r.body, r.body_size
), found AS (
    SELECT * FROM inserted
    UNION ALL
    SELECT * FROM updated
    UNION ALL
    SELECT r.fence, r.state, r.fingerprint, r.attempts, r.status, r.headers, r.body, r.body_size
    FROM {schema}.idempotency_records AS r
    WHERE r.tenant = $1 AND r.key = $2 AND NOT EXISTS (SELECT FROM inserted) AND NOT EXISTS (SELECT FROM updated)
      AND r.state = 'completed' AND r.fingerprint = $3 AND r.expires_at > now()
)
SELECT
    -- Ours if it carries the fence just drawn. The state check is a second lock on the door: a completed record
    -- whose fence equals the one drawn (one chance in 2^63) must replay, never run again.
    f.fence = $6 AND f.state = 'in_progress' AS owned,
    f.fence,
    f.state,
    f.fingerprint = $3 AS same_request,
    f.attempts,
    CASE WHEN f.state = 'completed' AND f.fingerprint = $3 THEN f.status END AS status,
    CASE WHEN f.state = 'completed' AND f.fingerprint = $3 THEN f.headers END AS headers,
    CASE WHEN f.state = 'completed' AND f.fingerprint = $3 THEN f.body END AS body,
    CASE WHEN f.state = 'completed' AND f.fingerprint = $3 THEN f.body_size END AS body_size
FROM found AS f;

-- name: claim_locked
-- The claim in one INSERT … ON CONFLICT DO UPDATE, for when ``claim`` returned nothing usable (a race with a
-- concurrent claim, see above): DO UPDATE locks and returns the current row even when it was committed after this
-- statement's snapshot, so it always answers. It writes the row in every case, a replay too (without counting it).
-- $1 tenant, $2 key, $3 fingerprint, $4 lease seconds, $5 ttl seconds, $6 fence
INSERT INTO {schema}.idempotency_records AS r
    (tenant, key, fingerprint, state, fence, lease_expires_at, created_at, expires_at)
VALUES ($1, $2, $3, 'in_progress', $6, now() + make_interval(secs => $4), now(), now() + make_interval(secs => $5))
ON CONFLICT (tenant, key) DO UPDATE SET
    fingerprint      = CASE WHEN r.expires_at <= now() OR (r.state = 'in_progress' AND r.lease_expires_at <= now() AND r.fingerprint = excluded.fingerprint) THEN excluded.fingerprint ELSE r.fingerprint END,
    state            = CASE WHEN r.expires_at <= now() OR (r.state = 'in_progress' AND r.lease_expires_at <= now() AND r.fingerprint = excluded.fingerprint) THEN 'in_progress' ELSE r.state END,
    fence            = CASE WHEN r.expires_at <= now() OR (r.state = 'in_progress' AND r.lease_expires_at <= now() AND r.fingerprint = excluded.fingerprint) THEN excluded.fence ELSE r.fence END,
    lease_expires_at = CASE WHEN r.expires_at <= now() OR (r.state = 'in_progress' AND r.lease_expires_at <= now() AND r.fingerprint = excluded.fingerprint) THEN excluded.lease_expires_at ELSE r.lease_expires_at END,
    status           = CASE WHEN r.expires_at <= now() THEN NULL ELSE r.status END,
    headers          = CASE WHEN r.expires_at <= now() THEN NULL ELSE r.headers END,
    body             = CASE WHEN r.expires_at <= now() THEN NULL ELSE r.body END,
    body_size        = CASE WHEN r.expires_at <= now() THEN NULL ELSE r.body_size END,
    completed_at     = CASE WHEN r.expires_at <= now() THEN NULL ELSE r.completed_at END,
    created_at       = CASE WHEN r.expires_at <= now() THEN excluded.created_at ELSE r.created_at END,
    expires_at       = CASE WHEN r.expires_at <= now() THEN excluded.expires_at
                            WHEN r.state = 'in_progress' AND r.lease_expires_at <= now() AND r.fingerprint = excluded.fingerprint THEN GREATEST(r.expires_at, excluded.lease_expires_at)
                            ELSE r.expires_at END,
    attempts         = CASE WHEN r.expires_at <= now() THEN 0
                            WHEN r.state = 'completed' AND r.fingerprint = excluded.fingerprint THEN r.attempts
                            ELSE r.attempts + 1 END
RETURNING
    r.fence = $6 AND r.state = 'in_progress' AS owned,
    r.fence,
    r.state,
    r.fingerprint = $3 AS same_request,
    r.attempts,
    CASE WHEN r.state = 'completed' AND r.fingerprint = $3 THEN r.status END AS status,
    CASE WHEN r.state = 'completed' AND r.fingerprint = $3 THEN r.headers END AS headers,
    CASE WHEN r.state = 'completed' AND r.fingerprint = $3 THEN r.body END AS body,
    CASE WHEN r.state = 'completed' AND r.fingerprint = $3 THEN r.body_size END AS body_size;

-- name: renew
-- A record never expires under a live lease: expires_at is moved to the new lease deadline when that is later
-- (a handler running past its ttl), or the claim statement and the purge would treat a running request's record
-- as expired, and a retry would run the handler a second time beside it. claim keeps the same rule ($5 is at
-- least $4, and a takeover moves expires_at like this). Unchanged, the indexed column keeps the update HOT.
-- $1 tenant, $2 key, $3 fence, $4 lease seconds
UPDATE {schema}.idempotency_records
SET lease_expires_at = now() + make_interval(secs => $4),
    expires_at = GREATEST(expires_at, now() + make_interval(secs => $4))
WHERE tenant = $1 AND key = $2 AND fence = $3 AND state = 'in_progress';

-- name: complete
-- $1 tenant, $2 key, $3 fence, $4 status, $5 headers, $6 body (NULL when over the cap), $7 body size
UPDATE {schema}.idempotency_records
SET state = 'completed', lease_expires_at = NULL, completed_at = now(),
    status = $4, headers = $5, body = $6, body_size = $7
WHERE tenant = $1 AND key = $2 AND fence = $3 AND state = 'in_progress';

-- name: release
-- $1 tenant, $2 key, $3 fence
DELETE FROM {schema}.idempotency_records
WHERE tenant = $1 AND key = $2 AND fence = $3 AND state = 'in_progress';

-- name: forget
-- $1 tenant, $2 key
DELETE FROM {schema}.idempotency_records WHERE tenant = $1 AND key = $2;

-- name: inspect
-- $1 tenant, $2 key
SELECT tenant, key, state, fence, fingerprint, attempts,
       extract(epoch FROM created_at)::float8 AS created_at,
       extract(epoch FROM expires_at)::float8 AS expires_at,
       extract(epoch FROM lease_expires_at)::float8 AS lease_expires_at,
       status, headers, body, body_size
FROM {schema}.idempotency_records WHERE tenant = $1 AND key = $2;

-- name: purge_expired
-- Batched so that a large backlog never holds locks for long; the expires_at index finds the batch.
-- $1 batch size
DELETE FROM {schema}.idempotency_records
WHERE ctid = ANY (ARRAY(
    SELECT ctid FROM {schema}.idempotency_records WHERE expires_at <= now()
    ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED
));

-- name: count_expired
SELECT count(*) FROM {schema}.idempotency_records WHERE expires_at <= now();

-- name: stats
SELECT
    count(*) FILTER (WHERE state = 'in_progress' AND expires_at > now()) AS in_progress,
    count(*) FILTER (WHERE state = 'completed' AND expires_at > now()) AS completed,
    count(*) FILTER (WHERE expires_at <= now()) AS expired,
    count(*) FILTER (WHERE state = 'in_progress' AND lease_expires_at <= now() AND expires_at > now()) AS past_lease,
    extract(epoch FROM now() - min(created_at) FILTER (WHERE state = 'in_progress' AND expires_at > now()))::float8
        AS oldest_in_progress_seconds,
    coalesce(sum(attempts), 0)::bigint AS attempts
FROM {schema}.idempotency_records;

-- name: migrated
-- open() runs this once: a database that was never migrated (or a store pointed at the wrong schema) fails at
-- startup with the command that fixes it, instead of at every request.
SELECT to_regclass('{schema}.idempotency_records') IS NOT NULL;

-- name: database_identity
-- SQLAlchemyStore.open() compares this on the store's connection and on the app's engine: the handlers'
-- transactions complete the records, so the engine must reach the store's database (same server, same database).
SELECT current_database() AS database, pg_postmaster_start_time() AS server_started;
