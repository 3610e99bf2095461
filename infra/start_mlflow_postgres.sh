#!/usr/bin/env bash
# Team mode, tracking: an MLflow server backed by PostgreSQL, artifacts served by the server.
#
#   infra/start_mlflow_postgres.sh            # start (PostgreSQL in the background, MLflow in the foreground)
#   infra/start_mlflow_postgres.sh --stop     # stop PostgreSQL after Ctrl-C'ing the server
#
# Then, on the machines that run flows:   export MLFLOW_TRACKING_URI=http://<host>:<port>
#
# State lives in $A3PO_TEAM_DIR (default ./.a3po/team): pgdata/, artifacts/ and secrets/ (0700):
#   secrets/pg_password  the PostgreSQL password of the role $A3PO_PG_USER, generated on the first
#                        start (0600) and reused; A3PO_PG_PASSWORD_FILE=<file, chmod 600> uses yours;
#   secrets/pgpass       libpq password file: clients and the MLflow server connect with a URI
#                        that holds no password (export PGPASSFILE=<team dir>/secrets/pgpass).
# The PostgreSQL superuser has no password (admin work goes over the unix socket in pgdata/), and
# no password ever appears on a command line (`ps -eo args`).
# Binds to 127.0.0.1 by default; set A3PO_HOST=0.0.0.0 (and --allowed-hosts, a firewall) only
# on a trusted network: the MLflow server has no authentication.
# Needs PostgreSQL's server binaries (apt-get install postgresql) and psycopg2-binary
# (pip install -e '.[team]'). The store URI names the driver (postgresql+psycopg2://): with
# SQLAlchemy >= 2.1 a bare postgresql:// means psycopg 3, which the 'team' extra does not install.
set -euo pipefail
umask 077  # secrets, data and artifacts are this user's only
here=$(cd "$(dirname "$0")" && pwd)
source "$here/lib_team.sh"

TEAM_DIR=$(mkdir -p "${A3PO_TEAM_DIR:-.a3po/team}" && cd "${A3PO_TEAM_DIR:-.a3po/team}" && pwd)
HOST=${A3PO_HOST:-127.0.0.1}
PG_PORT=${A3PO_PG_PORT:-5433}
MLFLOW_PORT=${A3PO_MLFLOW_PORT:-5000}
PG_USER=${A3PO_PG_USER:-a3po}
PG_DB=${A3PO_PG_DB:-mlflow}

if [ "${1:-}" = "--stop" ]; then
  a3po_pg_stop "$TEAM_DIR/pgdata"
  exit 0
fi

a3po_pg_ensure_installed
a3po_ensure_psycopg2
PG_PASSWORD_FILE=$(a3po_pg_password_file "$TEAM_DIR")
a3po_pg_start "$TEAM_DIR/pgdata" "$PG_PORT" "$PG_USER" "$PG_PASSWORD_FILE" "$PG_DB"
a3po_pgpass_write "$TEAM_DIR/secrets/pgpass" "$PG_PORT" "$PG_USER" "$PG_PASSWORD_FILE"
mkdir -p "$TEAM_DIR/artifacts"
a3po_log "MLflow server on http://$HOST:$MLFLOW_PORT (store: PostgreSQL $PG_DB on 127.0.0.1:$PG_PORT)"
a3po_log "use it with: export MLFLOW_TRACKING_URI=http://$HOST:$MLFLOW_PORT"
# The store URI goes through the environment (mlflow reads MLFLOW_BACKEND_STORE_URI for
# --backend-store-uri) and holds no password: libpq reads it from PGPASSFILE.
export PGPASSFILE=$TEAM_DIR/secrets/pgpass
MLFLOW_BACKEND_STORE_URI=$(a3po_pg_uri "$PG_USER" "$PG_PORT" "$PG_DB")
export MLFLOW_BACKEND_STORE_URI
exec mlflow server \
  --artifacts-destination "$TEAM_DIR/artifacts" \
  --host "$HOST" --port "$MLFLOW_PORT" --workers "${A3PO_MLFLOW_WORKERS:-2}"
