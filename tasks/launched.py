"""An arm x seed trained by launched ranks (``python -m a3po.training.command`` under torchrun or
DeepSpeed) instead of in the flow's process: how the launch is chosen and checked against the
config (:func:`launch_for_config`, :func:`arm_launch`), what the ranks are given (the config YAML,
the flow's warm start, the command line: :func:`prepare_launched_run`, :func:`launched_argv`) and
what is read back from the CLI's run folder into the comparison's record (:func:`record_launched_run`).
:func:`train_launched` is the chain; the ranks resume from their checkpoints when it is re-run.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import yaml
from prefect import task
from prefect.cache_policies import NO_CACHE

from a3po.config import TrainConfig, config_to_dict
from a3po.storage.checkpoint import atomic_write_text
from a3po.training.actions import FILE as ACTIONS_FILE
from infra.launch import LaunchMode, LaunchSpec
from tasks.arms import Arm
from tasks.child_run import log_actions, log_final, log_tables, open_child_run, run_topology, topology_tags, write_history
from tasks.launch import LaunchRecord, launch_ranks
from tasks.models import log_final_model
from tasks.runtime import run_logger
from tasks.tracking import MlflowMetricLogger, TrackingRef, client_for, last_logged_step, log_params, metric_steps
from tasks.training import RunRecord, WarmStart


def cli_run_dir(run_dir: str | Path, cfg: TrainConfig) -> Path:
    """Where ``a3po train --output-dir <run_dir>`` writes (checkpoints, metrics.jsonl, result.json, final/)."""
    return Path(run_dir) / f"{cfg.rl.variant.value}-seed{cfg.rl.seed}"


def launched_argv(cfg: TrainConfig, run_dir: str | Path) -> list[str]:
    rd = Path(run_dir)
    # --variant always: the CLI's default would override the config's variant.
    return ["-m", "a3po.training.command", "--config", str(rd / "config.yaml"), "--variant", cfg.rl.variant.value,
            "--seed", str(cfg.rl.seed), "--output-dir", str(rd), "--no-progress"]


def launch_for_config(spec: LaunchSpec, cfg: TrainConfig) -> LaunchSpec:
    """``spec`` with the ZeRO stage of the config's DeepSpeed JSON, so the recorded topology is
    what the ranks run. Raises when the two disagree, or when several ranks would train without
    a DeepSpeed config (the ranks would refuse it after their start-up; this fails before)."""
    from a3po.config.preflight import read_deepspeed_json, zero_stage

    ds = cfg.distributed.deepspeed_config
    stage = zero_stage(read_deepspeed_json(ds, cfg.rl.grad_clip)) if ds else None
    if spec.zero_stage is not None and spec.zero_stage != stage:
        has = f"{ds} is ZeRO stage {stage}" if ds else "null (no DeepSpeed)"
        raise ValueError(f"launch.zero_stage = {spec.zero_stage} but distributed.deepspeed_config {has}; "
                         "leave launch.zero_stage out: it is read from the config")
    world = spec.topology()["world_size"]
    workers, rollout_cores = cfg.distributed.rollout_workers, cfg.distributed.rollout_cores
    trainers = world - workers if world is not None else None  # rollout workers are the last ranks
    if ds is None and (trainers is None or trainers > 1):
        raise ValueError(f"launch: {world or 'several'} ranks need distributed.deepspeed_config (e.g. "
                         "--set distributed.deepspeed_config=infra/deepspeed_zero2.json); without it each rank would train its own copy")
    if rollout_cores and trainers is not None and spec.topology()["nodes"] == 1:
        from a3po.placement.cores import usable_cores

        need, have = trainers + workers * rollout_cores, usable_cores()
        if need > have:  # every process of this one node owns cores (a3po.placement.cores): refused before any starts
            raise ValueError(f"distributed.rollout_cores {rollout_cores}: {workers} rollout worker(s) x {rollout_cores} core(s) and "
                             f"{trainers} trainer rank(s) need {need} cores, this machine has {have}; lower distributed.rollout_cores "
                             "(0: no pinning) or launch fewer processes")
    return dataclasses.replace(spec, zero_stage=stage)


def arm_launch(spec: LaunchSpec | None, cfg: TrainConfig) -> LaunchSpec | None:
    """How one arm is started: as the comparison says, except that an arm with rollout workers
    (``distributed.rollout_workers``, e.g. the ``disaggregated`` placement) in an in-process
    comparison runs as torchrun processes on this machine: its trainer rank, then its workers."""
    workers = cfg.distributed.rollout_workers
    if workers and (spec is None or spec.mode is LaunchMode.LOCAL):
        return LaunchSpec(mode=LaunchMode.TORCHRUN, nproc_per_node=1 + workers)
    return spec


@task(cache_policy=NO_CACHE)
def prepare_launched_run(cfg: TrainConfig, run_dir: str, warmstart: WarmStart, tracking: TrackingRef | None, topology: dict[str, Any]) -> str | None:
    """Write the run's config YAML, point the CLI at the flow's warm start, open the child run
    (tagged with the topology); returns its MLflow run id."""
    rd = Path(run_dir)
    rd.mkdir(parents=True, exist_ok=True)
    atomic_write_text(rd / "config.yaml", yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    # The CLI looks for its warm start in <output-dir>/cache/warmstart-<key>: a link to the flow's
    # (same key, same weights) so no rank trains it again.
    link = rd / "cache" / Path(warmstart.dir).name
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)  # a dangling link left by a deleted cache
        link.symlink_to(warmstart.dir, target_is_directory=True)
    if tracking is None:
        return None
    run_id, _ = open_child_run(tracking, cfg, rd, warmstart.heldout_acc)
    client = client_for(tracking.tracking_uri)
    log_params(client, run_id, {"launch": topology})
    for k, v in topology_tags(topology).items():
        client.set_tag(run_id, k, v)
    return run_id


def read_metrics_jsonl(path: str | Path) -> list[dict[str, float]]:
    """Per-step metrics (steps 1..N) from the CLI's metrics.jsonl. The lines of one step are merged,
    a later line's values winning: a background held-out evaluation logs its figures after the
    step's line (a3po.training.evaluations), and a resumed run may append a step again. Errors name
    the file and line."""
    by_step: dict[int, dict[str, float]] = {}
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step = int(row.pop("step"))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{i}: not a metrics line ({e})") from None
        if step >= 1:
            by_step.setdefault(step, {}).update(row)
    missing = sorted(set(range(1, max(by_step, default=0) + 1)) - set(by_step))
    if missing:
        raise ValueError(f"{path}: steps {missing[:10]} missing")
    return [by_step[s] for s in sorted(by_step)]


@task(cache_policy=NO_CACHE)
def record_launched_run(cfg: TrainConfig, run_dir: str, tracking: TrackingRef | None, run_id: str | None, launched: LaunchRecord) -> RunRecord:
    """Read what the launched CLI wrote (result.json, metrics.jsonl, actions.jsonl) into a RunRecord and the child run."""
    rd, out = Path(run_dir), cli_run_dir(run_dir, cfg)
    result_path = out / "result.json"
    if not result_path.exists():
        raise FileNotFoundError(f"{result_path}: the launched ranks exited 0 but wrote no result")
    result = json.loads(result_path.read_text())
    # The eval curve holds the unrounded accuracies (the summary's are rounded to 4 places):
    # its first point is the warm start, its last the final step (always evaluated).
    (_, warmstart_acc), (_, final_acc) = result["eval_curve"][0], result["eval_curve"][-1]
    history = read_metrics_jsonl(out / "metrics.jsonl")
    history_path = write_history(rd, history)
    model_id = None
    if run_id is not None:
        client = client_for(tracking.tracking_uri)
        logger = MlflowMetricLogger(client, run_id, skip_through_step=last_logged_step(client, run_id),
                                    late_steps_logged=metric_steps(client, run_id, "eval/heldout_acc"))
        logger.ensure_history(history)
        logger.close()  # ships the back-fill, stops the shipper thread
        final = log_final(client, run_id, history, final_acc, **{"launch/wall_s": launched.wall_s})
        model_id = log_final_model(client, run_id, Arm.of(cfg).name, cfg.rl.seed, out, final, len(history))
        client.set_tag(run_id, "a3po.resumed_from", str(result.get("resumed_from") or 0))
        log_tables(client, run_id, out / "completions", run_logger())
        log_actions(client, run_id, out / ACTIONS_FILE, run_logger())
        client.set_terminated(run_id, status="FINISHED")
    return RunRecord(
        variant=result["variant"], arm=Arm.of(cfg).name, seed=result["seed"], run_dir=str(rd), final_dir=str(out / "final"),
        history_path=str(history_path), mlflow_run_id=run_id, warmstart_acc=warmstart_acc,
        final_acc=final_acc, steps=result["steps"], wall_s=result["wall_s"],
        resumed_from=result.get("resumed_from"), library_s=launched.wall_s, model_id=model_id,
    )


@task(cache_policy=NO_CACHE)
def mark_run_failed(tracking: TrackingRef, run_id: str) -> None:
    client_for(tracking.tracking_uri).set_terminated(run_id, status="FAILED")


def train_launched(cfg: TrainConfig, run_dir: str, warmstart: WarmStart, tracking: TrackingRef | None, spec: LaunchSpec) -> RunRecord:
    """The launched counterpart of :func:`tasks.training.train_arm` (called from a flow): config YAML ->
    ``launch_ranks`` running ``python -m a3po.training.command`` -> the CLI's results -> the child run.
    Re-running resumes (the CLI resumes from its checkpoints in the same run dir)."""
    topology = run_topology(cfg, spec)
    run_id = prepare_launched_run(cfg, run_dir, warmstart, tracking, topology)
    try:
        launched = launch_ranks(spec, launched_argv(cfg, run_dir))
    except BaseException:
        if run_id is not None:
            mark_run_failed(tracking, run_id)
        raise
    return record_launched_run(cfg, run_dir, tracking, run_id, launched)
