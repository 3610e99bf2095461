"""``warm_start`` and ``train_variant``: thin tasks over :mod:`a3po.training.run`.

``train_variant`` is safe to retry, and a killed flow is safe to re-run: the library resumes
from ``<run_dir>/checkpoints`` (atomic, every ``rl.checkpoint_every`` steps) and, with the
default 'deterministic' schedule, continues exactly as an uninterrupted run would. The run
directory is named by variant, seed and a hash of the config, so a re-run with the same
config resumes and a changed config starts afresh instead of resuming someone else's run.

MLflow: one child run per variant x seed under the flow's parent run, with the run folder's
completion tables logged as MLflow tables when training ends (:mod:`tasks.completions`). A Prefect retry reuses
the child run of its flow run (steps already logged are not logged again); a new flow run
gets a new child run, marks the killed one KILLED and back-fills the steps restored from the
checkpoint, so its record is complete.

The task holds its run folder's lock (:mod:`a3po.storage.runlock`) from start to end, and a tracking
outage does not stop it: metrics land in ``<run_dir>/metrics.jsonl`` and a background shipper
delivers them to MLflow when it can (see :class:`tasks.tracking.MlflowMetricLogger`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml
from prefect import task
from prefect.cache_policies import NO_CACHE

from a3po.config import TrainConfig, config_to_dict
from a3po.storage.checkpoint import atomic_write_text
from a3po.storage.runlock import RunFolderBusy, hold_run_folder
from a3po.training.metrics import FanoutLogger, JsonlLogger
from a3po.training.run import prepare_warmstart, warmstart_key
from a3po.training.run import train_variant as library_train_variant
from infra.launch import LaunchMode, LaunchSpec
from tasks.arms import arm_name, oppo_mode, placement_of
from tasks.completions import log_completion_tables
from tasks.launch import LaunchRecord, launch_ranks
from tasks.runtime import run_logger
from tasks.summary import final_reward
from tasks.tracking import (
    MlflowMetricLogger,
    TrackingRef,
    TrackingUnavailable,
    client_for,
    create_run,
    find_runs,
    kill_stale_runs,
    last_logged_step,
    log_metrics_now,
    log_params,
    prefect_ids,
    short_client_retries,
)


@dataclass(frozen=True)
class WarmStart:
    dir: str  # an HF model directory
    heldout_acc: float
    key: str  # a3po.training.run.warmstart_key of the config
    seconds: float = 0.0  # time in the library call (0 when it found the cache)


def config_hash(cfg: TrainConfig) -> str:
    """Hash of everything that determines a run (the output dir aside)."""
    d = config_to_dict(cfg)
    d.pop("output_dir", None)
    d.pop("update_threads", None)  # results do not depend on it (a3po.placement.cores); run folders keep their names
    d["rl"].pop("log_completions", None)  # what is logged, not what is trained; run folders keep their names
    for key, section, default in (("generate_threads", d, 1), ("rollout_cores", d.get("distributed", {}), 0)):
        if section.get(key, default) == default:  # fields added later: at their default, the folders of earlier runs keep their names
            section.pop(key, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:8]


def run_dir_for(output_dir: str | Path, cfg: TrainConfig) -> Path:
    """``<arm>-seed<seed>-<config hash>``; the arm is the variant when OPPO is off (tasks.arms)."""
    return Path(output_dir).resolve() / f"{arm_name(cfg)}-seed{cfg.rl.seed}-{config_hash(cfg)}"


def warmstart_dir(cfg: TrainConfig, cache_root: str | Path) -> Path:
    return Path(cache_root).resolve() / f"warmstart-{warmstart_key(cfg)}"


def warmstart_ready(cfg: TrainConfig, cache_root: str | Path) -> bool:
    """The warm-start folder is on disk (callers refresh Prefect's cache record when not)."""
    return (warmstart_dir(cfg, cache_root) / "a3po_warmstart.json").exists()


def _warmstart_cache_key(context, inputs) -> str:
    """The library's warm-start key (a config hash) + the folder it lands in."""
    return "warmstart-" + hashlib.sha256(str(warmstart_dir(inputs["cfg"], inputs["cache_root"])).encode()).hexdigest()[:24]


@task(cache_key_fn=_warmstart_cache_key, persist_result=True)
def warm_start(cfg: TrainConfig, cache_root: str) -> WarmStart:
    """Supervised warm start, once per (model, data, warm_start) config. Call it with
    ``.with_options(refresh_cache=not warmstart_ready(...))`` (see ``prepare_dataset``)."""
    t0 = time.perf_counter()
    out, acc = prepare_warmstart(cfg, cache_root, log=run_logger().info)
    return WarmStart(dir=str(Path(out).resolve()), heldout_acc=acc, key=warmstart_key(cfg), seconds=time.perf_counter() - t0)


@dataclass(frozen=True)
class RunRecord:
    variant: str
    arm: str  # the comparison's row: the variant, or <variant>+oppo-<mode> (tasks.arms)
    seed: int
    run_dir: str
    final_dir: str  # HF model directory of the final weights
    history_path: str  # JSONL, one line per step: {"step", **metrics}
    mlflow_run_id: str | None
    warmstart_acc: float
    final_acc: float
    steps: int
    wall_s: float
    resumed_from: int | None
    library_s: float = 0.0  # time inside a3po.training.run.train_variant
    tracking_s: float = 0.0  # MLflow log_batch calls of the metric shipper (its own thread, beside library_s)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


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
    tags = {
        "a3po.role": "child",
        "a3po.host": socket.gethostname(),
        "a3po.variant": cfg.rl.variant.value,
        "a3po.arm": arm_name(cfg),
        "a3po.oppo": oppo_mode(cfg.oppo),
        "a3po.placement": placement_of(cfg),
        "a3po.seed": str(cfg.rl.seed),
        "a3po.run_dir": str(run_dir),
        "a3po.config_hash": config_hash(cfg),
        **topology_tags(run_topology(cfg, None)),
        **prefect_ids(),
    }
    run_id = create_run(client, ref.experiment_id, run_dir.name, tags, config_to_dict(cfg), parent_run_id=ref.parent_run_id)
    log_metrics_now(client, run_id, {"eval/heldout_acc": warmstart_acc}, step=0)
    return run_id, 0


def _worth_retrying(task, task_run, state) -> bool:
    """A retry cannot help a run folder held by another writer, nor a tracking server that
    stayed down through the end-of-task wait (the message says how to back-fill later)."""
    return not isinstance(getattr(state, "data", None), (RunFolderBusy, TrackingUnavailable))


@task(retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE, retry_condition_fn=_worth_retrying)
def train_variant(
    cfg: TrainConfig,
    run_dir: str,
    warmstart: WarmStart,
    tracking: TrackingRef | None = None,
    system_metrics_interval_s: float = 10.0,
    tracking_drain_s: float = 60.0,
) -> RunRecord:
    """RL-train one variant x seed from the warm start (resuming from its last checkpoint).

    Holds the run folder's lock throughout. Metrics go to ``<run_dir>/metrics.jsonl`` first and
    reach MLflow through a background shipper, so a tracking outage never stops training; at the
    end the shipper gets ``tracking_drain_s`` seconds to deliver what is left."""
    log = run_logger()
    with hold_run_folder(run_dir, log=log.warning):
        return _train_locked(cfg, Path(run_dir), warmstart, tracking, system_metrics_interval_s, tracking_drain_s, log)


def _train_locked(
    cfg: TrainConfig, rd: Path, warmstart: WarmStart, tracking: TrackingRef | None, system_metrics_interval_s: float, tracking_drain_s: float, log
) -> RunRecord:
    name = f"{arm_name(cfg)} seed {cfg.rl.seed}"
    every = max(1, cfg.rl.steps // 10)

    def progress(step: int, m: dict[str, float]) -> None:
        if step % every == 0 or step == cfg.rl.steps:
            acc = f"  held-out acc {m['eval/heldout_acc']:.3f}" if "eval/heldout_acc" in m else ""
            log.info(f"{name}: step {step}/{cfg.rl.steps}  reward {m['reward/mean']:.3f}  staleness {m['staleness/mean']:.2f}{acc}")

    local = JsonlLogger(rd / "metrics.jsonl")  # first: survives any tracking outage
    run_id, monitor, shipper, logger = None, None, None, local
    if tracking is not None:
        run_id, done = open_child_run(tracking, cfg, rd, warmstart.heldout_acc)
        client = client_for(tracking.tracking_uri)
        shipper = MlflowMetricLogger(
            client, run_id, skip_through_step=done, kept_in=str(local.path), warn=log.warning, drain_timeout_s=tracking_drain_s
        )
        logger = FanoutLogger(local, shipper)
        monitor = _start_system_metrics(run_id, tracking.tracking_uri, system_metrics_interval_s, done > 0, log)
    t0 = time.perf_counter()
    try:
        with short_client_retries():
            try:
                result = library_train_variant(cfg, rd, warmstart.dir, warmstart.heldout_acc, logger=logger, progress=progress)
            finally:
                library_s = time.perf_counter() - t0
                if monitor is not None:
                    monitor.finish()  # catches its own errors; bounded by the short client timeouts
            if shipper is not None:
                backfilled = shipper.ensure_history(result.history)
                shipper.close()  # raises TrackingUnavailable when the server is still down
    except BaseException as e:
        if shipper is not None and not isinstance(e, TrackingUnavailable):
            _mark_failed(shipper, client, run_id, log)
        raise
    tracking_s = shipper.seconds if shipper is not None else 0.0
    if result.resumed_from:
        log.info(f"{name}: resumed from the checkpoint at step {result.resumed_from}")
    for skipped in result.checkpoints_skipped:
        log.warning(f"{name}: {skipped}")
    history_path = rd / "history.jsonl"
    atomic_write_text(history_path, "".join(json.dumps({"step": i + 1, **h}) + "\n" for i, h in enumerate(result.history)))
    if run_id is not None:
        steps = len(result.history)
        log_metrics_now(client, run_id, {
            "final/heldout_acc": result.final_acc,
            "final/reward": final_reward(result.history),
            "final/train_wall_s": result.history[-1]["time/train_wall_s"] if result.history else 0.0,
            "final/mean_step_time_s": sum(h["perf/step_time_s"] for h in result.history) / max(steps, 1),
        }, step=steps)
        client.set_tag(run_id, "a3po.resumed_from", str(result.resumed_from or 0))
        client.set_tag(run_id, "a3po.backfilled_steps", str(backfilled))
        if result.checkpoints_skipped:  # damaged checkpoints passed over at resume
            client.set_tag(run_id, "a3po.checkpoints_skipped", "\n".join(result.checkpoints_skipped)[:5000])
        _log_tables(client, run_id, rd / "completions", log)
        if shipper.outages:
            log.warning(
                f"{name}: the tracking server was unreachable {shipper.outages} time(s), {shipper.outage_s:.0f} s in all; "
                "every metric was shipped afterwards"
            )
        client.set_terminated(run_id, status="FINISHED")
    return RunRecord(
        variant=result.variant,
        arm=arm_name(cfg),
        seed=result.seed,
        run_dir=str(rd),
        final_dir=str(rd / "final"),
        history_path=str(history_path),
        mlflow_run_id=run_id,
        warmstart_acc=result.warmstart_acc,
        final_acc=result.final_acc,
        steps=result.steps,
        wall_s=result.wall_s,
        resumed_from=result.resumed_from,
        library_s=library_s,
        tracking_s=tracking_s,
    )


# --- a variant x seed trained by launched ranks (``python -m a3po.cli train`` under torchrun / DeepSpeed) ---


def cli_run_dir(run_dir: str | Path, cfg: TrainConfig) -> Path:
    """Where ``a3po train --output-dir <run_dir>`` writes (checkpoints, metrics.jsonl, result.json, final/)."""
    return Path(run_dir) / f"{cfg.rl.variant.value}-seed{cfg.rl.seed}"


def launched_argv(cfg: TrainConfig, run_dir: str | Path) -> list[str]:
    rd = Path(run_dir)
    # --variant always: the CLI's default would override the config's variant.
    return ["-m", "a3po.cli", "train", "--config", str(rd / "config.yaml"), "--variant", cfg.rl.variant.value,
            "--seed", str(cfg.rl.seed), "--output-dir", str(rd), "--no-progress"]


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
    """Per-step metrics (steps 1..N) from the CLI's metrics.jsonl; a step logged twice (a
    resumed run appends) keeps its last line. Errors name the file and line."""
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
            by_step[step] = row
    missing = sorted(set(range(1, max(by_step, default=0) + 1)) - set(by_step))
    if missing:
        raise ValueError(f"{path}: steps {missing[:10]} missing")
    return [by_step[s] for s in sorted(by_step)]


@task(cache_policy=NO_CACHE)
def record_launched_run(cfg: TrainConfig, run_dir: str, tracking: TrackingRef | None, run_id: str | None, launched: LaunchRecord) -> RunRecord:
    """Read what the launched CLI wrote (result.json, metrics.jsonl) into a RunRecord and the child run."""
    rd, out = Path(run_dir), cli_run_dir(run_dir, cfg)
    result_path = out / "result.json"
    if not result_path.exists():
        raise FileNotFoundError(f"{result_path}: the launched ranks exited 0 but wrote no result")
    result = json.loads(result_path.read_text())
    # The eval curve holds the unrounded accuracies (the summary's are rounded to 4 places):
    # its first point is the warm start, its last the final step (always evaluated).
    (_, warmstart_acc), (_, final_acc) = result["eval_curve"][0], result["eval_curve"][-1]
    history = read_metrics_jsonl(out / "metrics.jsonl")
    history_path = rd / "history.jsonl"
    atomic_write_text(history_path, "".join(json.dumps({"step": i + 1, **h}) + "\n" for i, h in enumerate(history)))
    if run_id is not None:
        client = client_for(tracking.tracking_uri)
        logger = MlflowMetricLogger(client, run_id, skip_through_step=last_logged_step(client, run_id))
        logger.ensure_history(history)
        logger.close()  # ships the back-fill, stops the shipper thread
        log_metrics_now(client, run_id, {
            "final/heldout_acc": final_acc,
            "final/reward": final_reward(history),
            "final/train_wall_s": history[-1]["time/train_wall_s"] if history else 0.0,
            "final/mean_step_time_s": sum(h["perf/step_time_s"] for h in history) / max(len(history), 1),
            "launch/wall_s": launched.wall_s,
        }, step=len(history))
        client.set_tag(run_id, "a3po.resumed_from", str(result.get("resumed_from") or 0))
        _log_tables(client, run_id, out / "completions", run_logger())
        client.set_terminated(run_id, status="FINISHED")
    return RunRecord(
        variant=result["variant"], arm=arm_name(cfg), seed=result["seed"], run_dir=str(rd), final_dir=str(out / "final"),
        history_path=str(history_path), mlflow_run_id=run_id, warmstart_acc=warmstart_acc,
        final_acc=final_acc, steps=result["steps"], wall_s=result["wall_s"],
        resumed_from=result.get("resumed_from"), library_s=launched.wall_s,
    )


@task(cache_policy=NO_CACHE)
def mark_run_failed(tracking: TrackingRef, run_id: str) -> None:
    client_for(tracking.tracking_uri).set_terminated(run_id, status="FAILED")


def train_launched(cfg: TrainConfig, run_dir: str, warmstart: WarmStart, tracking: TrackingRef | None, spec: LaunchSpec) -> RunRecord:
    """The launched counterpart of :func:`train_variant` (called from a flow): config YAML ->
    ``launch_ranks`` running ``python -m a3po.cli train`` -> the CLI's results -> the child run.
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
def _log_tables(client, run_id: str, folder: Path, log) -> None:
    """The run folder's completion tables on the child run (tasks.completions). A failed upload
    is a warning: the trained run stands, and its tables stay in the folder."""
    try:
        log_completion_tables(client, run_id, folder)
    except Exception as e:  # noqa: BLE001
        log.warning(f"completion tables not logged to MLflow run {run_id} ({type(e).__name__}: {e}); they are in {folder}")


def _start_system_metrics(run_id: str, tracking_uri: str, interval_s: float, resume: bool, log):
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


def _mark_failed(shipper: MlflowMetricLogger, client, run_id: str, log) -> None:
    """Best effort on the way out of a failed task: ship what is queued and mark the run
    FAILED, without hiding the original error behind a tracking one."""
    try:
        shipper.close(timeout_s=10)
        client.set_terminated(run_id, status="FAILED")
    except Exception as e:  # noqa: BLE001
        log.warning(f"could not mark MLflow run {run_id} FAILED ({type(e).__name__}); the next run of this folder marks it KILLED")
