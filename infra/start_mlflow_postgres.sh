#!/usr/bin/env bash
# Team mode, tracking: an MLflow server backed by PostgreSQL, artifacts served by the server.
#
#   infra/start_mlflow_postgres.sh            # start (PostgreSQL in the background, MLflow in the foreground)
#   infra/start_mlflow_postgres.sh --stop     # stop PostgreSQL after Ctrl-C'ing the server
#
# Then, on the machines that run flows:   export MLFLOW_TRACKING_URI=http://<host>:<port>
#
# State lives in $A3PO_TEAM_DIR (default ./.a3po/team): pgdata/ and artifacts/.
# Binds to 127.0.0.1 by default; set A3PO_HOST=0.0.0.0 (and --allowed-hosts, a firewall, a
# real password) only on a trusted network: the MLflow server has no authentication.
# Needs PostgreSQL's server binaries (apt-get install postgresql) and psycopg2-binary
# (pip install -e '.[team]'). The store URI names the driver (postgresql+psycopg2://): with
# SQLAlchemy >= 2.1 a bare postgresql:// means psycopg 3, which the 'team' extra does not install.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/lib_team.sh"

TEAM_DIR=$(mkdir -p "${A3PO_TEAM_DIR:-.a3po/team}" && cd "${A3PO_TEAM_DIR:-.a3po/team}" && pwd)
HOST=${A3PO_HOST:-127.0.0.1}
PG_PORT=${A3PO_PG_PORT:-5433}
MLFLOW_PORT=${A3PO_MLFLOW_PORT:-5000}
PG_USER=${A3PO_PG_USER:-a3po}
PG_PASSWORD=${A3PO_PG_PASSWORD:-a3po}
PG_DB=${A3PO_PG_DB:-mlflow}

if [ "${1:-}" = "--stop" ]; then
  a3po_pg_stop "$TEAM_DIR/pgdata"
  exit 0
fi

a3po_pg_ensure_installed
a3po_ensure_psycopg2
a3po_pg_start "$TEAM_DIR/pgdata" "$PG_PORT" "$PG_USER" "$PG_PASSWORD" "$PG_DB"
mkdir -p "$TEAM_DIR/artifacts"
a3po_log "MLflow server on http://$HOST:$MLFLOW_PORT (store: PostgreSQL $PG_DB on 127.0.0.1:$PG_PORT)"
a3po_log "use it with: export MLFLOW_TRACKING_URI=http://$HOST:$MLFLOW_PORT"
exec mlflow server \
  --backend-store-uri "postgresql+psycopg2://$PG_USER:$PG_PASSWORD@127.0.0.1:$PG_PORT/$PG_DB" \
  --artifacts-destination "$TEAM_DIR/artifacts" \
  --host "$HOST" --port "$MLFLOW_PORT" --workers "${A3PO_MLFLOW_WORKERS:-2}"
