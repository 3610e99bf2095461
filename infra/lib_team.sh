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

# ---------------------------------------------------------------- credentials
# No default passwords, no secrets on command lines (`ps -eo args` shows every process's argv):
# - the application role's password is generated once per install into TEAM_DIR/secrets/pg_password
#   (0600, in a 0700 folder) and reused on later starts; A3PO_PG_PASSWORD_FILE names your own file;
# - clients read it through a libpq password file (PGPASSFILE), never from a URI or an argument;
# - the PostgreSQL superuser has no password at all: admin work goes over the unix socket, in the
#   0700 data folder, so only this OS user (and root) can reach it.

# a3po_pg_password_file TEAM_DIR: print the path of the role's password file, creating it if needed.
a3po_pg_password_file() {
  local team=$1 file
  if [ -n "${A3PO_PG_PASSWORD:-}" ]; then
    a3po_log "A3PO_PG_PASSWORD is no longer read (an environment default leaks into shells and logs);"
    a3po_log "put the password in a file (chmod 600) and set A3PO_PG_PASSWORD_FILE to its path"
    return 1
  fi
  if [ -n "${A3PO_PG_PASSWORD_FILE:-}" ]; then
    file=$A3PO_PG_PASSWORD_FILE
    [ -s "$file" ] || { a3po_log "A3PO_PG_PASSWORD_FILE=$file: missing or empty"; return 1; }
    if [ -n "$(find "$file" -perm /077 2>/dev/null)" ]; then
      a3po_log "A3PO_PG_PASSWORD_FILE=$file is readable by others: chmod 600 it"; return 1
    fi
    echo "$file"; return 0
  fi
  file=$team/secrets/pg_password
  if [ ! -s "$file" ]; then
    (umask 077 && mkdir -p "$team/secrets" && chmod 700 "$team/secrets" \
      && python3 -c 'import secrets; print(secrets.token_urlsafe(24))' >"$file.tmp" && mv "$file.tmp" "$file")
    a3po_log "generated the PostgreSQL password for this install: $file"
  fi
  echo "$file"
}

# a3po_pgpass_write PGPASS_FILE PORT USER PASSWORD_FILE: a libpq password file (0600) for USER on
# 127.0.0.1:PORT (any database), so clients connect with a URI that holds no password
# (export PGPASSFILE=...; psycopg2 and asyncpg read it).
a3po_pgpass_write() {
  local out=$1 port=$2 user=$3 pw
  pw=$(head -n1 "$4")
  # libpq's format: host:port:db:user:password, with ':' and '\' escaped by a backslash.
  local esc_pw=${pw//\\/\\\\}; esc_pw=${esc_pw//:/\\:}
  local esc_user=${user//\\/\\\\}; esc_user=${esc_user//:/\\:}
  (umask 077 && mkdir -p "$(dirname "$out")" && printf '%s\n' "127.0.0.1:$port:*:$esc_user:$esc_pw" >"$out.tmp" && mv "$out.tmp" "$out")
}

# a3po_pg_uri USER PORT DB: the SQLAlchemy URI of the store, without a password (libpq reads PGPASSFILE).
a3po_pg_uri() {
  python3 -c 'import sys, urllib.parse as u; q = lambda s: u.quote(s, safe=""); print(f"postgresql+psycopg2://{q(sys.argv[1])}@127.0.0.1:{sys.argv[2]}/{q(sys.argv[3])}")' "$1" "$2" "$3"
}

# a3po_pg_admin DATA_DIR PORT [psql args...]: psql as the superuser over the unix socket in the data
# folder (trust, reachable only by this OS user); SQL on stdin.
a3po_pg_admin() {
  local data=$1 port=$2; shift 2
  "$(a3po_pg_bin)/psql" -h "$data" -p "$port" -U postgres -d postgres -v ON_ERROR_STOP=1 -qtAX "$@"
}

# a3po_pg_data DATA_DIR: print the folder the cluster lives in. As root PostgreSQL runs as
# 'postgres', which cannot pass the 0700 team folder (or a 0700 home above it): the cluster then
# lives in a 0700 folder of its own in postgres's home (one per DATA_DIR), and DATA_DIR is a link
# to it. Otherwise, and for a cluster already initialised in place, DATA_DIR itself.
a3po_pg_data() {
  local data=$1 parent home real
  if [ -L "$data" ]; then readlink -f "$data"; return 0; fi
  parent=$(dirname "$data")
  if [ "$(id -u)" != 0 ] || [ -f "$data/PG_VERSION" ] || runuser -u postgres -- test -x "$parent" 2>/dev/null; then
    echo "$data"; return 0
  fi
  rmdir "$data" 2>/dev/null || true  # the empty folder of a start that failed here before
  if [ -e "$data" ]; then a3po_log "$data exists and the postgres user cannot reach it: remove it"; return 1; fi
  home=$(getent passwd postgres | cut -d: -f6)
  real="$home/a3po/$(readlink -f "$parent" | sha256sum | cut -c1-16)-$(basename "$data")"
  mkdir -p "$real"
  chown postgres:postgres "$home/a3po" "$real"
  chmod 700 "$home/a3po" "$real"
  ln -s "$real" "$data"
  a3po_log "the postgres user cannot reach $parent: the cluster lives in $real ($data links to it)"
  echo "$real"
}

# a3po_pg_start DATA_DIR PORT USER PASSWORD_FILE DB
# Initialise the cluster if needed (password auth on TCP, loopback only; the superuser has no
# password), start it, create or update the role (login, the file's password) and the database.
a3po_pg_start() {
  local data port=$2 user=$3 pwfile=$4 db=$5 bin
  bin=$(a3po_pg_bin)
  data=$(a3po_pg_data "$1")
  mkdir -p "$data"
  if [ "$(id -u)" = 0 ]; then chown postgres:postgres "$data"; fi
  chmod 700 "$data"
  if [ ! -f "$data/PG_VERSION" ]; then
    a3po_log "initdb $data"
    a3po_as_pg "$bin/initdb" -D "$data" -U postgres --auth-local=trust --auth-host=scram-sha-256 >/dev/null
  fi
  a3po_log "starting PostgreSQL on 127.0.0.1:$port"
  a3po_as_pg "$bin/pg_ctl" -D "$data" -l "$data/server.log" -w -t 60 \
    -o "-c listen_addresses=127.0.0.1 -p $port -k $data -c unix_socket_permissions=0700" start >/dev/null
  # Names and the password travel as psql variables and are quoted by format(%I, %L): names or
  # passwords with quotes work, and nothing is spliced into SQL. The password is read by psql
  # itself from the file (a backtick command whose argv holds only the variable's name).
  A3PO_PW_FILE=$pwfile a3po_pg_admin "$data" "$port" -v user="$user" -v db="$db" <<'SQL'
\set pw `head -n1 "$A3PO_PW_FILE"`
select format('alter role %I password null', current_user) \gexec
select format('create role %I login', :'user') where not exists (select 1 from pg_roles where rolname = :'user') \gexec
select format('alter role %I login password %L', :'user', :'pw') \gexec
select format('create database %I owner %I', :'db', :'user') where not exists (select 1 from pg_database where datname = :'db') \gexec
SQL
}

a3po_pg_stop() {
  local data=$1
  if [ -L "$data" ]; then data=$(readlink -f "$data"); fi  # relocated by a3po_pg_data
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
