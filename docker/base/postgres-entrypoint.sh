#!/bin/sh
# First start: initdb with POSTGRES_USER as the superuser (password POSTGRES_PASSWORD, required),
# then POSTGRES_DB; every start: postgres listening on all interfaces, password auth off loopback.
set -eu
if [ "${1:-}" != postgres ]; then exec "$@"; fi
shift
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  : "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD (the superuser password)}"
  user=${POSTGRES_USER:-postgres}
  db=${POSTGRES_DB:-$user}
  pwfile=$(mktemp)
  printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
  initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" -E UTF8 --locale=C.UTF-8 \
    --auth-local=trust --auth-host=scram-sha-256 >/dev/null
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  if [ "$db" != postgres ]; then
    echo "CREATE DATABASE \"$db\" OWNER \"$user\";" | postgres --single -D "$PGDATA" -j postgres >/dev/null
  fi
  echo "flywheel-postgres: initialised $PGDATA (superuser $user, database $db)"
fi
exec postgres -D "$PGDATA" -c listen_addresses='*' "$@"
