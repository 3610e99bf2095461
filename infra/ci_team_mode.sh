#!/usr/bin/env bash
# CI check of team mode, for real, on loopback only:
#
#   1. PostgreSQL (apt-get install postgresql when missing), a fresh cluster and database;
#   2. psycopg2-binary (the 'team' extra) when missing;
#   3. an MLflow server on that database (artifacts proxied by the server), a Prefect server;
#   4. the comparison flow (micro preset, 1 variant, 4 steps) against both servers;
#   5. checks: the runs are in MLflow (mlflow.search_runs over HTTP), rows are in PostgreSQL,
#      the artifacts download, the parent run names a flow run the Prefect server knows;
#   5b. credentials: no process's command line (`ps -eo args`) holds the PostgreSQL password, the
#      MLflow server's environment neither, the password files are 0600, and the superuser cannot
#      log in over TCP;
#   6. the nightly deployment (cron 0 2 * * *) registered on the Prefect server, one run of it
#      executed by a process worker (--run-once), its verdict tagged in MLflow
#      (skip with A3PO_CI_SKIP_WORKER=1);
#   7. everything stopped and removed (keep with A3PO_CI_KEEP=1).
#
#   infra/ci_team_mode.sh          # from the repo root, with the project's venv active; ~2-4 min
#
# Exits non-zero on any failure; the last line of output is one JSON object of key figures.
set -euo pipefail
umask 077
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
cd "$root"
source "$here/lib_team.sh"
t_start=$(date +%s)

WORK=$(mktemp -d /tmp/a3po-team-ci.XXXXXX)
chmod 755 "$WORK"
PG_PORT=$(a3po_free_port); ML_PORT=$(a3po_free_port); PF_PORT=$(a3po_free_port)
pgids=()

