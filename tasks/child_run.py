"""The MLflow child run of one arm x seed, from its opening to its end, whether the training runs
in the flow's process (:func:`tasks.training.train_arm`) or as launched ranks (:mod:`tasks.launched`).

A child run sits under the flow's parent run, tagged with its arm, seed, run folder, config hash
and topology, with its train and held-out sets as MLflow dataset inputs (name, source path, content
digest, rows: :func:`dataset_inputs`). A Prefect retry reuses the child run of its flow run (steps already logged are not
logged again); a new flow run gets a new child run and marks the killed one KILLED. At the end the
run gets its ``final/...`` metrics, the run folder's completion tables (:mod:`tasks.completions`) and
its actions table (:mod:`tasks.actions`); a failure marks it FAILED without hiding the error.
"""

from __future__ import annotations

import hashlib
import json
import socket
from pathlib import Path
from typing import Any

from mlflow.entities import DatasetInput

from a3po.config import TrainConfig, config_to_dict
from a3po.devices import machine_precision, resolve_device
from a3po.storage.checkpoint import atomic_write_text
from a3po.training.inputs import input_hashes
from a3po.training.records import HISTORY_FILE, history_text
from infra.launch import LaunchSpec
from tasks.actions import log_action_table
from tasks.arms import Arm
from tasks.completions import log_completion_tables
from tasks.summary import final_reward
from tasks.tracking import (
    MlflowMetricLogger,
    TrackingRef,
    client_for,
    create_run,
    file_dataset,
    find_runs,
    kill_stale_runs,
    last_logged_step,
    log_dataset_inputs,
    log_metrics_now,
    prefect_ids,
    short_client_retries,
)


def config_hash(cfg: TrainConfig) -> str:
    """Hash of everything that determines a run (the output dir aside), the content of the model
    and data files it names included: a model folder replaced under the same path starts a run
    folder of its own instead of meeting the old run's checkpoints."""
    d = config_to_dict(cfg)
    inputs = input_hashes(cfg)
    if inputs:  # none for a built-in model on the embedded task: the folders of earlier runs keep their names
        d["inputs"] = inputs
    d.pop("output_dir", None)
    d.pop("update_threads", None)  # results do not depend on it (a3po.placement.cores); run folders keep their names
    d["rl"].pop("log_completions", None)  # what is logged, not what is trained; run folders keep their names
    d["rl"].pop("eval_mode", None)  # where the held-out figures are computed, not what they are
    later = [("generate_threads", d, 1), ("rollout_cores", d.get("distributed", {}), 0),
             ("filter_groups", d["rl"], False), ("filter_max_prompts", d["rl"], None), ("filter_patience", d["rl"], None),
             ("step_size", d["rl"], "fixed")]
    for key, section, default in later:
        if section.get(key, default) == default:  # fields added later: at their default, the folders of earlier runs keep their names
            section.pop(key, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:8]


def open_child_run(ref: TrackingRef, cfg: TrainConfig, run_dir: Path, warmstart_acc: float) -> tuple[str, int]:
    """``(run_id, last step already logged)``: this flow run's child for ``run_dir`` when a
    retry finds one, else a new child (RUNNING leftovers of killed flow runs marked KILLED)."""
    client = client_for(ref.tracking_uri)
    mine = {"a3po.run_dir": str(run_dir), "mlflow.parentRunId": ref.parent_run_id}
    existing = find_runs(client, ref.experiment_id, mine)
    if existing:
        run_id = existing[0].info.run_id
        client.update_run(run_id, status="RUNNING")
        return run_id, last_logged_step(client, run_id)
    kill_stale_runs(client, ref.experiment_id, {"a3po.run_dir": str(run_dir)}, "a3po.run_dir", note=ref.parent_run_id)
    arm = Arm.of(cfg)
    precision = machine_precision(cfg.dtype, resolve_device(cfg.device))
    tags = {
        "a3po.role": "child",
        "a3po.host": socket.gethostname(),
        "a3po.variant": cfg.rl.variant.value,
        "a3po.arm": arm.name,
        "a3po.oppo": arm.oppo,
        "a3po.placement": arm.placement,
        "a3po.seed": str(cfg.rl.seed),
        "a3po.run_dir": str(run_dir),
        "a3po.config_hash": config_hash(cfg),
        # What dtype resolves to on this machine (dtype auto: bf16 autocast where bf16 is native, else fp32).
        "a3po.precision": precision.name,
        "a3po.precision_reason": precision.reason,
        **topology_tags(run_topology(cfg, None)),
        **prefect_ids(),
    }
    run_id = create_run(client, ref.experiment_id, run_dir.name, tags, config_to_dict(cfg), parent_run_id=ref.parent_run_id)
    log_metrics_now(client, run_id, {"eval/heldout_acc": warmstart_acc}, step=0)
    log_datasets(client, run_id, cfg)
    return run_id, 0


