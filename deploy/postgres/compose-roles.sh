#!/bin/sh
# compose.yaml's postgres-roles job: roles.sql as the superuser (PGHOST, PGUSER, PGPASSWORD from
# the environment), with the two roles' passwords from the environment (POSTGRES_MIGRATE_PASSWORD,
# POSTGRES_APP_PASSWORD). roles.sql reads passwords from files, so they go to private files first.
# It makes the database (CONSUMER_DATABASE_NAME, consumer) owned by consumer_migrate. Safe to run
# on every `up`.
set -eu

: "${POSTGRES_MIGRATE_PASSWORD:?is not set}" "${POSTGRES_APP_PASSWORD:?is not set}"
here=$(dirname "$0")
umask 077
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

printf '%s' "$POSTGRES_MIGRATE_PASSWORD" >"$work/migrate"
printf '%s' "$POSTGRES_APP_PASSWORD" >"$work/app"
psql -X -q -v ON_ERROR_STOP=1 -v database="${CONSUMER_DATABASE_NAME:-consumer}" \
    -v migrate_password_file="$work/migrate" -v app_password_file="$work/app" \
    -f "$here/roles.sql"
echo "roles consumer_migrate and consumer_app, database ${CONSUMER_DATABASE_NAME:-consumer}: ready"
