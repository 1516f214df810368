#!/bin/sh
# Initialises $PGDATA on first start (superuser $POSTGRES_USER with $POSTGRES_PASSWORD, database $POSTGRES_DB),
# then runs the server in the foreground as the postgres user, listening on every address.
set -eu
mkdir -p "$PGDATA" /run/postgresql
chown -R postgres:postgres "$PGDATA" /run/postgresql
chmod 700 "$PGDATA"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  printf '%s' "$POSTGRES_PASSWORD" > /tmp/pwfile
  chown postgres /tmp/pwfile
  su postgres -c "initdb -D '$PGDATA' -U '$POSTGRES_USER' --pwfile=/tmp/pwfile --auth-local=trust --auth-host=scram-sha-256"
  rm /tmp/pwfile
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  su postgres -c "pg_ctl -D '$PGDATA' -o '-c listen_addresses=' -w start"
  su postgres -c "psql -U '$POSTGRES_USER' -d postgres -c 'CREATE DATABASE \"$POSTGRES_DB\"'"
  su postgres -c "pg_ctl -D '$PGDATA' -m fast -w stop"
fi
exec su postgres -c "exec postgres -D '$PGDATA' -c listen_addresses='*'"
