-- Every statement the PostgreSQL store runs for requests and operators, loaded by name (the "-- name:" lines);
-- migrate() runs migrate.sql and migrations/. Parameters are numbered; each statement is one round trip and is
-- prepared once per connection. {schema} is the store's schema (PostgresStore(schema=...)), so no statement
-- depends on the session's search_path; {schema_name} is its plain name, inside a string.
-- The response's headers (a jsonb column) go in as text, cast here ($5::text::jsonb), and come back as text
-- (headers::text): no statement sends or reads a json or jsonb value, so none depends on the connection's codecs
-- for them (an app's pool whose init sets asyncpg's JSON codec, or a handler that sets one on the connection it
-- was lent, would encode the store's JSON text a second time, or decode it into a list).

-- name: claim
-- The claim of a key, in every case but a takeover: insert a fresh record; or, for a record that exists, read a
-- completed one of the same request and its response (a replay writes nothing: no new row version, no WAL, no
-- transaction id, so a storm of retries stays a storm of reads), or count the attempt of a request still running
-- under a live lease (409) or of a different request (422). Anything else returns no row, and the store runs
-- claim_or_take_over, which answers every case: an expired record or a lapsed lease to take over, or a race with a
-- concurrent claim or completion. PostgreSQL sets up every part of a statement at each execution, so the common
-- answers go through this one, without the takeover's parts.
-- ON CONFLICT DO NOTHING sees a row committed after this statement's snapshot (it waits for a concurrent insert to
-- commit), but the rest of the statement sees only the snapshot (e): such a row, or a response committed after
-- the snapshot, is not counted nor replayed here. The conditions that a concurrent write can change are written on
-- the row being updated (r), which the UPDATE re-reads after waiting for such a write: a record expired, or whose
-- lease ended or lapsed meanwhile, is not counted.
-- $6 is the fence of this claim: a random 63-bit token the store draws (see _records.py, new_fence), not a sequence
-- value, because a sequence can hand out a value again after a restore or the promotion of a standby that missed
-- its last values, and a stale worker's fence would then own the newer claim.
-- $7 is synchronous_commit for this statement's own commit: NULL keeps the session's. A transactional request
-- passes 'off': its claim is visible at once, and the handler's COMMIT, which waits for its flush, flushes the claim
-- before it (WAL is flushed in order), so the claim is durable whenever the effect is, for one flush instead of two.
-- A crash can only lose a claim whose effect never committed; the retry then runs afresh.
-- $3 is the request's fingerprint under each fingerprint key, the current one first (fingerprint.py,
-- FingerprintKeys): the first is written, and a record holding any of them is the same request, so a rotation of
-- the keys turns no retry into a 422. A different request's answer carries the record's fingerprint when it is a
-- bare SHA-256 (unkeyed, written before fingerprints were keyed), which the store compares with the request's own:
-- only a digest already stored in the table is ever sent back to it. It also carries the record's request parts
-- (keyed digests, _parts.py; NULL for a record written without them), when they were written with its fingerprint:
-- they begin with its last 8 bytes (migrations/0004).
-- $1 tenant, $2 key, $3 fingerprints, $4 lease seconds, $5 ttl seconds (at least $4, see renew), $6 fence,
-- $7 synchronous_commit, $8 the request (method and route template, for inspect), $9 its parts (NULL: none)
-- A record that is this request's, or that it replays, comes back with its expires_at (the Idempotency-Expires
-- header): set here, when the record is claimed, and moved only by a renewal or a takeover (never by a completion).
-- A replay also comes back with the life of the record it replays (its created_at), which its count is written to.
WITH commit_setting AS MATERIALIZED (
    SELECT set_config('synchronous_commit', coalesce($7::text, current_setting('synchronous_commit')), true)
), inserted AS (
    INSERT INTO {schema}.idempotency_records AS r
        (tenant, key, fingerprint, fence, lease_expires_at, created_at, expires_at, request, request_parts)
    SELECT $1, $2, ($3::bytea[])[1], $6, now() + make_interval(secs => $4), now(), now() + make_interval(secs => $5), $8,
           $9
    FROM commit_setting
    ON CONFLICT (tenant, key) DO NOTHING
    RETURNING r.fence, r.attempts, r.expires_at
), existing AS (
    SELECT r.fence, r.fingerprint, r.attempts, r.expires_at, r.expires_at <= now() AS expired, r.created_at,
           s.key IS NOT NULL AS completed,
           s.status, s.headers::text AS headers, s.body, s.body_size, s.sealed, s.sealed_with
    FROM {schema}.idempotency_records AS r
    LEFT JOIN {schema}.idempotency_responses AS s ON s.tenant = r.tenant AND s.key = r.key
        AND (s.life = r.created_at OR s.life IS NULL)  -- of this life only (migrations/0006)
    WHERE r.tenant = $1 AND r.key = $2 AND NOT EXISTS (SELECT FROM inserted)
), counted AS (
    UPDATE {schema}.idempotency_records AS r SET attempts = r.attempts + 1
    FROM existing AS e
    WHERE r.tenant = $1 AND r.key = $2 AND r.expires_at > now()
      AND (r.fingerprint <> ALL ($3) OR (NOT e.completed AND r.lease_expires_at > now()))
    RETURNING r.fence, r.fingerprint, r.attempts, e.completed, r.request_parts
)
SELECT true AS owned, false AS completed, true AS same_request, i.attempts,
       NULL::smallint AS status, NULL::text AS headers, NULL::bytea AS body, NULL::bigint AS body_size,
       NULL::bytea AS sealed, NULL::text AS sealed_with, i.fence, NULL::bytea AS unkeyed,
       extract(epoch FROM i.expires_at)::float8 AS expires_at, NULL::bytea AS parts, NULL::timestamptz AS life
FROM inserted AS i
UNION ALL
SELECT false, c.completed, c.fingerprint = ANY ($3), c.attempts, NULL, NULL, NULL, NULL, NULL, NULL, c.fence,
       CASE WHEN length(c.fingerprint) = 32 AND c.fingerprint <> ALL ($3) THEN c.fingerprint END, NULL,
       CASE WHEN c.fingerprint <> ALL ($3)
             AND substring(c.request_parts FOR 8) = substring(c.fingerprint FROM length(c.fingerprint) - 7)
            THEN c.request_parts END, NULL
FROM counted AS c
UNION ALL
SELECT false, true, true, e.attempts, e.status, e.headers, e.body, e.body_size, e.sealed, e.sealed_with, e.fence,
       NULL, extract(epoch FROM e.expires_at)::float8, NULL, e.created_at
FROM existing AS e
WHERE e.completed AND e.fingerprint = ANY ($3) AND NOT e.expired;

