"""One variant x seed of a comparison as a flow of its own, so a comparison can fan out.

    train → evaluate the final checkpoint → log the evaluation on the child MLflow run

:func:`train_and_evaluate` is that chain; ``compare_variants`` calls it in-process for each
variant x seed (the default). With ``--fanout-deployment train-one/<name>`` it instead submits
one run of the :func:`train_one` flow's deployment (``infra/prefect.yaml``) per variant x seed
and waits for them all: each Prefect worker polling the pool (one per machine, ``--limit 1``)
trains one at a time, so the variants train in parallel on separate machines. What the parent
prepared travels as parameters (the config, with its dataset paths; the warm-start folder; the
parent MLflow run), so every path must be on a folder all machines see at the same path (the
output dir), and the MLflow store must be reachable from each (a server in team mode).

The child writes its record to ``<run dir>/record.json`` (atomically, tagged with its own flow
run id); the parent reads the records from there (no result storage to share between machines).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.runtime import flow_run

import flows  # noqa: F401  (offline defaults before Prefect is imported)
from a3po.config import TrainConfig, config_from_dict
from a3po.redact import MASK, mask_uri
from a3po.storage.checkpoint import atomic_write_text
from infra.launch import LaunchMode, LaunchSpec, launch_spec
from tasks.evaluation import evaluate_checkpoint
from tasks.launched import arm_launch, launch_for_config, train_launched
from tasks.tracking import TrackingRef, log_evaluation
from tasks.training import WarmStart, train_arm

RECORD_FILE = "record.json"


def train_and_evaluate(
    cfg: TrainConfig,
    run_dir: str,
    ws: WarmStart,
    tracking: TrackingRef | None,
    spec: LaunchSpec | None,
    benchmarks: list[str],
    data_dir: str | None,
    bench_limit: int | None,
    bench_max_new_tokens: int,
    system_metrics_interval_s: float,
) -> dict[str, Any]:
    """Train one variant x seed (in-process, or as launched ranks), evaluate it, log the
    evaluation on its child run; the comparison's record of it. An arm with rollout workers runs
    as launched processes even in an in-process comparison (:func:`tasks.launched.arm_launch`)."""
    spec = arm_launch(spec, cfg)
    if spec is None or spec.mode is LaunchMode.LOCAL:
        run = train_arm(cfg, run_dir, ws, tracking, system_metrics_interval_s)
    else:
        run = train_launched(cfg, run_dir, ws, tracking, spec)
    ev = evaluate_checkpoint(run.final_dir, cfg, benchmarks, data_dir, bench_limit, bench_max_new_tokens, str(Path(run.run_dir) / "eval"))
    if tracking is not None:
        log_evaluation(tracking, run.mlflow_run_id, {**ev, "step": run.steps})
    return {**run.as_dict(), "evaluation": ev, "warmstart": {"dir": ws.dir, "heldout_acc": ws.heldout_acc, "seconds": ws.seconds}}


def worker_tracking_uri(given: str) -> str:
    """The store a fanned-out run logs to: ``given``, or, when the comparison masked its secrets
    (:func:`tasks.runtime.mask_uri`: they never go into Prefect's flow-run parameters), this
    worker's ``$MLFLOW_TRACKING_URI``, which must name the same store."""
    if MASK not in given:
        return given
    own = os.environ.get("MLFLOW_TRACKING_URI")
    if own is None or mask_uri(own) != given:
        raise ValueError(f"tracking: the comparison's store {given} carries secrets, which are not passed to workers; set "
                         f"MLFLOW_TRACKING_URI on this worker to that store (here: {mask_uri(own) if own else 'unset'})")
    return own


def spec_to_dict(spec: LaunchSpec) -> dict[str, Any]:
    """A LaunchSpec as flow parameters (JSON), the inverse of :func:`infra.launch.launch_spec`."""
    d = dataclasses.asdict(spec)
    d["mode"] = spec.mode.value
    d["nodes"] = list(spec.nodes) if spec.nodes is not None else None
    return d


def read_record(run_dir: str | Path, flow_run_id: str) -> dict[str, Any]:
    """The record a ``train_one`` flow run wrote; refuses one left by another flow run (a
    previous attempt of the same run dir), so a stale file is never taken for this run's."""
    path = Path(run_dir) / RECORD_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: flow run {flow_run_id} completed but wrote no record (is the output dir shared?)")
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a JSON record ({e})") from None
    if record.get("prefect_flow_run_id") != flow_run_id:
        raise ValueError(f"{path}: written by flow run {record.get('prefect_flow_run_id')}, not by {flow_run_id}")
    return record


@flow(name="train-one", log_prints=True, flow_run_name="{config[rl][variant]}-seed{config[rl][seed]}")
def train_one(
    config: dict[str, Any],
    run_dir: str,
    warmstart: dict[str, Any],
    tracking: dict[str, str] | None = None,
    benchmarks: tuple[str, ...] | list[str] = (),
    data_dir: str | None = None,
    bench_limit: int | None = 50,
    bench_max_new_tokens: int = 64,
    system_metrics_interval_s: float = 10.0,
    launch: str | dict[str, Any] = "local",
) -> dict[str, Any]:
    """Train, evaluate and log one variant x seed of a comparison (see the module docstring).

    config: the full TrainConfig as a dict (a3po.config.config_to_dict; checked here again).
    run_dir: the run's folder (resumes from its checkpoints). warmstart: fields of
    tasks.training.WarmStart (its folder must be readable here). tracking: fields of
    tasks.tracking.TrackingRef (the parent MLflow run the child run goes under; a store URI with
    its secrets masked is this worker's $MLFLOW_TRACKING_URI: :func:`worker_tracking_uri`). launch: "local"
    or a LaunchSpec dict: the ranks this machine starts for the training.
    """
    cfg = config_from_dict(config, where="train-one config")
    spec = launch_for_config(launch_spec(launch), cfg)
    ref = TrackingRef(**{**tracking, "tracking_uri": worker_tracking_uri(tracking["tracking_uri"])}) if tracking else None
    record = train_and_evaluate(cfg, run_dir, WarmStart(**warmstart), ref, spec, list(benchmarks), data_dir,
                                bench_limit, bench_max_new_tokens, system_metrics_interval_s)
    record["prefect_flow_run_id"] = str(flow_run.id)
    atomic_write_text(Path(run_dir) / RECORD_FILE, json.dumps(record))
    return record


# --- fan-out: one deployment run per variant x seed, from the comparison's flow ---------------


def fan_out(deployment: str, jobs: list[tuple[str, str, dict[str, Any]]], poll_s: float = 2.0,
            timeout_s: float | None = None) -> list[dict[str, Any]]:
    """Submit one run of ``deployment`` ("train-one/<name>") per job ``(label, run dir,
    train_one parameters)``, all at once (``run_deployment(timeout=0)``: the workers take them
    in parallel), wait until every one has ended, and return their records in job order. Any
    run that did not complete fails the call, naming its job, its flow run and its message,
    once all have ended (the others keep their checkpoints for the re-run)."""
    import time

    from prefect import get_run_logger
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    log = get_run_logger()
    submitted = []
    for label, run_dir, params in jobs:
        # A subflow of this flow run in the UI; the run goes to the deployment's work pool.
        fr = run_deployment(deployment, parameters=params, timeout=0)
        log.info(f"{label}: submitted flow run {fr.name} ({fr.id}) of {deployment}")
        submitted.append((label, run_dir, str(fr.id)))
    ended: dict[str, Any] = {}
    t0 = time.monotonic()
    with get_client(sync_client=True) as client:
        while len(ended) < len(submitted):
            for label, _, fid in submitted:
                if fid in ended:
                    continue
                state = client.read_flow_run(fid).state
                if state is not None and state.is_final():
                    ended[fid] = state
                    log.info(f"{label}: flow run {fid} ended {state.name}")
            if len(ended) < len(submitted):
                if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                    waiting = [f"{label} ({fid})" for label, _, fid in submitted if fid not in ended]
                    raise TimeoutError(f"fan-out: still waiting after {timeout_s:.0f} s for {', '.join(waiting)} (is a worker polling the pool?)")
                time.sleep(poll_s)
    failed = [f"{label}: flow run {fid} ended {ended[fid].name}: {ended[fid].message}"
              for label, _, fid in submitted if not ended[fid].is_completed()]
    if failed:
        raise RuntimeError(f"fan-out over {deployment}: {len(failed)} of {len(submitted)} runs failed\n" + "\n".join(failed))
    return [read_record(run_dir, fid) for _, run_dir, fid in submitted]
