-- What inspect shows of a record besides its key: the request (its method and route template) and how often it
-- was replayed, the last time when. Replays are counted in memory and written in batches (_records.py, Replays), so
-- a replay itself still writes nothing. Expand only: the previous version's statements name their columns and
-- leave these to their defaults, so it runs beside this one during a rolling deploy
-- (tests/scenarios/test_rolling_deploy.py). Adding columns without a volatile default rewrites nothing.
ALTER TABLE {schema}.idempotency_records
    ADD COLUMN request           text,
    ADD COLUMN replays           integer     NOT NULL DEFAULT 0,
    ADD COLUMN last_replayed_at  timestamptz;