-- name: claim_or_take_over
-- The claim in every case, for when ``claim`` returned no row: insert a fresh record; or take over an expired
-- record, or a lapsed lease of the same request; or count the attempt on a record that is still running or was made
-- by a different request (409, 422); or, for a completed record of the same request, only read it and its response.
-- A record is completed when its response exists (idempotency_responses): a transactional handler's transaction
-- inserts it and never writes the record row, which renewals and duplicates update meanwhile (migrations/0002).
-- As in ``claim``, ON CONFLICT DO NOTHING sees a row committed after this statement's snapshot but the rest of the
-- statement sees only the snapshot. So in a race with a concurrent claim or a completion the statement can return
-- no row: the store then runs claim_locked, which always answers (_records.py, Records.claim). A completion committed after
-- the snapshot shows as a lease that ended (NULL) in the UPDATE, which re-reads the row it waited for; its response
-- is not in the snapshot, so that case returns no row either.
-- Every condition that a concurrent write can change is written on the row being updated (r), which the UPDATE
-- re-reads after waiting for such a write; e is the snapshot's record and response.
-- A completion in a handler's transaction writes no record row and leaves the lease set, so nothing in r shows one
-- that committed while the UPDATE waited for a renewal or a duplicate's count of the row: a takeover of a request
-- whose effect committed. So a lapsed lease of this request is locked first (as the UPDATE locks it), and
-- idempotency_settled then reads with a snapshot of its own, as in release: a response (or recovery point) of this
-- life committed since the snapshot, which e shows neither, is a race: the row is left alone, no row returns, and
-- claim_locked answers (a replay). (A record with recovery points in the snapshot is taken over as before: the
-- check cannot tell a response from its points.) The lock is FOR NO KEY UPDATE, which does not wait for the
-- completion's own FOR KEY SHARE: FOR UPDATE would, but it marks the row as though its key changed, and under
-- REPEATABLE READ and SERIALIZABLE an original whose snapshot predates the takeover could then never complete
-- (see complete_in_transaction: the first to commit its response wins).
-- $1 to $8 as for claim
WITH commit_setting AS MATERIALIZED (
    SELECT set_config('synchronous_commit', coalesce($7::text, current_setting('synchronous_commit')), true)
), inserted AS (
    INSERT INTO {schema}.idempotency_records AS r
        (tenant, key, fingerprint, fence, lease_expires_at, created_at, expires_at, request, request_parts)
    SELECT $1, $2, ($3::bytea[])[1], $6, now() + make_interval(secs => $4), now(), now() + make_interval(secs => $5), $8,
           $9
    FROM commit_setting
    ON CONFLICT (tenant, key) DO NOTHING
    RETURNING r.fence, r.fingerprint, r.attempts, r.expires_at
), existing AS (
    SELECT r.fence, r.fingerprint, r.attempts, r.expires_at, r.expires_at <= now() AS expired, r.created_at,
           s.key IS NOT NULL AS completed,
           s.status, s.headers::text AS headers, s.body, s.body_size, s.sealed, s.sealed_with
    FROM {schema}.idempotency_records AS r
    LEFT JOIN {schema}.idempotency_responses AS s ON s.tenant = r.tenant AND s.key = r.key
        AND (s.life = r.created_at OR s.life IS NULL)  -- of this life only (migrations/0006)
    WHERE r.tenant = $1 AND r.key = $2 AND NOT EXISTS (SELECT FROM inserted)
), locked AS MATERIALIZED (  -- a lapsed lease of this request only: an expired record starts a new life
    SELECT r.created_at FROM {schema}.idempotency_records AS r
    WHERE r.tenant = $1 AND r.key = $2 AND r.expires_at > now() AND r.lease_expires_at <= now()
      AND r.fingerprint = ANY ($3) AND NOT EXISTS (SELECT FROM inserted)
    FOR NO KEY UPDATE
), settled AS MATERIALIZED (
    SELECT {schema}.idempotency_settled($1, $2, l.created_at)  -- after the lock
           AND NOT EXISTS (
               SELECT FROM {schema}.idempotency_recovery_points AS p
               WHERE p.tenant = $1 AND p.key = $2 AND p.life = l.created_at
           ) AS since  -- a response or point committed since the snapshot
    FROM locked AS l
), cleared AS (
    -- An expired record starts afresh, without the response of its earlier life.
    DELETE FROM {schema}.idempotency_responses AS s
    WHERE s.tenant = $1 AND s.key = $2 AND EXISTS (SELECT FROM existing AS e WHERE e.expired)
), updated AS (
    UPDATE {schema}.idempotency_records AS r SET
        fingerprint      = CASE WHEN r.expires_at <= now() THEN ($3::bytea[])[1] ELSE r.fingerprint END,
        fence            = CASE WHEN r.expires_at <= now() OR (NOT e.completed AND r.lease_expires_at <= now() AND r.fingerprint = ANY ($3)) THEN $6 ELSE r.fence END,
        lease_expires_at = CASE WHEN r.expires_at <= now() OR (NOT e.completed AND r.lease_expires_at <= now() AND r.fingerprint = ANY ($3)) THEN now() + make_interval(secs => $4) ELSE r.lease_expires_at END,
        created_at       = CASE WHEN r.expires_at <= now() THEN now() ELSE r.created_at END,
        expires_at       = CASE WHEN r.expires_at <= now() THEN now() + make_interval(secs => $5)
                                WHEN NOT e.completed AND r.lease_expires_at <= now() AND r.fingerprint = ANY ($3) THEN GREATEST(r.expires_at, now() + make_interval(secs => $4))
                                ELSE r.expires_at END,
        attempts         = CASE WHEN r.expires_at <= now() THEN 0 ELSE r.attempts + 1 END,
        request          = CASE WHEN r.expires_at <= now() THEN $8 ELSE r.request END,
        request_parts    = CASE WHEN r.expires_at <= now() THEN $9 ELSE r.request_parts END
    FROM existing AS e
    WHERE r.tenant = $1 AND r.key = $2
      AND NOT ((e.completed OR EXISTS (SELECT FROM settled AS l WHERE l.since))
               AND r.fingerprint = ANY ($3) AND r.expires_at > now())
    RETURNING r.fence, r.fingerprint, r.attempts, r.expires_at, r.lease_expires_at IS NULL AS ended,
              e.completed, e.status, e.headers, e.body, e.body_size, e.sealed, e.sealed_with,
              e.fence AS previous_fence, r.request_parts, r.created_at
), woken AS (
    -- A lapsed lease taken over: requests that wait for the claim that lapsed (on_conflict="wait", _waiting.py) are
    -- told, and wait for this one instead. The attempts count this request: above 1, another one came.
    SELECT pg_notify('idempotency_mw_settled', '{schema_name}:' || u.previous_fence)
    FROM updated AS u
    WHERE u.fence = $6 AND u.previous_fence <> $6 AND u.attempts > 1
), found AS (
    SELECT i.fence, i.fingerprint, i.attempts, i.expires_at, false AS completed,
           NULL::smallint AS status, NULL::text AS headers, NULL::bytea AS body, NULL::bigint AS body_size,
           NULL::bytea AS sealed, NULL::text AS sealed_with, NULL::bytea AS request_parts, NULL::timestamptz AS life
    FROM inserted AS i
    UNION ALL
    SELECT u.fence, u.fingerprint, u.attempts, u.expires_at, u.completed AND u.fence <> $6, u.status, u.headers, u.body,
           u.body_size, u.sealed, u.sealed_with, u.request_parts, u.created_at
    FROM updated AS u
    WHERE u.fence = $6 OR u.completed OR NOT u.ended  -- ended, but not completed in the snapshot: a race
    UNION ALL
    SELECT e.fence, e.fingerprint, e.attempts, e.expires_at, true, e.status, e.headers, e.body, e.body_size, e.sealed,
           e.sealed_with, NULL, e.created_at
    FROM existing AS e
    WHERE NOT EXISTS (SELECT FROM updated) AND e.completed AND NOT e.expired AND e.fingerprint = ANY ($3)
)
SELECT
    -- Ours if it carries the fence just drawn and has no response: a completed record whose fence equals the one
    -- drawn (one chance in 2^63) must replay, never run again.
    f.fence = $6 AND NOT f.completed AS owned,
    f.completed,
    f.fingerprint = ANY ($3) AS same_request,
    f.attempts,
    CASE WHEN f.completed AND f.fingerprint = ANY ($3) THEN f.status END AS status,
    CASE WHEN f.completed AND f.fingerprint = ANY ($3) THEN f.headers END AS headers,
    CASE WHEN f.completed AND f.fingerprint = ANY ($3) THEN f.body END AS body,
    CASE WHEN f.completed AND f.fingerprint = ANY ($3) THEN f.body_size END AS body_size,
    CASE WHEN f.completed AND f.fingerprint = ANY ($3) THEN f.sealed END AS sealed,
    CASE WHEN f.completed AND f.fingerprint = ANY ($3) THEN f.sealed_with END AS sealed_with,
    f.fence,
    CASE WHEN length(f.fingerprint) = 32 AND f.fingerprint <> ALL ($3) THEN f.fingerprint END AS unkeyed,
    extract(epoch FROM f.expires_at)::float8 AS expires_at,  -- read by the store for a claim it owns or replays
    CASE WHEN f.fingerprint <> ALL ($3)
          AND substring(f.request_parts FOR 8) = substring(f.fingerprint FROM length(f.fingerprint) - 7)
         THEN f.request_parts END AS parts,
    CASE WHEN f.completed AND f.fingerprint = ANY ($3) THEN f.life END AS life  -- a replay's, for its count
