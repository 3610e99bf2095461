#!/usr/bin/env bash
# Team mode: a Prefect process worker that runs the deployments of this project (the nightly
# parity run, infra/prefect.yaml or infra/deploy_nightly.py) in subprocesses on this machine.
#
#   export PREFECT_API_URL=http://127.0.0.1:4200/api      # infra/start_prefect_server.sh
#   export MLFLOW_TRACKING_URI=http://127.0.0.1:5000       # infra/start_mlflow_postgres.sh
#   infra/start_worker.sh                                  # foreground; extra args go to `prefect worker start`
#
# The work pool ($A3PO_WORK_POOL, default a3po-local, type 'process') is created if missing.
# Flow runs inherit this shell's environment (tracking URI, A3PO_SHARED_DATA, threads).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
: "${PREFECT_API_URL:?set PREFECT_API_URL to the Prefect server (infra/start_prefect_server.sh prints it)}"
POOL=${A3PO_WORK_POOL:-a3po-local}
export DO_NOT_TRACK=true PREFECT_SERVER_ANALYTICS_ENABLED=false
export A3PO_ROOT=${A3PO_ROOT:-$root}   # infra/prefect.yaml's pull step changes into it
if ! prefect work-pool inspect "$POOL" >/dev/null 2>&1; then
  prefect work-pool create "$POOL" --type process >/dev/null
  echo "created work pool $POOL (process)" >&2
fi
cd "$root"
exec prefect worker start --pool "$POOL" --type process "$@"
