#!/usr/bin/env bash
# Check of the comparison's fan-out over Prefect workers, for real, on loopback only:
#
#   1. a Prefect server (prefect server start on a free port), an MLflow SQLite store;
#   2. the train-one deployment (infra/prefect.yaml) registered by infra/deploy.py on a pool,
#      two Prefect process workers polling it, one flow run at a time each (--limit 1), each
#      with its own PREFECT_HOME (as two machines would have);
#   3. the micro comparison (sync, recompute, loglinear; 4 steps) in-process, then the same
#      comparison with --fanout-deployment train-one/train-one (its variants trained as
#      deployment runs by the workers);
#   4. checks: the two comparison tables hold the same final accuracies and rewards, every run's
#      per-step metrics (timings aside) and final weights are equal, both MLflow experiments
#      hold one parent and one FINISHED child per variant under it, the fan-out's trainings ran
#      as completed subflow runs of the parent flow run on both workers;
#   5. everything stopped and removed (keep with A3PO_CI_KEEP=1).
#
#   infra/ci_fanout.sh          # from the repo root, with the project's venv active; ~3-6 min on 2 cores
#
# Exits non-zero on any failure; the last line of output is one JSON object of key figures.
set -euo pipefail
umask 077
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
cd "$root"
source "$here/lib_team.sh"
t_start=$(date +%s)

WORK=$(mktemp -d /tmp/a3po-fanout-ci.XXXXXX)
PF_PORT=$(a3po_free_port)
POOL=a3po-fanout-ci
pgids=()