FROM found AS f, (SELECT count(*) FROM woken) AS notified;  -- a SELECT in WITH runs only where it is read

-- name: claim_locked
-- The claim in one INSERT … ON CONFLICT DO UPDATE, for when ``claim_or_take_over`` returned nothing usable (a race
-- with a concurrent claim or completion, see above): DO UPDATE locks and returns the current row even when it was
-- committed after this statement's snapshot, so it always answers. It writes the record row in every case, a
-- replay too (without counting it). A response is read from this statement's snapshot, taken after the others'.
-- $1 to $9 as for claim
WITH commit_setting AS MATERIALIZED (
    SELECT set_config('synchronous_commit', coalesce($7::text, current_setting('synchronous_commit')), true)
), cleared AS (
    DELETE FROM {schema}.idempotency_responses AS s
    USING {schema}.idempotency_records AS r
    WHERE s.tenant = $1 AND s.key = $2 AND r.tenant = $1 AND r.key = $2 AND r.expires_at <= now()
), response AS (
    SELECT s.status, s.headers::text AS headers, s.body, s.body_size, s.sealed, s.sealed_with
    FROM {schema}.idempotency_responses AS s
    JOIN {schema}.idempotency_records AS r ON r.tenant = s.tenant AND r.key = s.key
    WHERE s.tenant = $1 AND s.key = $2 AND (s.life = r.created_at OR s.life IS NULL)  -- of its life (0006)
), claimed AS (
    INSERT INTO {schema}.idempotency_records AS r
        (tenant, key, fingerprint, fence, lease_expires_at, created_at, expires_at, request, request_parts)
    SELECT $1, $2, ($3::bytea[])[1], $6, now() + make_interval(secs => $4), now(), now() + make_interval(secs => $5), $8,
           $9
    FROM commit_setting
    ON CONFLICT (tenant, key) DO UPDATE SET
        fingerprint      = CASE WHEN r.expires_at <= now() THEN excluded.fingerprint ELSE r.fingerprint END,
        fence            = CASE WHEN r.expires_at <= now() OR (NOT EXISTS (SELECT FROM response) AND r.lease_expires_at <= now() AND r.fingerprint = ANY ($3)) THEN excluded.fence ELSE r.fence END,
        lease_expires_at = CASE WHEN r.expires_at <= now() OR (NOT EXISTS (SELECT FROM response) AND r.lease_expires_at <= now() AND r.fingerprint = ANY ($3)) THEN excluded.lease_expires_at ELSE r.lease_expires_at END,
        created_at       = CASE WHEN r.expires_at <= now() THEN excluded.created_at ELSE r.created_at END,
        expires_at       = CASE WHEN r.expires_at <= now() THEN excluded.expires_at
                                WHEN NOT EXISTS (SELECT FROM response) AND r.lease_expires_at <= now() AND r.fingerprint = ANY ($3) THEN GREATEST(r.expires_at, excluded.lease_expires_at)
                                ELSE r.expires_at END,
        attempts         = CASE WHEN r.expires_at <= now() THEN 0
                                WHEN EXISTS (SELECT FROM response) AND r.fingerprint = ANY ($3) THEN r.attempts
                                ELSE r.attempts + 1 END,
        request          = CASE WHEN r.expires_at <= now() THEN excluded.request ELSE r.request END,
        request_parts    = CASE WHEN r.expires_at <= now() THEN excluded.request_parts ELSE r.request_parts END
    RETURNING r.fence, r.fingerprint, r.attempts, r.expires_at, r.request_parts, r.created_at
)
SELECT
    c.fence = $6 AS owned,
    c.fence <> $6 AND s.body_size IS NOT NULL AS completed,  -- body_size: the column every stored response has
    c.fingerprint = ANY ($3) AS same_request,
    c.attempts,
    CASE WHEN c.fence <> $6 AND c.fingerprint = ANY ($3) THEN s.status END AS status,
    CASE WHEN c.fence <> $6 AND c.fingerprint = ANY ($3) THEN s.headers END AS headers,
    CASE WHEN c.fence <> $6 AND c.fingerprint = ANY ($3) THEN s.body END AS body,
    CASE WHEN c.fence <> $6 AND c.fingerprint = ANY ($3) THEN s.body_size END AS body_size,
    CASE WHEN c.fence <> $6 AND c.fingerprint = ANY ($3) THEN s.sealed END AS sealed,
    CASE WHEN c.fence <> $6 AND c.fingerprint = ANY ($3) THEN s.sealed_with END AS sealed_with,
    c.fence,
    CASE WHEN length(c.fingerprint) = 32 AND c.fingerprint <> ALL ($3) THEN c.fingerprint END AS unkeyed,
    extract(epoch FROM c.expires_at)::float8 AS expires_at,
    CASE WHEN c.fingerprint <> ALL ($3)
          AND substring(c.request_parts FOR 8) = substring(c.fingerprint FROM length(c.fingerprint) - 7)
         THEN c.request_parts END AS parts,
    CASE WHEN c.fence <> $6 AND c.fingerprint = ANY ($3) THEN c.created_at END AS life  -- a replay's, for its count
