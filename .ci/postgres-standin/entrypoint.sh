#!/bin/sh
# The official postgres image's contract, in short: initialise $PGDATA once with POSTGRES_USER (password
# POSTGRES_PASSWORD, scram-sha-256 over TCP) and the database POSTGRES_DB, then run the server on every
# interface in the foreground as the postgres user.
set -eu
BIN=$(ls -d /usr/lib/postgresql/*/bin | tail -1)
mkdir -p "$PGDATA" /var/run/postgresql
chown postgres:postgres "$PGDATA" /var/run/postgresql
chmod 700 "$PGDATA"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  password_file=$(mktemp)
  printf '%s' "$POSTGRES_PASSWORD" > "$password_file"
  chown postgres "$password_file"
  runuser -u postgres -- "$BIN/initdb" -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$password_file" \
    --auth-local=trust --auth-host=scram-sha-256 >/dev/null
  rm -f "$password_file"
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  runuser -u postgres -- "$BIN/pg_ctl" -D "$PGDATA" -w -o "-c listen_addresses=''" start >/dev/null
  runuser -u postgres -- "$BIN/createdb" -U "$POSTGRES_USER" "$POSTGRES_DB"
  runuser -u postgres -- "$BIN/pg_ctl" -D "$PGDATA" -w stop >/dev/null
fi
exec runuser -u postgres -- "$BIN/postgres" -D "$PGDATA" -c listen_addresses='*'
