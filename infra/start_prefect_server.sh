#!/usr/bin/env bash
# Team mode, orchestration: a long-running Prefect server (UI + API). Schedules (the nightly
# parity deployment) only fire on a real server with a worker, never on the temporary server
# that `python -m flows.compare_variants` starts by itself.
#
#   infra/start_prefect_server.sh          # foreground; Ctrl-C stops it
#
# Then, for flows, workers and deployments:   export PREFECT_API_URL=http://<host>:<port>/api
#
# State: $PREFECT_HOME (default ./.a3po/team/prefect, SQLite). For PostgreSQL instead, set
# A3PO_PREFECT_DB_URL=postgresql+asyncpg://a3po@127.0.0.1:5433/prefect and PGPASSFILE to the
# team dir's secrets/pgpass (create that database first, owned by that role;
# infra/start_mlflow_postgres.sh starts a suitable PostgreSQL). Keep passwords out of the URL:
# asyncpg reads PGPASSFILE as libpq does.
# Binds to 127.0.0.1 unless A3PO_HOST is set (the server has no authentication).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
HOST=${A3PO_HOST:-127.0.0.1}
PORT=${A3PO_PREFECT_PORT:-4200}
export PREFECT_HOME=${PREFECT_HOME:-$root/.a3po/team/prefect}
export DO_NOT_TRACK=true PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_UI_API_URL=${PREFECT_UI_API_URL:-http://$HOST:$PORT/api}
if [ -n "${A3PO_PREFECT_DB_URL:-}" ]; then
  export PREFECT_SERVER_DATABASE_CONNECTION_URL=$A3PO_PREFECT_DB_URL
fi
unset PREFECT_API_URL  # the server itself must not point at another API
mkdir -p "$PREFECT_HOME"
echo "Prefect server on http://$HOST:$PORT   use it with: export PREFECT_API_URL=http://$HOST:$PORT/api" >&2
exec prefect server start --host "$HOST" --port "$PORT"
