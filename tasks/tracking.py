"""MLflow tracking: the library's :class:`~a3po.metrics.MetricLogger` over ``MlflowClient``,
and parent / child runs addressed by explicit run id.

Why explicit ids: MLflow's active run is thread-local and Prefect may run a task in a worker
thread, so nothing here uses ``mlflow.start_run``'s implicit state. A flow run owns one parent
run (tagged with the Prefect flow-run id); every variant x seed is a child run whose parent is
named by the ``mlflow.parentRunId`` tag.

Why batching: one ``log_metric`` call is a database round trip (SQLite: a transaction). The
logger buffers a step's ~25 metrics and sends them with ``log_batch`` (up to 1000 per call)
every ``flush_every_s`` seconds or when the buffer is full, so tracking costs a few calls per
run instead of one per value.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from prefect import task
from prefect.cache_policies import NO_CACHE

from a3po.metrics import valid_metric_key
from tasks.runtime import sqlite_path

MAX_METRICS_PER_BATCH = 1000  # MLflow's limit per log_batch call
MAX_PARAMS_PER_BATCH = 100
MAX_PARAM_CHARS = 6000
# MLflow 3's UI opens an experiment of this kind on its runs (not the GenAI overview).
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}


@dataclass(frozen=True)
class TrackingRef:
    """Where a flow run's runs live; passed to tasks instead of MLflow's thread-local state."""

    tracking_uri: str
    experiment_id: str
    parent_run_id: str


def client_for(tracking_uri: str):
    import mlflow
    from mlflow.tracking import MlflowClient

    # The global URI too: artifact repositories of ``mlflow-artifacts:`` runs resolve through it.
    mlflow.set_tracking_uri(tracking_uri)
    return MlflowClient(tracking_uri=tracking_uri)


def ensure_experiment(client, name: str, tracking_uri: str) -> str:
    """The experiment's id, created if needed. Next to a SQLite store its artifacts go to
    ``<db dir>/mlartifacts/<name>`` (absolute), never to a cwd-relative ``./mlruns``."""
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        for k, v in EXPERIMENT_KIND.items():
            if k not in exp.tags:  # an experiment made before this tag, or by hand; a kind set by a person stays
                client.set_experiment_tag(exp.experiment_id, k, v)
        return exp.experiment_id
    db = sqlite_path(tracking_uri)
    location = (db.resolve().parent / "mlartifacts" / name).as_uri() if db is not None else None
    try:
        return client.create_experiment(name, artifact_location=location, tags=EXPERIMENT_KIND)
    except Exception:  # noqa: BLE001 - created concurrently by another process
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"rl": {"lr": 1e-3}}`` -> ``{"rl.lr": "0.001"}`` (MLflow params are strings)."""
    out: dict[str, str] = {}
    for k, v in values.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = str(v.value if hasattr(v, "value") else v)[:MAX_PARAM_CHARS]
    return out


def log_params(client, run_id: str, params: Mapping[str, Any]) -> None:
    from mlflow.entities import Param

    items = [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in flatten(params).items()]
    for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=items[i : i + MAX_PARAMS_PER_BATCH])


def create_run(client, experiment_id: str, run_name: str, tags: Mapping[str, str], params: Mapping[str, Any] | None = None, parent_run_id: str | None = None) -> str:
    tags = {k: str(v) for k, v in tags.items()}
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    run = client.create_run(experiment_id, run_name=run_name, tags=tags)
    if params:
        log_params(client, run.info.run_id, params)
    return run.info.run_id


def find_runs(client, experiment_id: str, tags: Mapping[str, str], status: str | None = None, max_results: int = 1000) -> list:
    """Runs of ``experiment_id`` carrying all ``tags`` (and ``status``), newest first."""
    clauses = [f"tags.`{k}` = '{v}'" for k, v in tags.items()]
    if status:
        clauses.append(f"attributes.status = '{status}'")
    return client.search_runs([experiment_id], " and ".join(clauses), max_results=max_results, order_by=["attributes.start_time DESC"])


def kill_stale_runs(client, experiment_id: str, tags: Mapping[str, str], keep: Iterable[str] = (), note: str = "") -> list[str]:
    """Mark RUNNING runs with ``tags`` KILLED: what a SIGKILLed flow leaves behind. Returns their ids."""
    keep = set(keep)
    killed = []
    for run in find_runs(client, experiment_id, tags, status="RUNNING"):
        if run.info.run_id in keep:
            continue
        if note:
            client.set_tag(run.info.run_id, "a3po.superseded_by", note)
        client.set_terminated(run.info.run_id, status="KILLED")
        killed.append(run.info.run_id)
    return killed


def log_metrics_now(client, run_id: str, metrics: Mapping[str, float], step: int = 0) -> None:
    """One batch of metrics (validated keys); for summaries and evaluation results."""
    from mlflow.entities import Metric

    _check_keys(metrics)
    ts = int(time.time() * 1000)
    items = [Metric(k, float(v), ts, step) for k, v in metrics.items()]
    for i in range(0, len(items), MAX_METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=items[i : i + MAX_METRICS_PER_BATCH])


def _check_keys(metrics: Mapping[str, Any]) -> None:
    bad = [k for k in metrics if not valid_metric_key(k)]
    if bad:
        raise ValueError(f"invalid MLflow metric key(s) {bad}: use letters, digits and _ - . / only")


