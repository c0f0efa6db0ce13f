#!/usr/bin/env bash
# Debian's PostgreSQL server binaries (initdb, pg_ctl, postgres), which the job-store tests start a
# throwaway server from (tests/api/postgres_server.py); `make test` runs this first. Nothing is done where
# they are installed already.
set -euo pipefail
if command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  exit 0
fi
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
echo "installing Debian's postgresql (the job-store tests start a server from it)"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends postgresql >/dev/null
