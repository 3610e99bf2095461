# Shared shell functions for team mode (sourced by start_mlflow_postgres.sh and ci_team_mode.sh).
#
# Why a library: the CI check and the long-running team scripts must start PostgreSQL and the
# MLflow server the same way, or the CI check proves nothing about what people run.
# Everything binds to loopback unless the caller passes another host on purpose.

a3po_log() { echo "[$(date +%H:%M:%S)] $*" >&2; }

a3po_free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

# Directory of PostgreSQL's server binaries (initdb, pg_ctl, postgres), newest version.
a3po_pg_bin() {
  local d
  if command -v pg_config >/dev/null 2>&1 && [ -x "$(pg_config --bindir)/pg_ctl" ]; then
    pg_config --bindir; return
  fi
  d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
  if [ -n "$d" ]; then echo "$d"; fi
}

# Install PostgreSQL with apt-get when its binaries are missing (CI machines; needs root).
a3po_pg_ensure_installed() {
  if [ -z "$(a3po_pg_bin)" ]; then
    a3po_log "installing postgresql with apt-get"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
  fi
  [ -n "$(a3po_pg_bin)" ] || { a3po_log "PostgreSQL binaries not found"; return 1; }
}

# PostgreSQL refuses to run as root: run its tools as the 'postgres' user when we are root.
a3po_as_pg() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

# a3po_pg_start DATA_DIR PORT USER PASSWORD DB
# Initialise the cluster if needed (password auth on TCP, loopback only), start it, create the
# role and database if missing.
a3po_pg_start() {
  local data=$1 port=$2 user=$3 password=$4 db=$5 bin
  bin=$(a3po_pg_bin)
  mkdir -p "$data"
  if [ "$(id -u)" = 0 ]; then chown postgres:postgres "$data"; fi
  chmod 700 "$data"
  if [ ! -f "$data/PG_VERSION" ]; then
    a3po_log "initdb $data"
    local pw; pw=$(mktemp); echo "$password" >"$pw"
    if [ "$(id -u)" = 0 ]; then chown postgres "$pw"; fi
    a3po_as_pg "$bin/initdb" -D "$data" -U postgres --auth-local=trust --auth-host=scram-sha-256 --pwfile="$pw" >/dev/null
    rm -f "$pw"
  fi
  a3po_log "starting PostgreSQL on 127.0.0.1:$port"
  a3po_as_pg "$bin/pg_ctl" -D "$data" -l "$data/server.log" -w -t 60 \
    -o "-c listen_addresses=127.0.0.1 -p $port -k $data" start >/dev/null
  local psql=(env PGPASSWORD="$password" "$bin/psql" -h 127.0.0.1 -p "$port" -U postgres -v ON_ERROR_STOP=1 -qtA)
  if [ "$("${psql[@]}" -c "select 1 from pg_roles where rolname='$user'")" != 1 ]; then
    "${psql[@]}" -c "create role $user login password '$password'"
  fi
  if [ "$("${psql[@]}" -c "select 1 from pg_database where datname='$db'")" != 1 ]; then
    "${psql[@]}" -c "create database $db owner $user"
  fi
}

a3po_pg_stop() {
  local data=$1
  if [ -f "$data/postmaster.pid" ]; then a3po_as_pg "$(a3po_pg_bin)/pg_ctl" -D "$data" -m fast -w stop >/dev/null || true; fi
}

# a3po_wait_http URL TIMEOUT_S: poll until the URL answers 200.
a3po_wait_http() {
  local url=$1 timeout=${2:-120} t=0
  until python3 -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('$url', timeout=5).status != 200)" 2>/dev/null; do
    sleep 1; t=$((t + 1))
    if [ "$t" -ge "$timeout" ]; then a3po_log "timed out waiting for $url"; return 1; fi
  done
  return 0
}

# Install the PostgreSQL driver MLflow needs (the 'team' extra) when missing.
a3po_ensure_psycopg2() {
  python -c "import psycopg2" 2>/dev/null || python -m pip install -q "psycopg2-binary>=2.9"
}
