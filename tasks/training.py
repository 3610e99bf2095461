"""``warm_start`` and ``train_arm``: thin tasks over :mod:`a3po.training.run` (its ``prepare_warmstart``
and ``train_variant``), training in the flow's process. The MLflow child run's lifecycle is
:mod:`tasks.child_run`; the same arm trained by launched ranks is :mod:`tasks.launched`.

``train_arm`` is safe to retry, and a killed flow is safe to re-run: the library resumes
from ``<run_dir>/checkpoints`` (atomic, every ``rl.checkpoint_every`` steps) and, with the
default 'deterministic' schedule, continues exactly as an uninterrupted run would. The run
directory is named by variant, seed and a hash of the config, so a re-run with the same
config resumes and a changed config starts afresh instead of resuming someone else's run. A run
that finished (its ``result.json``, ``history.jsonl`` and ``final/``) is not trained again: its
record is reused, so a re-run still judges it after its checkpoints were deleted to save disk,
once it has passed the checks of :mod:`a3po.training.records` (the digests written with it, its
seed, variant and final figure); a record that fails them is named and not reused.

MLflow: one child run per arm x seed under the flow's parent run (:mod:`tasks.child_run`). A new
flow run back-fills the steps restored from the checkpoint into its new child run, so its record
is complete.

The task holds its run folder's lock (:mod:`a3po.storage.runlock`) from start to end, and a tracking
outage does not stop it: metrics land in ``<run_dir>/metrics.jsonl`` and a background shipper
delivers them to MLflow when it can (see :class:`tasks.tracking.MlflowMetricLogger`).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from a3po.config import TrainConfig
from a3po.devices import machine_precision, resolve_device
from a3po.storage.checkpoint import DiskFullError
from a3po.storage.runlock import RunFolderBusy, hold_run_folder
from a3po.training.actions import FILE as ACTIONS_FILE
from a3po.training.metrics import FanoutLogger, JsonlLogger
from a3po.training.records import RecordRefused, finished_record
from a3po.training.run import prepare_warmstart, warmstart_folder, warmstart_problem
from a3po.training.run import train_variant as library_train_variant
from tasks.arms import Arm
from tasks.artifacts import TrainingProgress, progress_key
from tasks.child_run import (
    config_hash,
    log_actions,
    log_final,
    log_tables,
    mark_failed_quietly,
    open_child_run,
    start_system_metrics,
    write_history,
)
from tasks.models import log_final_model
from tasks.runtime import run_logger
from tasks.tracking import MlflowMetricLogger, TrackingRef, TrackingUnavailable, client_for, metric_steps, short_client_retries


@dataclass(frozen=True)
class WarmStart:
    dir: str  # an HF model directory
    heldout_acc: float
    key: str  # its folder's key: the config and the content of the files it names (a3po.training.run.warmstart_folder)
    seconds: float = 0.0  # time in the library call (0 when it found the cache)


def run_dir_for(output_dir: str | Path, cfg: TrainConfig) -> Path:
    """``<arm>-seed<seed>-<config hash>``; the arm is the variant when OPPO is off (tasks.arms)."""
    return Path(output_dir).resolve() / f"{Arm.of(cfg).name}-seed{cfg.rl.seed}-{config_hash(cfg)}"


def warmstart_dir(cfg: TrainConfig, cache_root: str | Path) -> Path:
    return warmstart_folder(cfg, Path(cache_root).resolve())


def warmstart_ready(cfg: TrainConfig, cache_root: str | Path) -> bool:
    """The warm-start folder is on disk and its files hash as recorded when it was written
    (callers refresh Prefect's cache record when not, so a damaged folder is trained again)."""
    return warmstart_problem(warmstart_dir(cfg, cache_root)) is None


def _warmstart_cache_key(context, inputs) -> str:
    """The folder the warm start lands in, named by the library's key (the config and the content
    of the model and data files it names: a folder replaced under the same path is another key)."""
    return "warmstart-" + hashlib.sha256(str(warmstart_dir(inputs["cfg"], inputs["cache_root"])).encode()).hexdigest()[:24]


@task(cache_key_fn=_warmstart_cache_key, persist_result=True)
def warm_start(cfg: TrainConfig, cache_root: str) -> WarmStart:
    """Supervised warm start, once per (model, data, warm_start) config. Call it with
    ``.with_options(refresh_cache=not warmstart_ready(...))`` (see ``prepare_dataset``)."""
    t0 = time.perf_counter()
    out, acc = prepare_warmstart(cfg, cache_root, log=run_logger().info)
    key = Path(out).name.removeprefix("warmstart-")  # not hashed again: the folder is named by it
    return WarmStart(dir=str(Path(out).resolve()), heldout_acc=acc, key=key, seconds=time.perf_counter() - t0)


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
    model_id: str | None = None  # the final policy's MLflow logged model (tasks.models); None: no tracking, or refused
    tracking_s: float = 0.0  # MLflow log_batch calls of the metric shipper (its own thread, beside library_s)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _worth_retrying(task, task_run, state) -> bool:
    """A retry cannot help a run folder held by another writer, a tracking server that stayed
    down through the end-of-task wait (the message says how to back-fill later), nor a full disk
    (it would train again up to the same checkpoint, and fail there)."""
    return not isinstance(getattr(state, "data", None), (RunFolderBusy, TrackingUnavailable, DiskFullError))


@task(retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE, retry_condition_fn=_worth_retrying)
def train_arm(
    cfg: TrainConfig,
    run_dir: str,
    warmstart: WarmStart,
    tracking: TrackingRef | None = None,
    system_metrics_interval_s: float = 10.0,
    tracking_drain_s: float = 60.0,
) -> RunRecord:
    """RL-train one arm x seed from the warm start (resuming from its last checkpoint).

    Holds the run folder's lock throughout. Metrics go to ``<run_dir>/metrics.jsonl`` first and
    reach MLflow through a background shipper, so a tracking outage never stops training; at the
    end the shipper gets ``tracking_drain_s`` seconds to deliver what is left."""
    log = run_logger()
    with hold_run_folder(run_dir, log=log.warning):
        return _train_locked(cfg, Path(run_dir), warmstart, tracking, system_metrics_interval_s, tracking_drain_s, log)


def _train_locked(
    cfg: TrainConfig, rd: Path, warmstart: WarmStart, tracking: TrackingRef | None, system_metrics_interval_s: float, tracking_drain_s: float, log
) -> RunRecord:
    name = f"{Arm.of(cfg).name} seed {cfg.rl.seed}"
    every = max(1, cfg.rl.steps // 10)
    precision = machine_precision(cfg.dtype, resolve_device(cfg.device))
    (log.warning if precision.slow else log.info)(f"{name}: precision: {precision.reason}")

    # The same line in the log and on the task's progress artifact (tasks.artifacts), as steps finish.
    shown = TrainingProgress(progress_key(Arm.of(cfg).name, cfg.rl.seed, tracking.experiment_id if tracking else "none"), cfg.rl.steps)

    def progress(step: int, m: dict[str, float]) -> None:
        if step % every == 0 or step == cfg.rl.steps:
            acc = f"  held-out acc {m['eval/heldout_acc']:.3f}" if "eval/heldout_acc" in m else ""
            line = f"{name}: step {step}/{cfg.rl.steps}  reward {m['reward/mean']:.3f}  staleness {m['staleness/mean']:.2f}{acc}"
            log.info(line)
            shown.report(step, line)

    try:
        finished = finished_record(rd, cfg.rl.variant.value, cfg.rl.seed, cfg.rl.steps)
    except RecordRefused as e:  # not what the run wrote: its checkpoints rewrite it (or, without any, it is refused)
        log.warning(f"{name}: finished earlier, but its record is not reused: {e}; it resumes from its checkpoints")
        finished = None
    if finished is not None:  # its checkpoints may be gone (dropped for disk): nothing to train, its record reused
        return _reuse_finished(cfg, rd, *finished, warmstart, tracking, tracking_drain_s, log, name)
    local = JsonlLogger(rd / "metrics.jsonl")  # first: survives any tracking outage
    run_id, monitor, shipper, logger, model_id = None, None, None, local, None
    if tracking is not None:
        client, run_id, done, shipper = _open_tracking(tracking, cfg, rd, warmstart, local.path, tracking_drain_s, log)
        logger = FanoutLogger(local, shipper)
        monitor = start_system_metrics(run_id, tracking.tracking_uri, system_metrics_interval_s, done > 0, log)
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
            mark_failed_quietly(shipper, client, run_id, log)
        raise
    tracking_s = shipper.seconds if shipper is not None else 0.0
    if result.resumed_from:
        log.info(f"{name}: resumed from the checkpoint at step {result.resumed_from}")
    for skipped in result.checkpoints_skipped:
        log.warning(f"{name}: {skipped}")
    history_path = write_history(rd, result.history)
    if run_id is not None:
        tags = {"a3po.resumed_from": str(result.resumed_from or 0), "a3po.backfilled_steps": str(backfilled)}
        if result.checkpoints_skipped:  # damaged checkpoints passed over at resume
            tags["a3po.checkpoints_skipped"] = "\n".join(result.checkpoints_skipped)[:5000]
        model_id = _close_child_run(client, run_id, shipper, rd, result.history, result.final_acc, tags, log, name, cfg)
    return RunRecord(
        variant=result.variant,
        arm=Arm.of(cfg).name,
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
        model_id=model_id,
    )


def _open_tracking(
    tracking: TrackingRef, cfg: TrainConfig, rd: Path, warmstart: WarmStart, kept_in: Path, tracking_drain_s: float, log,
) -> tuple[Any, str, int, MlflowMetricLogger]:
    """``(client, run_id, last step already logged, shipper)``: the arm's child run of this flow run
    (a retry's own, or a new one) and the shipper that fills it, skipping what a retry logged."""
    run_id, done = open_child_run(tracking, cfg, rd, warmstart.heldout_acc)
    client = client_for(tracking.tracking_uri)
    shipper = MlflowMetricLogger(
        client, run_id, skip_through_step=done, late_steps_logged=metric_steps(client, run_id, "eval/heldout_acc") if done else frozenset(),
        kept_in=str(kept_in), warn=log.warning, drain_timeout_s=tracking_drain_s,
    )
    return client, run_id, done, shipper


def _reuse_finished(
    cfg: TrainConfig, rd: Path, summary: dict[str, Any], history: list[dict[str, float]], warmstart: WarmStart,
    tracking: TrackingRef | None, tracking_drain_s: float, log, name: str,
) -> RunRecord:
    """The record of a run finished earlier (:func:`a3po.training.records.finished_record`), in a child
    run of this flow run with every step, as a run resumed at its last step would have: a re-run
    of a comparison whose checkpoints were deleted to save disk judges the runs it has."""
    log.info(f"{name}: finished earlier ({rd / 'result.json'}): its record reused, nothing trained")
    run_id, model_id = None, None
    if tracking is not None:
        client, run_id, _, shipper = _open_tracking(tracking, cfg, rd, warmstart, rd / "history.jsonl", tracking_drain_s, log)
        try:
            with short_client_retries():
                backfilled = shipper.ensure_history(history)
                shipper.close()
        except BaseException as e:
            if not isinstance(e, TrackingUnavailable):
                mark_failed_quietly(shipper, client, run_id, log)
            raise
        tags = {"a3po.resumed_from": str(summary["steps"]), "a3po.backfilled_steps": str(backfilled),
                "a3po.reused_record": str(rd / "result.json")}
        model_id = _close_child_run(client, run_id, shipper, rd, history, summary["final_acc"], tags, log, name, cfg)
    return RunRecord(
        variant=summary["variant"],
        arm=Arm.of(cfg).name,
        seed=summary["seed"],
        run_dir=str(rd),
        final_dir=str(rd / "final"),
        history_path=str(rd / "history.jsonl"),
        mlflow_run_id=run_id,
        warmstart_acc=summary["warmstart_acc"],
        final_acc=summary["final_acc"],
        steps=summary["steps"],
        wall_s=summary["wall_s"],
        resumed_from=summary["steps"],  # nothing left to train: as a resume at the last step
        model_id=model_id,
    )


def _close_child_run(
    client, run_id: str, shipper: MlflowMetricLogger, rd: Path, history: list[dict[str, float]], final_acc: float,
    tags: dict[str, str], log, name: str, cfg: TrainConfig,
) -> str | None:
    """A finished arm's child run: its final figures, its final model (an MLflow logged model:
    tasks.models), tags, completion and action tables, FINISHED; the model's id (None: refused)."""
    final = log_final(client, run_id, history, final_acc)
    model_id = log_final_model(client, run_id, Arm.of(cfg).name, cfg.rl.seed, rd, final, len(history))
    for key, value in tags.items():
        client.set_tag(run_id, key, value)
    log_tables(client, run_id, rd / "completions", log)
    log_actions(client, run_id, rd / ACTIONS_FILE, log)  # what the guard and the staleness bound did, and why
    if shipper.outages:
        log.warning(
            f"{name}: the tracking server was unreachable {shipper.outages} time(s), {shipper.outage_s:.0f} s in all; "
            "every metric was shipped afterwards"
        )
    client.set_terminated(run_id, status="FINISHED")
    return model_id