cleanup() {
  local rc=$?
  for pg in "${pgids[@]}"; do kill -TERM -- "-$pg" 2>/dev/null || true; done
  sleep 2
  for pg in "${pgids[@]}"; do kill -KILL -- "-$pg" 2>/dev/null || true; done
  a3po_pg_stop "$WORK/pgdata"
  if [ "$rc" != 0 ]; then
    a3po_log "FAILED (exit $rc); logs:"
    for f in "$WORK"/*.log "$WORK/pgdata/server.log"; do if [ -f "$f" ]; then { echo "--- $f"; tail -25 "$f"; } >&2; fi; done
  fi
  if [ "${A3PO_CI_KEEP:-0}" = 1 ]; then a3po_log "kept $WORK"; else rm -rf "$WORK"; fi
  exit "$rc"
}
trap cleanup EXIT

# Start a command in its own session (so cleanup stops it and its children by group id).
start_bg() {
  local log=$1; shift
  setsid "$@" >"$log" 2>&1 &
  pgids+=("$!")
}

a3po_pg_ensure_installed
a3po_ensure_psycopg2
# The same credential path as infra/start_mlflow_postgres.sh: a generated password in the team
# dir ($WORK here), a libpq password file, a store URI without password passed in the environment.
PG_PASSWORD_FILE=$(a3po_pg_password_file "$WORK")
a3po_pg_start "$WORK/pgdata" "$PG_PORT" a3po "$PG_PASSWORD_FILE" mlflow
a3po_pgpass_write "$WORK/secrets/pgpass" "$PG_PORT" a3po "$PG_PASSWORD_FILE"
export PGPASSFILE=$WORK/secrets/pgpass

a3po_log "MLflow server on 127.0.0.1:$ML_PORT"
MLFLOW_BACKEND_STORE_URI=$(a3po_pg_uri a3po "$PG_PORT" mlflow)
export MLFLOW_BACKEND_STORE_URI  # mlflow server reads it for --backend-store-uri
start_bg "$WORK/mlflow.log" mlflow server --artifacts-destination "$WORK/artifacts" --host 127.0.0.1 --port "$ML_PORT" --workers 1
unset MLFLOW_BACKEND_STORE_URI
a3po_log "Prefect server on 127.0.0.1:$PF_PORT"
start_bg "$WORK/prefect.log" env PREFECT_HOME="$WORK/prefect-server" A3PO_PREFECT_PORT="$PF_PORT" "$here/start_prefect_server.sh"
a3po_wait_http "http://127.0.0.1:$ML_PORT/health" 180
a3po_wait_http "http://127.0.0.1:$PF_PORT/api/health" 180

export MLFLOW_TRACKING_URI="http://127.0.0.1:$ML_PORT"
export PREFECT_API_URL="http://127.0.0.1:$PF_PORT/api"
export PREFECT_HOME="$WORK/prefect-client" DO_NOT_TRACK=true PREFECT_SERVER_ANALYTICS_ENABLED=false

a3po_log "comparison flow (micro, loglinear, 4 steps) against both servers"
t_flow=$(date +%s)
python -m flows.compare_variants --preset micro --variants loglinear --seeds 0 --steps 4 --benchmarks "" \
  --experiment ci-team-mode --output-dir "$WORK/runs" >"$WORK/flow.log" 2>&1
flow_s=$(( $(date +%s) - t_flow ))
tail -1 "$WORK/flow.log" >"$WORK/flow.json"

a3po_log "checking MLflow (over HTTP), PostgreSQL and Prefect"
python - "$WORK" <<'EOF'
import json, sys, pathlib
import mlflow
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client

work = pathlib.Path(sys.argv[1])
figures = json.loads((work / "flow.json").read_text())
runs = mlflow.search_runs(experiment_names=["ci-team-mode"])
parent = runs[runs["tags.a3po.role"] == "parent"]
child = runs[runs["tags.a3po.role"] == "child"]
assert len(parent) == 1 and len(child) == 1, runs[["run_id", "tags.a3po.role"]]
assert set(runs["status"]) == {"FINISHED"}, runs["status"]
assert child.iloc[0]["tags.mlflow.parentRunId"] == parent.iloc[0]["run_id"] == figures["parent_run_id"]
client = MlflowClient()
assert [m.step for m in client.get_metric_history(child.iloc[0]["run_id"], "reward/mean")] == [1, 2, 3, 4]
local = client.download_artifacts(parent.iloc[0]["run_id"], "comparison.md", str(work))
assert "| loglinear |" in pathlib.Path(local).read_text()
with get_client(sync_client=True) as pc:
    fr = pc.read_flow_run(parent.iloc[0]["tags.prefect.flow_run_id"])
    assert fr.state.is_completed(), fr.state
print(json.dumps({"mlflow_runs": len(runs), "prefect_flow_run": str(fr.id)}))
EOF
n_pg=$("$(a3po_pg_bin)/psql" -h 127.0.0.1 -p "$PG_PORT" -U a3po -d mlflow -qtA \
  -c "select count(*) from runs r join experiments e on r.experiment_id = e.experiment_id where e.name = 'ci-team-mode'")
[ "$n_pg" = 2 ] || { a3po_log "expected 2 runs in PostgreSQL, found $n_pg"; exit 1; }

a3po_log "checking credentials while the servers run"
# grep -f reads the password from the file: the check itself puts no secret on a command line.
n_procs=$(ps -eo args | wc -l)
if ps -eo args | grep -qF -f "$PG_PASSWORD_FILE"; then
  a3po_log "the PostgreSQL password appears on a command line (ps -eo args)"; exit 1
fi
for pg in "${pgids[@]}"; do
  for pid in $(pgrep -g "$pg"); do
    if tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qF -f "$PG_PASSWORD_FILE"; then
      a3po_log "the PostgreSQL password is in the environment of process $pid"; exit 1
    fi
  done
done
for f in "$PG_PASSWORD_FILE" "$PGPASSFILE"; do
  [ "$(stat -c %a "$f")" = 600 ] || { a3po_log "$f has mode $(stat -c %a "$f"), expected 600"; exit 1; }
done
if env -u PGPASSWORD PGPASSFILE=/dev/null "$(a3po_pg_bin)/psql" -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -w -qtA -c "select 1" >/dev/null 2>&1; then
  a3po_log "the PostgreSQL superuser can log in over TCP without a password"; exit 1
fi

worker_s=0; nightly="skipped"
if [ "${A3PO_CI_SKIP_WORKER:-0}" != 1 ]; then
  a3po_log "nightly deployment + one run by a process worker"
  t_w=$(date +%s)
  # Four micro steps learn next to nothing: the night may be "not measurable" (tasks.parity.references_moved), so
  # it is not made to fail the run on that; the check is the deployment, the worker and a recorded verdict.
  python infra/deploy_nightly.py --pool a3po-ci --run-now --param preset=micro --param 'seeds=[0]' --param steps=4 \
    --param 'references=["recompute"]' --param fail_on_regression=false \
    --param experiment='"ci-team-nightly"' --param "output_dir=\"$WORK/nightly\"" \
    >"$WORK/deploy.log" 2>&1
  dep=$(tail -1 "$WORK/deploy.log")
  A3PO_WORK_POOL=a3po-ci timeout 600 "$here/start_worker.sh" --run-once >"$WORK/worker.log" 2>&1
  python - "$dep" <<'EOF'
import json, sys
import mlflow
from prefect.client.orchestration import get_client

dep = json.loads(sys.argv[1])
assert dep["cron"] == ["0 2 * * *"], dep
# The flow takes one typed spec; --param KEY=VALUE set its fields (infra/deploy.py).
assert set(dep["parameters"]) == {"spec"} and dep["parameters"]["spec"]["references"] == ["recompute"], dep
with get_client(sync_client=True) as pc:
    state = pc.read_flow_run(dep["flow_run_id"]).state
    assert state.is_completed(), state
runs = mlflow.search_runs(experiment_names=["ci-team-nightly"], filter_string="tags.`a3po.kind` = 'nightly'")
assert len(runs) == 1 and runs.iloc[0]["tags.parity"] in ("pass", "not measurable"), runs
assert runs.iloc[0]["metrics.parity/pass"] == float(runs.iloc[0]["tags.parity"] == "pass"), runs
EOF
  worker_s=$(( $(date +%s) - t_w )); nightly="pass"

  # The weekly comparison deployment (infra/prefect.yaml, cron 0 3 * * 0) registered by
  # infra/deploy.py, one run of it by a process worker: completed in Prefect, its parent run
  # in MLflow with one child run and the link tags pointing at this MLflow server.
  a3po_log "comparison deployment + one run by a process worker"
  t_c=$(date +%s)
  python infra/deploy.py compare-variants --pool a3po-ci --run-now --param preset=micro --param 'variants=["loglinear"]' \
    --param 'seeds=[0]' --param steps=4 --param 'benchmarks=[]' --param experiment='"ci-team-compare"' \
    --param "output_dir=\"$WORK/compare-dep/{date}\"" >"$WORK/deploy-compare.log" 2>&1
  dep_c=$(tail -1 "$WORK/deploy-compare.log")
  A3PO_WORK_POOL=a3po-ci timeout 600 "$here/start_worker.sh" --run-once >"$WORK/worker-compare.log" 2>&1
  compare_dep=$(python - "$dep_c" "$MLFLOW_TRACKING_URI" <<'EOF'
import json, sys
import mlflow
from prefect.client.orchestration import get_client

dep, ui = json.loads(sys.argv[1]), sys.argv[2]
assert dep["cron"] == ["0 3 * * 0"] and dep["timezone"] == "UTC", dep
assert set(dep["parameters"]) == {"spec"} and dep["parameters"]["spec"]["variants"] == ["loglinear"], dep
with get_client(sync_client=True) as pc:
    state = pc.read_flow_run(dep["flow_run_id"]).state
    assert state.is_completed(), state
runs = mlflow.search_runs(experiment_names=["ci-team-compare"])
parent = runs[runs["tags.a3po.role"] == "parent"]
child = runs[runs["tags.a3po.role"] == "child"]
assert len(parent) == 1 and len(child) == 1 and set(runs["status"]) == {"FINISHED"}, runs
p = parent.iloc[0]
assert p["tags.a3po.kind"] == "compare" and p["tags.prefect.flow_run_id"] == dep["flow_run_id"], p
exp, pid, cid = p["experiment_id"], p["run_id"], child.iloc[0]["run_id"]
assert p["tags.a3po.link.parent_run"] == f"{ui}/#/experiments/{exp}/runs/{pid}?workflowType=machine_learning", p["tags.a3po.link.parent_run"]
assert cid in p["tags.a3po.link.compare_runs"], p["tags.a3po.link.compare_runs"]
print(json.dumps({"flow_run": dep["flow_run_id"], "parent_run": pid, "parent_run_url": p["tags.a3po.link.parent_run"]}))
EOF
)
  compare_s=$(( $(date +%s) - t_c ))
fi

total_s=$(( $(date +%s) - t_start ))
a3po_log "team mode OK"
echo "{\"team_mode\": \"ok\", \"postgres_runs\": $n_pg, \"password_in_ps\": false, \"processes_checked\": $n_procs, \"flow_s\": $flow_s, \"nightly_via_worker\": \"$nightly\", \"worker_s\": $worker_s, \"compare_via_worker\": ${compare_dep:-\"skipped\"}, \"compare_worker_s\": ${compare_s:-0}, \"total_s\": $total_s}"
