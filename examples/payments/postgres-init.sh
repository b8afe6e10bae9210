#!/usr/bin/env bash
# Two roles for the payments example, so that neither the app nor its migrations run as the superuser. The
# postgres image runs this once, as the superuser, when it initialises an empty data directory (mounted into
# /docker-entrypoint-initdb.d by docker-compose.yml):
#
#   payments_owner  owns the database and everything in it; only the one-shot migrate service logs in as it
#   payments_app    what the app logs in as: it may read and write rows, and create or alter nothing
#
# Tables and sequences the owner creates later (the idempotency table, the payments schema) are granted to the
# app by the default privileges set here. Passwords come from PAYMENTS_OWNER_PASSWORD and PAYMENTS_APP_PASSWORD;
# PAYMENTS_OWNER and PAYMENTS_APP rename the roles.
set -euo pipefail

psql -v ON_ERROR_STOP=1 --no-psqlrc --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
    -v db="$POSTGRES_DB" \
    -v owner="${PAYMENTS_OWNER:-payments_owner}" -v owner_password="$PAYMENTS_OWNER_PASSWORD" \
    -v app="${PAYMENTS_APP:-payments_app}" -v app_password="$PAYMENTS_APP_PASSWORD" <<'SQL'
CREATE ROLE :"owner" LOGIN PASSWORD :'owner_password';
CREATE ROLE :"app" LOGIN PASSWORD :'app_password';

-- The owner of the database also owns its public schema (PostgreSQL 15 and later) and may create schemas.
ALTER DATABASE :"db" OWNER TO :"owner";
REVOKE ALL ON DATABASE :"db" FROM PUBLIC;
GRANT CONNECT ON DATABASE :"db" TO :"app";
REVOKE CREATE ON SCHEMA public FROM PUBLIC;  -- already so since PostgreSQL 15
GRANT USAGE ON SCHEMA public TO :"app";

-- Whatever the owner creates from now on, the app may use, and no more.
ALTER DEFAULT PRIVILEGES FOR ROLE :"owner" GRANT USAGE ON SCHEMAS TO :"app";
ALTER DEFAULT PRIVILEGES FOR ROLE :"owner" GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO :"app";
ALTER DEFAULT PRIVILEGES FOR ROLE :"owner" GRANT USAGE, SELECT ON SEQUENCES TO :"app";
SQL
