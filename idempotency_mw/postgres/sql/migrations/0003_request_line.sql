-- What inspect and list show of a record besides its key: the request (its method and route template). Expand
-- only: the previous version's statements name their columns and leave this one NULL, so it runs beside this one
-- during a rolling deploy (tests/scenarios/test_rolling_deploy.py). Adding a column without a default rewrites
-- nothing. (How often a record was replayed is kept in a table of its own: 0007.)
ALTER TABLE {schema}.idempotency_records
    ADD COLUMN request text;