cleanup() {
  local rc=$?
  for pg in "${pgids[@]}"; do kill -TERM -- "-$pg" 2>/dev/null || true; done
  sleep 2
  for pg in "${pgids[@]}"; do kill -KILL -- "-$pg" 2>/dev/null || true; done
  if [ "$rc" != 0 ]; then
    a3po_log "FAILED (exit $rc); logs:"
    for f in "$WORK"/*.log; do if [ -f "$f" ]; then { echo "--- $f"; tail -40 "$f"; } >&2; fi; done
  fi
  if [ "${A3PO_CI_KEEP:-0}" = 1 ]; then a3po_log "kept $WORK"; else rm -rf "$WORK"; fi
  exit "$rc"
}
trap cleanup EXIT

start_bg() {  # in its own session, so cleanup stops it and its children by group id
  local log=$1; shift
  setsid "$@" >"$log" 2>&1 &
  pgids+=("$!")
}

a3po_log "Prefect server on 127.0.0.1:$PF_PORT"
start_bg "$WORK/prefect.log" env PREFECT_HOME="$WORK/prefect-server" A3PO_PREFECT_PORT="$PF_PORT" "$here/start_prefect_server.sh"
a3po_wait_http "http://127.0.0.1:$PF_PORT/api/health" 180

export PREFECT_API_URL="http://127.0.0.1:$PF_PORT/api"
export MLFLOW_TRACKING_URI="sqlite:///$WORK/mlflow.db"
export PREFECT_HOME="$WORK/prefect-client" DO_NOT_TRACK=true PREFECT_SERVER_ANALYTICS_ENABLED=false
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

a3po_log "train-one deployment on pool $POOL, two process workers"
python infra/deploy.py train-one --pool "$POOL" >"$WORK/deploy.log" 2>&1
dep=$(tail -1 "$WORK/deploy.log")
for w in 1 2; do
  start_bg "$WORK/worker$w.log" env PREFECT_HOME="$WORK/worker$w-home" A3PO_WORK_POOL="$POOL" \
    "$here/start_worker.sh" --limit 1 --name "fanout-ci-worker$w"
done

common=(--preset micro --variants sync,recompute,loglinear --seeds 0 --steps 4 --benchmarks "" --cache-dir "$WORK/cache")
a3po_log "comparison in-process"
t0=$(date +%s)
python -m flows.compare_variants "${common[@]}" --experiment fanout-inproc --output-dir "$WORK/inproc" >"$WORK/inproc.log" 2>&1
inproc_s=$(( $(date +%s) - t0 ))
tail -1 "$WORK/inproc.log" >"$WORK/inproc.json"

a3po_log "comparison fanned out over the workers"
t0=$(date +%s)
python -m flows.compare_variants "${common[@]}" --experiment fanout-workers --output-dir "$WORK/fanout" \
  --fanout-deployment train-one/train-one >"$WORK/fanout.log" 2>&1
fanout_s=$(( $(date +%s) - t0 ))
tail -1 "$WORK/fanout.log" >"$WORK/fanout.json"

a3po_log "checking tables, runs, weights, MLflow and Prefect"
python - "$WORK" "$dep" "$inproc_s" "$fanout_s" "$t_start" <<'EOF'
import json, pathlib, re, sys, time

import mlflow
import torch
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId, FlowRunFilter, FlowRunFilterParentFlowRunId
from safetensors.torch import load_file

work = pathlib.Path(sys.argv[1])
dep, inproc_s, fanout_s, t_start = json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
figs = {k: json.loads((work / f"{k}.json").read_text()) for k in ("inproc", "fanout")}
variants = ["sync", "recompute", "loglinear"]
table = {k: {v: (f[f"{v}/final_acc"], f[f"{v}/final_reward"]) for v in variants} for k, f in figs.items()}
assert table["inproc"] == table["fanout"], table
TIMING = ("perf/", "time/", "prox/time_s", "system/")


def history(run_dir):
    rows = [json.loads(line) for line in (pathlib.Path(run_dir) / "history.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


layout, runs_of = {}, {}
for kind, exp in (("inproc", "fanout-inproc"), ("fanout", "fanout-workers")):
    runs = mlflow.search_runs(experiment_names=[exp])
    parent = runs[runs["tags.a3po.role"] == "parent"]
    child = runs[runs["tags.a3po.role"] == "child"]
    assert len(parent) == 1 and parent.iloc[0]["run_id"] == figs[kind]["parent_run_id"], runs[["run_id", "tags.a3po.role"]]
    assert sorted(child["tags.a3po.variant"]) == sorted(variants), child["tags.a3po.variant"]
    assert set(child["tags.mlflow.parentRunId"]) == {figs[kind]["parent_run_id"]}
    assert set(runs["status"]) == {"FINISHED"}, runs["status"]
    for _, row in child.iterrows():
        assert round(row["metrics.final/heldout_acc"], 4) == figs[kind][f"{row['tags.a3po.variant']}/final_acc"]  # the JSON line rounds
    layout[kind] = {"parents": len(parent), "children": len(child)}
    runs_of[kind] = {row["tags.a3po.variant"]: row for _, row in child.iterrows()}
    metric_keys = {c for c in runs.columns if c.startswith("metrics.") and not c.startswith("metrics.system/")}
    layout[kind]["child_metric_keys"] = len({c for c in metric_keys if child[c].notna().all()})
assert layout["inproc"] == layout["fanout"], layout

for v in variants:
    a, b = runs_of["inproc"][v], runs_of["fanout"][v]
    assert history(a["tags.a3po.run_dir"]) == history(b["tags.a3po.run_dir"]), v
    wa = load_file(str(pathlib.Path(a["tags.a3po.run_dir"]) / "final" / "model.safetensors"))
    wb = load_file(str(pathlib.Path(b["tags.a3po.run_dir"]) / "final" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), v

fan_parent = mlflow.get_run(figs["fanout"]["parent_run_id"]).data.tags["prefect.flow_run_id"]
with get_client(sync_client=True) as pc:
    subs = pc.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[fan_parent])),
                             deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep["deployment_id"]])))
assert len(subs) == 3 and all(fr.state.is_completed() for fr in subs), [(fr.name, fr.state) for fr in subs]
sub_ids = {str(fr.id) for fr in subs}
# Each child MLflow run names the train-one flow run that trained it.
assert {runs_of["fanout"][v]["tags.prefect.flow_run_id"] for v in variants} == sub_ids
by_worker = {}
for w in (1, 2):
    text = (work / f"worker{w}.log").read_text()
    # The run's own "View at .../flow-run/<id>" line, streamed by the worker that executes it (a worker
    # that lost the race for a run also names it, in "Aborted submission of flow run ...").
    by_worker[f"worker{w}"] = sorted(i for i in sub_ids if f"/flow-run/{i}" in text)
assert all(by_worker.values()) and sorted(sum(by_worker.values(), [])) == sorted(sub_ids), by_worker
spans = sorted((fr.start_time, fr.end_time) for fr in subs)
overlap = any(spans[i + 1][0] < spans[i][1] for i in range(len(spans) - 1))
print(json.dumps({
    "fanout": "ok", "deployment": dep["deployment"], "pool": dep["pool"], "workers": 2,
    "table_equal": True, "table": table["fanout"], "histories_equal": True, "final_weights_equal": True,
    "mlflow_layout": layout["fanout"], "layout_equal": True, "subflow_runs": len(subs),
    "runs_per_worker": {k: len(v) for k, v in by_worker.items()}, "trainings_overlapped": overlap,
    "inproc_s": inproc_s, "fanout_s": fanout_s, "total_s": int(time.time()) - t_start,
}))
EOF
