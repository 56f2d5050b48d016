#!/usr/bin/env bash
# Two databases in one server, each owned by its own role: `airflow` for Airflow's metadata and
# `stream` for results, stored offsets and run state.  The postgres image runs this once, on an empty
# data volume; changing a password later is an ALTER ROLE, not a rerun.
set -eo pipefail

: "${AIRFLOW_DB_PASSWORD:?set AIRFLOW_DB_PASSWORD}"
: "${STREAM_DB_PASSWORD:?set STREAM_DB_PASSWORD}"

# Passwords travel as psql variables and are quoted by psql (:'name'), never pasted into SQL text.
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
    -v airflow_password="$AIRFLOW_DB_PASSWORD" -v stream_password="$STREAM_DB_PASSWORD" <<'SQL'
CREATE ROLE airflow LOGIN PASSWORD :'airflow_password';
CREATE DATABASE airflow OWNER airflow;
CREATE ROLE stream LOGIN PASSWORD :'stream_password';
CREATE DATABASE stream OWNER stream;
SQL