def dataset_inputs(cfg: TrainConfig) -> list[DatasetInput]:
    """The run's train and held-out sets (``data.train_path``, ``data.heldout_path``: in a flow the
    prepared JSONL files) as MLflow dataset inputs (:func:`tasks.tracking.file_dataset`). None for
    the embedded task generated in memory."""
    return [file_dataset(path, f"{name}.jsonl", context)
            for name, context, path in (("train", "training", cfg.data.train_path),
                                        ("heldout", "evaluation", cfg.data.heldout_path)) if path]


def log_datasets(client, run_id: str, cfg: TrainConfig) -> None:
    """Record :func:`dataset_inputs` on the run (:func:`tasks.tracking.log_dataset_inputs`)."""
    log_dataset_inputs(client, run_id, dataset_inputs(cfg))


def run_topology(cfg: TrainConfig, spec: LaunchSpec | None) -> dict[str, Any]:
    """One run's topology, for its child run: the launch's (mode, nodes, ranks per node, world
    size, devices) and what the ranks are: trainer ranks, rollout workers, the rollout engine and
    the ZeRO stage the config's DeepSpeed JSON gives (None without DeepSpeed)."""
    from a3po.config.preflight import read_deepspeed_json, zero_stage

    ds = cfg.distributed.deepspeed_config
    topo = spec.topology() if spec is not None else {"mode": "local", "nodes": 1, "ranks_per_node": 1, "world_size": 1, "devices": None}
    workers = cfg.distributed.rollout_workers
    world = topo["world_size"]
    return {**topo, "trainer_ranks": world - workers if world is not None else None, "rollout_workers": workers,
            "engine": cfg.rollout.engine, "zero_stage": zero_stage(read_deepspeed_json(ds, cfg.rl.grad_clip)) if ds else None}


def topology_tags(topology: dict[str, Any]) -> dict[str, str]:
    return {f"a3po.launch.{k}": str(v) for k, v in topology.items()}


def log_tables(client, run_id: str, folder: Path, log) -> None:
    """The run folder's completion tables on the child run (tasks.completions). A failed upload
    is a warning: the trained run stands, and its tables stay in the folder."""
    try:
        log_completion_tables(client, run_id, folder)
    except Exception as e:  # noqa: BLE001
        log.warning(f"completion tables not logged to MLflow run {run_id} ({type(e).__name__}: {e}); they are in {folder}")


def log_actions(client, run_id: str, path: Path, log) -> None:
    """The run folder's actions (``actions.jsonl``) on the child run as a table and tags
    (tasks.actions). A failed upload is a warning: the trained run stands, and its rows stay in the file."""
    try:
        log_action_table(client, run_id, path)
    except Exception as e:  # noqa: BLE001
        log.warning(f"actions not logged to MLflow run {run_id} ({type(e).__name__}: {e}); they are in {path}")


def start_system_metrics(run_id: str, tracking_uri: str, interval_s: float, resume: bool, log):
    """MLflow's system-metrics sampler, or None: it must never be the reason training fails."""
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        with short_client_retries():
            monitor = SystemMetricsMonitor(run_id, sampling_interval=interval_s, resume_logging=resume, tracking_uri=tracking_uri)
        monitor.start()
        return monitor
    except Exception as e:  # noqa: BLE001
        log.warning(f"system metrics off for this run: {type(e).__name__}: {e}")
        return None


def mark_failed_quietly(shipper: MlflowMetricLogger, client, run_id: str, log) -> None:
    """Best effort on the way out of a failed task: ship what is queued and mark the run
    FAILED, without hiding the original error behind a tracking one."""
    try:
        shipper.close(timeout_s=10)
        client.set_terminated(run_id, status="FAILED")
    except Exception as e:  # noqa: BLE001
        log.warning(f"could not mark MLflow run {run_id} FAILED ({type(e).__name__}); the next run of this folder marks it KILLED")


def write_history(run_dir: Path, history: list[dict[str, float]]) -> Path:
    """``<run_dir>/history.jsonl``, one line per step ``{"step", **metrics}``, written atomically
    (the text whose digest a finished run's record holds: a3po.training.records)."""
    path = run_dir / HISTORY_FILE
    atomic_write_text(path, history_text(history))
    return path


def log_final(client, run_id: str, history: list[dict[str, float]], final_acc: float, **extra: float) -> dict[str, float]:
    """The child run's ``final/...`` metrics (and ``extra``) at its last step; returns them."""
    steps = len(history)
    final = {
        "final/heldout_acc": final_acc,
        "final/reward": final_reward(history),
        "final/train_wall_s": history[-1]["time/train_wall_s"] if history else 0.0,
        "final/mean_step_time_s": sum(h["perf/step_time_s"] for h in history) / max(steps, 1),
        **extra,
    }
    log_metrics_now(client, run_id, final, step=steps)
    return final