FROM claimed AS c LEFT JOIN response AS s ON true;

-- name: renew
-- A record never expires under a live lease: expires_at is moved to the new lease deadline when that is later
-- (a handler running past its ttl), or the claim statement and the purge would treat a running request's record
-- as expired, and a retry would run the handler a second time beside it. claim keeps the same rule ($5 is at
-- least $4, and a takeover moves expires_at like this). Unchanged, the indexed column keeps the update HOT.
-- A completion by the store ends the lease (NULL); one in a handler's transaction leaves it, and a renewal of a
-- completed record changes nothing that matters.
-- $1 tenant, $2 key, $3 fence, $4 lease seconds
UPDATE {schema}.idempotency_records
SET lease_expires_at = now() + make_interval(secs => $4),
    expires_at = GREATEST(expires_at, now() + make_interval(secs => $4))
WHERE tenant = $1 AND key = $2 AND fence = $3 AND lease_expires_at IS NOT NULL;

-- name: complete
-- The completion of a request whose effect is outside the database. It ends the lease on the record row in the
-- same statement, so a concurrent claim that would take a lapsed lease over waits for it and then finds the lease
-- ended; a response that exists already (a handler's transaction that completed the record first) is kept. The
-- response is of the record's life (migrations/0006): one of an earlier life, which a completion that raced a
-- takeover can leave (see complete_in_transaction), is replaced, and no read ever takes it for this life's.
-- A record that had duplicates (attempts) may have waiters in other processes (_waiting.py, _listener.py): it notifies them, as it
-- commits, naming the claim by its fence, a random number that means nothing outside the store (LISTEN needs no
-- privilege). One without costs nothing (a notification takes a lock as it commits).
-- $1 tenant, $2 key, $3 fence, $4 status, $5 headers (JSON text, store.py encode_headers), $6 body (NULL when
-- over the cap), $7 body size, $8 the sealed response and $9 the id of its key (a store with a cipher: then $4, $5
-- and $6 are NULL)
WITH owned AS (
    UPDATE {schema}.idempotency_records AS r
    SET lease_expires_at = NULL
    WHERE r.tenant = $1 AND r.key = $2 AND r.fence = $3 AND r.lease_expires_at IS NOT NULL
    RETURNING r.tenant, r.key, r.attempts, r.created_at
)
INSERT INTO {schema}.idempotency_responses AS s
    (tenant, key, fence, status, headers, body, body_size, sealed, sealed_with, completed_at, life)
SELECT r.tenant, r.key, $3, $4, $5::text::jsonb, $6, $7, $8, $9, now(), r.created_at
FROM owned AS r, LATERAL (
    SELECT CASE WHEN r.attempts > 0 THEN pg_notify('idempotency_mw_settled', '{schema_name}:' || $3) END
) AS notified
ON CONFLICT (tenant, key) DO UPDATE
    SET fence = excluded.fence, status = excluded.status, headers = excluded.headers, body = excluded.body,
        body_size = excluded.body_size, sealed = excluded.sealed, sealed_with = excluded.sealed_with,
        completed_at = excluded.completed_at, life = excluded.life
    WHERE s.life < excluded.life;

-- name: complete_in_transaction
-- The completion in a transactional handler's transaction, which commits it with the handler's writes. It reads
-- the record row and inserts the response, and writes nothing that renewals or duplicates write meanwhile, so it
-- holds under any isolation level. It locks the row FOR KEY SHARE (the lock a foreign key's check takes, which
-- renewals and duplicates' updates do not wait for): no purge, release or forget deletes the record until the
-- transaction ends (the purge passes it over), and one that deleted it first leaves no row here under READ
-- COMMITTED, or fails the transaction under REPEATABLE READ and SERIALIZABLE (a serialization failure). Under READ
-- COMMITTED a claim that took the key over is seen (no row: fenced out); under REPEATABLE READ and SERIALIZABLE the
-- snapshot may predate the takeover, and then of the two claims the first to commit its response wins: the other's
-- insert meets the primary key and its whole transaction rolls back. A takeover of an expired record starts a new
-- life (created_at): a response of the earlier life written after it is never read for the new one, which
-- replaces it when it completes (see complete), and goes with the record when it is purged or released.
-- It notifies no waiter: the attempts it could read are those of its snapshot, which under REPEATABLE READ predates
-- every duplicate. The waiters hear of it after the COMMIT (notify_waiters).
-- A transaction marked as it began (session.sql, mark_transaction) gets the response only while the mark is there:
-- a handler that ended it and began another on the same connection (ROLLBACK; BEGIN, COMMIT AND CHAIN) leaves the
-- connection in a transaction, but not in this one, and the completion then writes nothing (the store asks why:
-- transaction_ended). Every transaction the store lends is marked (a SQLAlchemyStore's by its first statement, right
-- after SQLAlchemy's BEGIN); $10 false is for a transaction the store did not begin (benchmarks/durableapp.py).
-- $1 tenant, $2 key, $3 fence, $4 status, $5 headers (JSON text), $6 body (NULL when over the cap), $7 body size,
-- $8 the sealed response and $9 the id of its key (see complete), $10 whether the transaction was marked
INSERT INTO {schema}.idempotency_responses AS s
    (tenant, key, fence, status, headers, body, body_size, sealed, sealed_with, completed_at, life)
SELECT r.tenant, r.key, $3, $4, $5::text::jsonb, $6, $7, $8, $9, now(), r.created_at
FROM {schema}.idempotency_records AS r
WHERE r.tenant = $1 AND r.key = $2 AND r.fence = $3 AND r.lease_expires_at IS NOT NULL
  AND (NOT $10::boolean OR current_setting('idempotency_mw.transaction', true) = 'begun')
FOR KEY SHARE
ON CONFLICT (tenant, key) DO UPDATE
    SET fence = excluded.fence, status = excluded.status, headers = excluded.headers, body = excluded.body,
        body_size = excluded.body_size, sealed = excluded.sealed, sealed_with = excluded.sealed_with,
        completed_at = excluded.completed_at, life = excluded.life
    WHERE s.life < excluded.life;

-- name: release
-- A record with a response is never released, nor one at a recovery point (a step of its request committed,
-- migrations/0005): its retry resumes from there (see lapse). The record row is locked first, waiting for a
-- completion or a step still in its transaction (they hold it FOR KEY SHARE), and only then does
-- idempotency_settled look for this life's response or point, with a snapshot of its own (migrations/0006): one
-- that committed while this statement waited, or in the moment before, is seen, and the record stays (the store
-- answers False), as the foreign key's check used to make sure. Responses, points and replay counts of the key's
-- earlier lives go with it. Waiters of a record that had duplicates are notified, as for a completion: one of them
-- claims the key afresh. So are they when the record stays because it completed: under REPEATABLE READ an original
-- whose snapshot predates this claim's takeover can complete first (complete_in_transaction), and its notice may go
-- to the fence it had, while the waiters follow this claim's.
-- $1 tenant, $2 key, $3 fence
WITH locked AS MATERIALIZED (
    SELECT r.created_at, r.attempts FROM {schema}.idempotency_records AS r
    WHERE r.tenant = $1 AND r.key = $2 AND r.fence = $3 AND r.lease_expires_at IS NOT NULL
    FOR UPDATE
), released AS (
    DELETE FROM {schema}.idempotency_records AS r
    WHERE r.tenant = $1 AND r.key = $2 AND r.fence = $3 AND r.lease_expires_at IS NOT NULL
      AND r.created_at = (SELECT l.created_at FROM locked AS l)
      AND NOT {schema}.idempotency_settled($1, $2, (SELECT l.created_at FROM locked AS l))  -- after the lock
    RETURNING r.attempts
), responses AS (
    DELETE FROM {schema}.idempotency_responses AS s
    WHERE s.tenant = $1 AND s.key = $2 AND EXISTS (SELECT FROM released)
), points AS (
    DELETE FROM {schema}.idempotency_recovery_points AS p
    WHERE p.tenant = $1 AND p.key = $2 AND EXISTS (SELECT FROM released)
), replays AS (
    DELETE FROM {schema}.idempotency_replays AS c
    WHERE c.tenant = $1 AND c.key = $2 AND EXISTS (SELECT FROM released)
), kept AS (
    SELECT pg_notify('idempotency_mw_settled', '{schema_name}:' || $3)
    FROM locked AS l
    WHERE l.attempts > 0 AND NOT EXISTS (SELECT FROM released)
)
SELECT count(*) AS released
FROM released AS r, LATERAL (
    SELECT CASE WHEN r.attempts > 0 THEN pg_notify('idempotency_mw_settled', '{schema_name}:' || $3) END
) AS notified, (SELECT count(*) FROM kept) AS told;  -- a SELECT in WITH runs only where it is read

-- name: notify_waiters
-- After a transactional request's COMMIT, the waiters of its record in other processes are told (_listener.py), if
-- it had duplicates by then: read after the commit, whatever the isolation level, so that no duplicate counted
-- before it is missed; one counted after it claims again after it and finds the completion. It runs with the
-- reset of the connection the handler was lent, in one simple query (Records.notice): prepared on the store's own
-- connections when first lent, and run there with EXECUTE, since planning it anew cost the server about 90 us a
-- request (benchmarks/results/tail.md); elsewhere with its values written in. The functions it calls are named
-- with their schema, so a handler's search_path cannot put another pg_notify in their place.
-- The record's current fence is told too: under REPEATABLE READ a completion whose snapshot predates a takeover
-- can commit first (complete_in_transaction), and the waiters then follow the taker's claim. (A notification sent
-- twice in a transaction is delivered once.)
-- $1 tenant, $2 key, $3 fence
SELECT pg_catalog.pg_notify('idempotency_mw_settled', '{schema_name}:' || f.fence)
FROM {schema}.idempotency_records AS r, LATERAL (VALUES ($3::bigint), (r.fence)) AS f (fence)
WHERE r.tenant = $1 AND r.key = $2 AND r.attempts > 0;

-- name: committed
-- Whether a transactional request's completion committed: asked only after an error in the round trip of its
-- COMMIT, which also carries the connection's reset (a failed reset after a COMMIT that went through).
-- $1 tenant, $2 key, $3 fence
SELECT EXISTS (
    SELECT FROM {schema}.idempotency_responses WHERE tenant = $1 AND key = $2 AND fence = $3
) AS committed;

-- name: forget
-- The record with its responses, recovery points and replay count, of every life; its fence, if there was one.
-- Waiters of a record that had duplicates are notified, as for a release: they claim afresh now, not at the end of
-- their wait (in a handler's transaction, once it commits).
-- $1 tenant, $2 key
WITH response AS (
    DELETE FROM {schema}.idempotency_responses WHERE tenant = $1 AND key = $2
), points AS (
    DELETE FROM {schema}.idempotency_recovery_points WHERE tenant = $1 AND key = $2
), replays AS (
    DELETE FROM {schema}.idempotency_replays WHERE tenant = $1 AND key = $2
), forgotten AS (
    DELETE FROM {schema}.idempotency_records WHERE tenant = $1 AND key = $2
    RETURNING fence, attempts
)
SELECT f.fence
FROM forgotten AS f, LATERAL (
    SELECT CASE WHEN f.attempts > 0 THEN pg_notify('idempotency_mw_settled', '{schema_name}:' || f.fence) END
) AS notified;

-- name: inspect
-- last_step: the last recovery point of the record's life (migrations/0005), for a request whose handler runs in
-- steps; NULL for any other.
-- A completed record has no lease, though one completed in a handler's transaction keeps its last value in the row.
-- $1 tenant, $2 key
SELECT r.tenant, r.key, CASE WHEN s.key IS NULL THEN 'in_progress' ELSE 'completed' END AS state, r.fence,
       r.fingerprint, r.attempts,
       extract(epoch FROM r.created_at)::float8 AS created_at,
       extract(epoch FROM r.expires_at)::float8 AS expires_at,
       CASE WHEN s.key IS NULL THEN extract(epoch FROM r.lease_expires_at)::float8 END AS lease_expires_at,
       s.status, s.headers::text AS headers, s.body, s.body_size, s.sealed, s.sealed_with,
       r.request, coalesce(c.replays, 0) AS replays, extract(epoch FROM c.last_replayed_at)::float8 AS last_replayed_at,
       (SELECT p.step || CASE WHEN p.done THEN '' ELSE ' (began, outcome unknown)' END
        FROM {schema}.idempotency_recovery_points AS p
        WHERE p.tenant = r.tenant AND p.key = r.key AND p.life = r.created_at
        ORDER BY p.position DESC LIMIT 1) AS last_step,
       CASE WHEN substring(r.request_parts FOR 8) = substring(r.fingerprint FROM length(r.fingerprint) - 7)
            THEN r.request_parts END AS request_parts  -- only parts written with its fingerprint (see claim)
FROM {schema}.idempotency_records AS r
LEFT JOIN {schema}.idempotency_responses AS s ON s.tenant = r.tenant AND s.key = r.key
    AND (s.life = r.created_at OR s.life IS NULL)  -- of this life only (migrations/0006)
LEFT JOIN {schema}.idempotency_replays AS c ON c.tenant = r.tenant AND c.key = r.key AND c.life = r.created_at
WHERE r.tenant = $1 AND r.key = $2;

-- name: count_replays
-- The replays counted in memory since the last batch (_records.py, Replays), written in one statement: a replay
-- itself writes nothing. The last replay's time is this batch's, within the store's interval (REPLAYS_EVERY) of it.
-- Each count is of the life of the record it replayed (the claim returned it): one that expired or was forgotten and
-- claimed afresh since gets none of them, and a row of an earlier life starts again from these (migrations/0007),
-- while a batch of an earlier life never overwrites a later one's. Only a record still live gets them. The records
-- are only read. Rows are written in key order, so two stores' batches of the same keys take their locks in one
-- order and never deadlock. A record purged while its batch runs can leave its row behind: never read (no life
-- matches it), deleted with the key's next life. A count saturates at the column's largest value.
-- $1 tenants, $2 keys, $3 lives, $4 counts, one element per record life
INSERT INTO {schema}.idempotency_replays AS c (tenant, key, life, replays, last_replayed_at)
SELECT r.tenant, r.key, r.created_at, n.replays, now()
FROM unnest($1::text[], $2::text[], $3::timestamptz[], $4::int[]) AS n (tenant, key, life, replays)
JOIN {schema}.idempotency_records AS r
    ON r.tenant = n.tenant AND r.key = n.key AND r.created_at = n.life AND r.expires_at > now()
ORDER BY r.tenant, r.key
ON CONFLICT (tenant, key) DO UPDATE
SET replays = CASE WHEN c.life = excluded.life THEN least(c.replays::bigint + excluded.replays, 2147483647)::int
                   ELSE excluded.replays END,
    life = excluded.life, last_replayed_at = excluded.last_replayed_at
WHERE c.life <= excluded.life;

-- name: tenants_between
-- The tenants with records first claimed in a window, for finding one by the tag the logs show (idempotency-mw
-- list --tag): it reads every record of the window (no index leads with created_at), so keep the window short.
-- $1 since, $2 until (epoch seconds)
SELECT DISTINCT tenant FROM {schema}.idempotency_records
WHERE created_at >= to_timestamp($1) AND created_at < to_timestamp($2);

-- name: list_records
-- One tenant's records first claimed in a window, oldest first, without their bodies (idempotency-mw list); the
-- primary key leads with the tenant, so this reads that tenant's records only.
-- $1 tenant, $2 since, $3 until (epoch seconds), $4 at most this many
SELECT r.key, r.request, CASE WHEN s.key IS NULL THEN 'in_progress' ELSE 'completed' END AS state, r.attempts,
       coalesce(c.replays, 0) AS replays,
       extract(epoch FROM r.created_at)::float8 AS created_at,
       extract(epoch FROM r.expires_at)::float8 AS expires_at,
       s.status, s.sealed_with, s.body_size
FROM {schema}.idempotency_records AS r
LEFT JOIN {schema}.idempotency_responses AS s ON s.tenant = r.tenant AND s.key = r.key
    AND (s.life = r.created_at OR s.life IS NULL)
LEFT JOIN {schema}.idempotency_replays AS c ON c.tenant = r.tenant AND c.key = r.key AND c.life = r.created_at
WHERE r.tenant = $1 AND r.created_at >= to_timestamp($2) AND r.created_at < to_timestamp($3)
ORDER BY r.created_at
LIMIT $4;

-- name: purge_expired
-- Batched so that a large backlog never holds locks for long; the expires_at index finds the batch, and rows locked
-- by live requests are passed over (SKIP LOCKED), a completion or a step still in its transaction too (it holds
-- the record FOR KEY SHARE): the next batch takes them. The responses, recovery points and replay counts of the
-- batch's keys, of every life, go in the same statement, each found through its primary key (one index probe per
-- key: the OFFSET 0 keeps the planner from reading the whole table into a hash instead), and nothing checks each
-- deleted record for rows that refer to it once the foreign keys are gone (migrations/0006, contract/0008).
-- $1 batch size
WITH doomed AS MATERIALIZED (
    SELECT ctid, tenant, key FROM {schema}.idempotency_records WHERE expires_at <= now()
    ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED
), responses AS (
    DELETE FROM {schema}.idempotency_responses
    WHERE ctid = ANY (ARRAY(
        SELECT found.ctid FROM doomed AS d CROSS JOIN LATERAL (
            SELECT s.ctid FROM {schema}.idempotency_responses AS s WHERE s.tenant = d.tenant AND s.key = d.key OFFSET 0
        ) AS found
    ))
), points AS (
    DELETE FROM {schema}.idempotency_recovery_points
    WHERE ctid = ANY (ARRAY(
        SELECT found.ctid FROM doomed AS d CROSS JOIN LATERAL (
            SELECT p.ctid FROM {schema}.idempotency_recovery_points AS p
            WHERE p.tenant = d.tenant AND p.key = d.key OFFSET 0
        ) AS found
    ))
), replays AS (
    DELETE FROM {schema}.idempotency_replays
    WHERE ctid = ANY (ARRAY(
        SELECT found.ctid FROM doomed AS d CROSS JOIN LATERAL (
            SELECT c.ctid FROM {schema}.idempotency_replays AS c WHERE c.tenant = d.tenant AND c.key = d.key OFFSET 0
        ) AS found
    ))
)
DELETE FROM {schema}.idempotency_records
WHERE ctid = ANY (ARRAY(SELECT ctid FROM doomed));

-- name: count_expired
SELECT count(*) FROM {schema}.idempotency_records WHERE expires_at <= now();

-- name: reseal_batch
-- The next responses to re-seal under the current key (idempotency-mw reencrypt): those sealed under another key
-- the cipher has, and with $3 those stored plain, walked in primary-key order from where the last batch ended, so
-- that a run reads the table once however many batches it takes. A response under a key the cipher does not have
-- is passed over (it cannot be opened here). The rows are locked until the batch's transaction commits with their
-- new form (reseal); SKIP LOCKED passes over those another run holds, as the purge does, and a completion or a
-- replay never waits on a row not yet locked. A row passed over stays as it was, for the next run.
-- What is re-sealed is what was locked: a completion may replace a row (a response of the record's earlier life,
-- complete's ON CONFLICT) between this statement's snapshot and its lock, and the lock takes the new version (READ
-- COMMITTED), while a second read of the table would still see the old one and write its bytes back over the new.
-- The batch is bounded by bytes as well as rows: it takes the locked rows, in order, while their sealed (or plain)
-- bodies add up to $7 at most, and always the first, so that neither the rows fetched nor the reseal that writes
-- them back comes near PostgreSQL's 1 GB message limit with responses of several MiB. The locked rows past the bound
-- are left to the next batch, which starts after the last row taken (their bodies stay in the table: a CTE keeps a
-- large value as a pointer to it).
-- locked: how many rows were locked, so that the caller knows a batch cut short by $7 from the end of the table.
-- $1 tenant and $2 key to start from, $3 include that row itself (the first batch), $4 the ids of the cipher's
-- older keys, $5 seal plain responses too, $6 batch size (rows), $7 batch size (bytes)
WITH locked AS (
    SELECT s.tenant, s.key, s.status, s.headers::text AS headers, s.body, s.body_size, s.sealed, s.sealed_with,
           coalesce(octet_length(s.sealed), octet_length(s.body), 0) AS bytes
    FROM {schema}.idempotency_responses AS s
    WHERE (s.tenant, s.key) >= ($1::text, $2::text)
      AND ($3 OR (s.tenant, s.key) <> ($1::text, $2::text))
      AND (s.sealed_with = ANY ($4::text[]) OR ($5 AND s.sealed IS NULL))
    ORDER BY s.tenant, s.key
    LIMIT $6
    FOR UPDATE SKIP LOCKED
), measured AS (
    SELECT l.*, count(*) OVER () AS locked,
           row_number() OVER running AS n, sum(l.bytes) OVER running AS bytes_so_far
    FROM locked AS l
    WINDOW running AS (ORDER BY l.tenant, l.key ROWS UNBOUNDED PRECEDING)
)
SELECT m.tenant, m.key, m.status, m.headers, m.body, m.body_size, m.sealed, m.sealed_with, m.locked
FROM measured AS m
WHERE m.n = 1 OR m.bytes_so_far <= $7
ORDER BY m.tenant, m.key;

-- name: reseal
-- The batch's responses in their new form, in the transaction that locked them (reseal_batch).
-- $1 the current key's id, $2 tenants, $3 keys, $4 the responses sealed under $1
UPDATE {schema}.idempotency_responses AS s
SET status = NULL, headers = NULL, body = NULL, sealed = u.sealed, sealed_with = $1
FROM unnest($2::text[], $3::text[], $4::bytea[]) AS u (tenant, key, sealed)
WHERE s.tenant = u.tenant AND s.key = u.key;

-- name: responses_by_key
-- How many responses are stored under each key (NULL: plain), for reencrypt to report what is left.
SELECT s.sealed_with, count(*) AS responses
FROM {schema}.idempotency_responses AS s
GROUP BY s.sealed_with
ORDER BY s.sealed_with NULLS FIRST;

-- name: live_fingerprints_by_key
-- How many live records hold a fingerprint written under each of the given fingerprint keys, and when the last of
-- them expires: for reencrypt to say which older response key must stay, where the fingerprint keys are derived from
-- the response keys (re-sealing a response never re-keys its record's fingerprint, and a retry whose record's
-- fingerprint is under a key no longer given is another request: a 422). A stored fingerprint is the key's id, ':'
-- and a 32-byte HMAC (_fingerprint.py). It reads every live record: reencrypt's, never on a request's path.
-- $1 the fingerprint key ids
SELECT k.key_id, count(*) AS records, max(r.expires_at) AS expires_at
FROM unnest($1::text[]) AS k (key_id)
JOIN {schema}.idempotency_records AS r
  ON octet_length(r.fingerprint) = octet_length(k.key_id) + 33
 AND substring(r.fingerprint FROM 1 FOR octet_length(k.key_id) + 1) = convert_to(k.key_id || ':', 'UTF8')
WHERE r.expires_at > now()
GROUP BY k.key_id
ORDER BY k.key_id;

-- name: stats
SELECT
    count(*) FILTER (WHERE s.key IS NULL AND r.expires_at > now()) AS in_progress,
    count(*) FILTER (WHERE s.key IS NOT NULL AND r.expires_at > now()) AS completed,
    count(*) FILTER (WHERE r.expires_at <= now()) AS expired,
    count(*) FILTER (WHERE s.key IS NULL AND r.lease_expires_at <= now() AND r.expires_at > now()) AS past_lease,
    extract(epoch FROM now() - min(r.created_at) FILTER (WHERE s.key IS NULL AND r.expires_at > now()))::float8
        AS oldest_in_progress_seconds,
    coalesce(sum(r.attempts), 0)::bigint AS attempts,
    -- requests stopped at a recovery point that nobody resumes (see stalled): read from the recovery points,
    -- which only requests that run in steps have
    (SELECT count(DISTINCT (p.tenant, p.key))
     FROM {schema}.idempotency_recovery_points AS p
     JOIN {schema}.idempotency_records AS q ON q.tenant = p.tenant AND q.key = p.key AND q.created_at = p.life
     WHERE q.lease_expires_at <= now()
       AND NOT EXISTS (
           SELECT FROM {schema}.idempotency_responses AS t
           WHERE t.tenant = p.tenant AND t.key = p.key AND (t.life = q.created_at OR t.life IS NULL)
       )
    ) AS stalled
FROM {schema}.idempotency_records AS r
LEFT JOIN {schema}.idempotency_responses AS s ON s.tenant = r.tenant AND s.key = r.key
    AND (s.life = r.created_at OR s.life IS NULL);

-- name: migrated
-- open() runs this once: a database that was never migrated (or a store pointed at the wrong schema) fails at
-- startup with the command that fixes it, instead of at every request.
-- The newest migrations' table and column are the sign: a schema an older version migrated is refused until migrate
-- runs.
SELECT to_regclass('{schema}.idempotency_replays') IS NOT NULL
   AND to_regprocedure('{schema}.idempotency_settled(text, text, timestamptz)') IS NOT NULL AND EXISTS (
    SELECT FROM pg_attribute
    WHERE attrelid = to_regclass('{schema}.idempotency_responses') AND attname = 'life' AND NOT attisdropped
);

-- name: missing_grants
-- open() runs this once, after migrated: what the store's statements need and the session's role lacks, on each of
-- the store's tables and on idempotency_settled (docs/operations.md, "The runtime role's grants"). A role granted
-- the tables one by one before a migration added one then fails at startup, not in a release or a purge.
SELECT coalesce(array_agg(m.missing ORDER BY m.missing), '{}') AS missing FROM (
    SELECT t.name || ': ' || string_agg(p.privilege, ', ' ORDER BY p.n) AS missing
    FROM (VALUES ('idempotency_records'), ('idempotency_responses'), ('idempotency_recovery_points'),
                 ('idempotency_replays')) AS t (name),
         (VALUES (1, 'SELECT'), (2, 'INSERT'), (3, 'UPDATE'), (4, 'DELETE')) AS p (n, privilege)
    WHERE NOT has_table_privilege('{schema}.' || t.name, p.privilege)
    GROUP BY t.name
    UNION ALL
    SELECT 'idempotency_settled(text, text, timestamptz): EXECUTE'
    WHERE NOT has_function_privilege('{schema}.idempotency_settled(text, text, timestamptz)', 'EXECUTE')
) AS m;

-- name: database_identity
-- SQLAlchemyStore.open() compares this on the store's connection and on the app's engine: the handlers'
-- transactions complete the records, so the engine must reach the store's database (same server, same database).
SELECT current_database() AS database, pg_postmaster_start_time() AS server_started;

-- name: record_steps
-- Recovery points (migrations/0005), in the transaction of a step's writes, which commits them together: the steps
-- a request finished since its last point, each with its result, or the mark that an unrepeatable outside step
-- begins (done false), which its result later replaces in the same claim. Fenced like complete_in_transaction: it
-- reads the record row and writes nothing of it. A claim that took the key over is seen under READ COMMITTED (no
-- row); under REPEATABLE READ and SERIALIZABLE the snapshot may predate the takeover, and then of the two claims the
-- first to commit a step's point wins: the other's insert meets the primary key (a point of that step already
-- there, or being written) and its transaction fails. The store counts the rows: fewer than it sent is fenced out,
-- or, in a marked transaction whose mark is gone, a transaction the handler began after ending the step's (see
-- complete_in_transaction): the points would commit without the step's writes.
-- $1 tenant, $2 key, $3 fence, $4 steps, $5 positions, $6 done, $7 results (JSON text; NULL when sealed or not
-- done), $8 sealed results, $9 the ids of their keys; one element per point; $10 whether the transaction was marked
INSERT INTO {schema}.idempotency_recovery_points AS p
    (tenant, key, life, step, position, done, result, sealed, sealed_with, fence, committed_at)
SELECT r.tenant, r.key, r.created_at, s.step, s.position, s.done, s.result, s.sealed, s.sealed_with, $3, now()
FROM {schema}.idempotency_records AS r,
     unnest($4::text[], $5::int[], $6::bool[], $7::text[], $8::bytea[], $9::text[])
         AS s (step, position, done, result, sealed, sealed_with)
WHERE r.tenant = $1 AND r.key = $2 AND r.fence = $3 AND r.lease_expires_at IS NOT NULL
  AND (NOT $10::boolean OR current_setting('idempotency_mw.transaction', true) = 'begun')
FOR KEY SHARE OF r  -- as complete_in_transaction: no release or purge deletes the record meanwhile
ON CONFLICT (tenant, key, life, step) DO UPDATE
    SET done = true, result = excluded.result, sealed = excluded.sealed, sealed_with = excluded.sealed_with,
        committed_at = excluded.committed_at
    WHERE NOT p.done AND excluded.done AND p.fence = excluded.fence;

-- name: recovery_points
-- The recovery points of the record's current life, in the order they were reached, for a claim that took the key
-- over (a fresh record has none): read in the handler's transaction, before it writes anything.
-- $1 tenant, $2 key, $3 fence
SELECT p.step, p.position, p.done, p.result, p.sealed, p.sealed_with
FROM {schema}.idempotency_recovery_points AS p
JOIN {schema}.idempotency_records AS r ON r.tenant = p.tenant AND r.key = p.key AND r.created_at = p.life
WHERE p.tenant = $1 AND p.key = $2 AND r.fence = $3
ORDER BY p.position;

-- name: lapse
-- A request that stopped at a recovery point (a 5xx, an exception or a cancellation after one of its steps
-- committed) is never released: its lease lapses now, so that the retry takes it over at once and resumes, and
-- requests waiting for it are told, as for a release. Fenced; a completed record is left alone.
-- $1 tenant, $2 key, $3 fence
WITH lapsed AS (
    UPDATE {schema}.idempotency_records AS r SET lease_expires_at = now()
    WHERE r.tenant = $1 AND r.key = $2 AND r.fence = $3 AND r.lease_expires_at IS NOT NULL
      AND NOT EXISTS (
          SELECT FROM {schema}.idempotency_responses AS s
          WHERE s.tenant = $1 AND s.key = $2 AND (s.life = r.created_at OR s.life IS NULL)
      )
    RETURNING r.attempts
)
SELECT count(*) AS lapsed
FROM lapsed AS r, LATERAL (
    SELECT CASE WHEN r.attempts > 0 THEN pg_notify('idempotency_mw_settled', '{schema_name}:' || $3) END
) AS notified;

-- name: stalled
-- Requests stopped at a recovery point that nobody resumes: in progress under a lease that lapsed at least $1
-- seconds ago, with the last step they reached, oldest lapse first (idempotency-mw stalled). Read from the recovery
-- points, which only requests that run in steps have. An expired one is listed too (until the purge removes it):
-- its client can no longer resume it.
-- $1 lapsed at least this many seconds ago, $2 at most this many
SELECT r.tenant, r.key, r.request, last.step AS last_step, last.done AS last_step_done,
       extract(epoch FROM r.created_at)::float8 AS created_at,
       extract(epoch FROM r.lease_expires_at)::float8 AS lapsed_at,
       extract(epoch FROM r.expires_at)::float8 AS expires_at
FROM (SELECT DISTINCT p.tenant, p.key, p.life FROM {schema}.idempotency_recovery_points AS p) AS stepped
JOIN {schema}.idempotency_records AS r
    ON r.tenant = stepped.tenant AND r.key = stepped.key AND r.created_at = stepped.life
JOIN LATERAL (
    SELECT p.step, p.done
    FROM {schema}.idempotency_recovery_points AS p
    WHERE p.tenant = r.tenant AND p.key = r.key AND p.life = r.created_at
    ORDER BY p.position DESC LIMIT 1
) AS last ON true
WHERE r.lease_expires_at <= now() - make_interval(secs => $1)
  AND NOT EXISTS (
      SELECT FROM {schema}.idempotency_responses AS s
      WHERE s.tenant = r.tenant AND s.key = r.key AND (s.life = r.created_at OR s.life IS NULL)
  )
ORDER BY r.lease_expires_at
LIMIT $2;

-- name: reseal_points_batch
-- The next step results (recovery points, migrations/0005) to re-seal under the current key (idempotency-mw
-- reencrypt), as reseal_batch does for responses: those sealed under another key the cipher has, and with $7 those
-- stored plain, walked in primary-key order from where the last batch ended. A point under a key the cipher does not
-- have is passed over, and so is one that began without an outcome (it has no result). The rows are locked until the
-- batch's transaction commits with their new form (reseal_points); SKIP LOCKED passes over those another run holds. A
-- step's commit only inserts points (or fills in one its own claim began, which has no result to re-seal): it never
-- waits for a batch; the claim, forget and purge that delete a record (and its points, ON DELETE CASCADE) wait for one
-- batch at most.
-- $1 tenant, $2 key, $3 life and $4 step to start after, $5 the first batch (start at the beginning), $6 the ids of
-- the cipher's older keys, $7 seal plain results too, $8 batch size
SELECT p.tenant, p.key, p.life, p.step, p.result, p.sealed, p.sealed_with
FROM {schema}.idempotency_recovery_points AS p
WHERE ($5 OR (p.tenant, p.key, p.life, p.step) > ($1::text, $2::text, $3::timestamptz, $4::text))
  AND p.done
  AND (p.sealed_with = ANY ($6::text[]) OR ($7 AND p.sealed IS NULL))
ORDER BY p.tenant, p.key, p.life, p.step
LIMIT $8
FOR UPDATE SKIP LOCKED;

-- name: reseal_points
-- The batch's step results in their new form, in the transaction that locked them (reseal_points_batch).
-- $1 the current key's id, $2 tenants, $3 keys, $4 lives, $5 steps, $6 the results sealed under $1
UPDATE {schema}.idempotency_recovery_points AS p
SET result = NULL, sealed = u.sealed, sealed_with = $1
FROM unnest($2::text[], $3::text[], $4::timestamptz[], $5::text[], $6::bytea[]) AS u (tenant, key, life, step, sealed)
WHERE p.tenant = u.tenant AND p.key = u.key AND p.life = u.life AND p.step = u.step;

-- name: points_by_key
-- How many step results are stored under each key (NULL: plain), for reencrypt to report what is left.
SELECT p.sealed_with, count(*) AS results
FROM {schema}.idempotency_recovery_points AS p
WHERE p.done
GROUP BY p.sealed_with
ORDER BY p.sealed_with NULLS FIRST;