class MlflowMetricLogger:
    """A :class:`~a3po.metrics.MetricLogger` writing to one MLflow run by id, batched.

    ``skip_through_step``: steps at or below it are already in the run (a retried task resumes
    a child run) and are not logged again. :meth:`ensure_history` back-fills any step of a
    finished history that never reached the run (the steps a resumed run restored from its
    checkpoint), so every child run holds the complete per-step record.
    """

    def __init__(self, client, run_id: str, flush_every_s: float = 5.0, max_buffer: int = MAX_METRICS_PER_BATCH, skip_through_step: int = -1) -> None:
        self.client, self.run_id = client, run_id
        self.flush_every_s, self.max_buffer = flush_every_s, max_buffer
        self.skip_through_step = skip_through_step
        self.logged_steps: set[int] = set()
        self.n_calls = 0  # log_batch calls made and seconds spent in them (the overhead bench reports both)
        self.seconds = 0.0
        self._buf: list = []
        self._last_flush = time.monotonic()
        self._lock = threading.Lock()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        if step <= self.skip_through_step:
            return
        _check_keys(metrics)
        ts = int(time.time() * 1000)
        with self._lock:
            self._buf.extend(Metric(k, float(v), ts, step) for k, v in metrics.items())
            self.logged_steps.add(step)
            due = len(self._buf) >= self.max_buffer or time.monotonic() - self._last_flush >= self.flush_every_s
        if due:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            buf, self._buf = self._buf, []
            self._last_flush = time.monotonic()
        t0 = time.perf_counter()
        for i in range(0, len(buf), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=buf[i : i + MAX_METRICS_PER_BATCH])
            self.n_calls += 1
        self.seconds += time.perf_counter() - t0

    def ensure_history(self, history: list[dict[str, float]], first_step: int = 1) -> int:
        """Log entry ``i`` of ``history`` at step ``first_step + i`` unless that step is already
        in the run; returns how many steps were back-filled."""
        n = 0
        for i, metrics in enumerate(history):
            step = first_step + i
            if step not in self.logged_steps and step > self.skip_through_step:
                self.log_metrics(metrics, step)
                n += 1
        self.flush()
        return n

    def close(self) -> None:
        self.flush()


def last_logged_step(client, run_id: str, key: str = "reward/mean") -> int:
    history = client.get_metric_history(run_id, key)
    return max((m.step for m in history), default=0)


def prefect_ids() -> dict[str, str]:
    """Tags naming the current Prefect flow run / task run (empty outside Prefect)."""
    from prefect.runtime import flow_run, task_run

    tags = {}
    if flow_run.id:
        tags["prefect.flow_run_id"] = str(flow_run.id)
        tags["prefect.flow_name"] = str(flow_run.flow_name)
    if task_run.id:
        tags["prefect.task_run_id"] = str(task_run.id)
    return tags


# --- Prefect tasks: one MLflow side effect each -------------------------------------------


@task(cache_policy=NO_CACHE)
def open_parent_run(tracking_uri: str, experiment: str, run_name: str, output_dir: str, tags: dict[str, str], params: dict[str, Any]) -> TrackingRef:
    """Create the flow run's parent run. RUNNING parents left by a killed run of the same
    output dir are marked KILLED first (they can never finish)."""
    client = client_for(tracking_uri)
    exp_id = ensure_experiment(client, experiment, tracking_uri)
    out = str(Path(output_dir).resolve())
    ids = prefect_ids()
    kill_stale_runs(client, exp_id, {"a3po.output_dir": out, "a3po.role": "parent"}, note=ids.get("prefect.flow_run_id", "rerun"))
    run_id = create_run(client, exp_id, run_name, {**tags, **ids, "a3po.output_dir": out, "a3po.role": "parent"}, params)
    return TrackingRef(tracking_uri, exp_id, run_id)


@task(cache_policy=NO_CACHE)
def close_parent_run(ref: TrackingRef, status: str = "FINISHED", tags: dict[str, str] | None = None) -> None:
    client = client_for(ref.tracking_uri)
    for k, v in (tags or {}).items():
        client.set_tag(ref.parent_run_id, k, str(v))
    client.set_terminated(ref.parent_run_id, status=status)


@task(cache_policy=NO_CACHE)
def log_evaluation(ref: TrackingRef, run_id: str, evaluation: dict[str, Any]) -> None:
    """Evaluation metrics (``eval/final/...``) on the variant's child run; skipped benchmarks
    become ``eval.skipped.<name>`` tags carrying the reason."""
    client = client_for(ref.tracking_uri)
    log_metrics_now(client, run_id, evaluation["metrics"], step=evaluation.get("step", 0))
    for name, reason in evaluation.get("skipped", {}).items():
        client.set_tag(run_id, f"eval.skipped.{name}", reason[:5000])
    if evaluation.get("results_path") and Path(evaluation["results_path"]).exists():
        client.log_artifact(run_id, evaluation["results_path"], artifact_path="eval")


@task(cache_policy=NO_CACHE)
def log_to_parent(ref: TrackingRef, metrics: dict[str, float], artifacts: list[str], tags: dict[str, str] | None = None, artifact_path: str | None = None) -> None:
    """Summary metrics, tags and artifact files on the parent run."""
    client = client_for(ref.tracking_uri)
    if metrics:
        log_metrics_now(client, ref.parent_run_id, metrics)
    for k, v in (tags or {}).items():
        client.set_tag(ref.parent_run_id, k, str(v))
    for path in artifacts:
        client.log_artifact(ref.parent_run_id, path, artifact_path=artifact_path)
