"""MLflow tracking: the library's :class:`~a3po.training.metrics.MetricLogger` over ``MlflowClient``,
and parent / child runs addressed by explicit run id.

Why explicit ids: MLflow's active run is thread-local and Prefect may run a task in a worker
thread, so nothing here uses ``mlflow.start_run``'s implicit state. A flow run owns one parent
run (tagged with the Prefect flow-run id); every variant x seed is a child run whose parent is
named by the ``mlflow.parentRunId`` tag.

Why batching: one ``log_metric`` call is a database round trip (SQLite: a transaction). The
logger buffers a step's ~25 metrics and sends them with ``log_batch`` (up to 1000 per call)
every ``flush_every_s`` seconds or when the buffer is full, so tracking costs a few calls per
run instead of one per value.

Why a background shipper: the tracking server is another machine's process. Training writes
its metrics to the run folder first (``metrics.jsonl``) and the shipper thread carries them to
MLflow, keeping them through an outage and sending them, in order, when the server returns;
training never waits on it.

Superseding: a RUNNING run whose folder nobody holds (:mod:`a3po.storage.runlock`) was left by a killed
process and is marked KILLED by the next run of that folder; a live run's folder is locked, so
it is never touched.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping
from urllib.parse import urlsplit

from mlflow.entities import Dataset, DatasetInput, InputTag
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT
from prefect import task
from prefect.cache_policies import NO_CACHE

from a3po.redact import mask_uri
from a3po.storage.content import sha256_file
from a3po.storage.runlock import in_use_by_another
from a3po.training.metrics import valid_metric_key
from tasks.runtime import run_logger, sqlite_path

MAX_METRICS_PER_BATCH = 1000  # MLflow's limit per log_batch call
MAX_PARAMS_PER_BATCH = 100
MAX_PARAM_CHARS = 6000
# MLflow 3's UI opens an experiment of this kind on its runs (not the GenAI overview).
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
# A run's Description in the UI: Markdown in this tag, at most MLflow's largest tag value.
DESCRIPTION_TAG = "mlflow.note.content"
MAX_DESCRIPTION_CHARS = 8000


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


def create_run(client, experiment_id: str, run_name: str, tags: Mapping[str, str], params: Mapping[str, Any] | None = None,
               parent_run_id: str | None = None) -> str:
    tags = {k: str(v) for k, v in tags.items()}
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    run = client.create_run(experiment_id, run_name=run_name, tags=tags)
    if params:
        log_params(client, run.info.run_id, params)
    return run.info.run_id


def set_description(client, run_id: str, markdown: str) -> None:
    """The run's Description (rendered as Markdown by the UI); the only writer of the tag."""
    if not markdown.strip():
        raise ValueError(f"empty description for run {run_id}: a run's Description says what it holds")
    if len(markdown) > MAX_DESCRIPTION_CHARS:
        raise ValueError(f"description of run {run_id} has {len(markdown)} characters; "
                         f"MLflow keeps at most {MAX_DESCRIPTION_CHARS}")
    client.set_tag(run_id, DESCRIPTION_TAG, markdown)


def find_runs(client, experiment_id: str, tags: Mapping[str, str], status: str | None = None, max_results: int = 1000) -> list:
    """Runs of ``experiment_id`` carrying all ``tags`` (and ``status``), newest first."""
    clauses = [f"tags.`{k}` = '{v}'" for k, v in tags.items()]
    if status:
        clauses.append(f"attributes.status = '{status}'")
    return client.search_runs([experiment_id], " and ".join(clauses), max_results=max_results, order_by=["attributes.start_time DESC"])


def kill_stale_runs(client, experiment_id: str, tags: Mapping[str, str], folder_tag: str, keep: Iterable[str] = (), note: str = "") -> list[str]:
    """Mark KILLED the RUNNING runs with ``tags`` whose owner is gone: what a SIGKILLed flow
    leaves behind. The owner of a run is whoever holds the run folder named by its
    ``folder_tag`` tag (:mod:`a3po.storage.runlock`); a run whose folder another live process holds
    is left alone, and so is one recorded on another host (its lock cannot be checked from
    here). Returns the ids marked."""
    keep = set(keep)
    killed = []
    for run in find_runs(client, experiment_id, tags, status="RUNNING"):
        run_tags = run.data.tags
        if run.info.run_id in keep or run_tags.get("a3po.host", socket.gethostname()) != socket.gethostname():
            continue
        if run_tags.get(folder_tag) and in_use_by_another(run_tags[folder_tag]):
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


class TrackingUnreachable(RuntimeError):
    """The tracking store did not answer the probe made before a flow starts anything."""


# Ports of the stores MLflow reaches over the network, when the URI names none.
DEFAULT_PORTS = {"http": 80, "https": 443, "postgresql": 5432, "mysql": 3306, "mssql": 1433}


def probe_tracking(tracking_uri: str, timeout_s: float = 3.0) -> None:
    """One TCP connection to the store's host, bounded by ``timeout_s``; raise
    :class:`TrackingUnreachable` naming the (masked) URI when it fails. Without it a store that
    is down from the start costs minutes of MLflow's HTTP retries (7, backoff 2 s x 2^n) per call.
    Local stores (``sqlite:///``, a path) are not probed."""
    parts = urlsplit(tracking_uri)
    if not parts.hostname:
        return
    try:
        port = parts.port or DEFAULT_PORTS.get(parts.scheme.split("+")[0])
    except ValueError as e:  # a port that is not a number
        raise TrackingUnreachable(f"tracking URI {mask_uri(tracking_uri)}: {e}") from None
    if port is None:
        return  # a scheme whose port we cannot guess: MLflow's own errors will say
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as e:
        raise TrackingUnreachable(
            f"the MLflow tracking store {mask_uri(tracking_uri)} is unreachable ({parts.hostname}:{port}: "
            f"{e.strerror or type(e).__name__}); nothing was started. Start it, or point --tracking-uri / "
            f"MLFLOW_TRACKING_URI at a running one."
        ) from None


class TrackingUnavailable(RuntimeError):
    """The tracking server stayed unreachable past the end-of-task wait (metrics are safe locally)."""


@contextlib.contextmanager
def short_client_retries(max_retries: int = 0, timeout_s: int = 30) -> Iterator[None]:
    """Fail fast instead of MLflow's default ~4 minutes of retries per HTTP call (7 retries,
    backoff 2 s x 2^n, 120 s timeout), for the duration of training: the shipper retries with
    its own backoff and the training loop never waits on it. MLflow reads these variables per
    request and process-wide; values the user set are kept."""
    keys = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(max_retries), "MLFLOW_HTTP_REQUEST_TIMEOUT": str(timeout_s)}
    added = [k for k in keys if k not in os.environ]
    os.environ.update({k: keys[k] for k in added})
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


class MlflowMetricLogger:
    """A :class:`~a3po.training.metrics.MetricLogger` writing to one MLflow run by id, batched and shipped
    by a background thread, so tracking can never stop training.

    ``log_metrics`` only queues (in order). The shipper sends the queue with ``log_batch`` every
    ``flush_every_s`` seconds, when ``max_buffer`` values wait, or on :meth:`flush`. When a call
    fails it keeps the batch, warns once per outage (through ``warn``), retries with backoff
    (1, 2, 4 ... ``retry_max_s`` seconds) and, when the server answers again, ships the backlog
    in order and records the outage on the run (tags ``a3po.tracking_outage_s``: total seconds,
    ``a3po.tracking_outages``: count). ``kept_in`` names the local file that holds the same
    metrics (the warning tells the user where they are safe).

    ``skip_through_step``: steps at or below it are already in the run (a retried task resumes
    a child run) and are not logged again, except the figures that can arrive after their step
    (:data:`LATE_PREFIX`: a background held-out evaluation, or one a resumed run re-runs) at a step
    outside ``late_steps_logged`` (:func:`metric_steps` of ``eval/heldout_acc``: where the run has them).
    :meth:`ensure_history` back-fills any step of a finished history that never reached the run (the
    steps a resumed run restored from its checkpoint), so every child run holds the complete per-step record.
    """

    def __init__(
        self,
        client,
        run_id: str,
        flush_every_s: float = 5.0,
        max_buffer: int = MAX_METRICS_PER_BATCH,
        skip_through_step: int = -1,
        late_steps_logged: frozenset[int] = frozenset(),
        kept_in: str | None = None,
        warn=None,
        retry_max_s: float = 30.0,
        drain_timeout_s: float = 60.0,
    ) -> None:
        self.client, self.run_id = client, run_id
        self.flush_every_s, self.max_buffer = flush_every_s, max_buffer
        self.skip_through_step, self.late_steps_logged = skip_through_step, frozenset(late_steps_logged)
        self.kept_in, self.retry_max_s, self.drain_timeout_s = kept_in, retry_max_s, drain_timeout_s
        self._warn = warn or logging.getLogger("a3po.tracking").warning
        self.logged_steps: set[int] = set()
        self.n_calls = 0  # log_batch calls made and seconds spent in them (the overhead bench reports both)
        self.seconds = 0.0
        self.outage_s, self.outages = 0.0, 0  # total unreachable time and number of outages
        self.down_since: float | None = None  # wall clock of the current outage's first failure
        self.last_error = ""
        self._pending: list = []  # Metric objects not yet shipped, in logging order
        self._tags: dict[str, str] = {}  # run tags to send with the next batch
        self._flush_wanted = self._stop = False
        self._last_ship = time.monotonic()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._ship_forever, name=f"mlflow-shipper-{run_id[:8]}", daemon=True)
        self._thread.start()

    # --- training side: never blocks on the server ---

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        if step <= self.skip_through_step:
            late = step not in self.late_steps_logged
            metrics = {k: v for k, v in metrics.items() if late and k.startswith(LATE_PREFIX)}
            if not metrics:
                return
        _check_keys(metrics)
        ts = int(time.time() * 1000)
        with self._cond:
            self._pending.extend(Metric(k, float(v), ts, step) for k, v in metrics.items())
            self.logged_steps.add(step)
            if len(self._pending) >= self.max_buffer and self.down_since is None:
                self._cond.notify_all()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Ship everything queued; wait up to ``timeout_s`` (default ``drain_timeout_s``).
        True when the queue is empty."""
        with self._cond:
            self._flush_wanted = True
            self._cond.notify_all()
            done = self._cond.wait_for(lambda: not self._pending and not self._tags, timeout=self.drain_timeout_s if timeout_s is None else timeout_s)
            self._flush_wanted = False
            return done

    def ensure_history(self, history: list[dict[str, float]], first_step: int = 1) -> int:
        """Log entry ``i`` of ``history`` at step ``first_step + i`` unless that step is already
        in the run; returns how many steps were back-filled."""
        n = 0
        for i, metrics in enumerate(history):
            step = first_step + i
            if step not in self.logged_steps and (step > self.skip_through_step or step not in self.late_steps_logged):
                self.log_metrics(metrics, step)  # at or below skip_through_step: its late figures only
                n += int(step in self.logged_steps)
        self.flush()
        return n

    def close(self, timeout_s: float | None = None) -> None:
        """Drain the queue (bounded wait) and stop the shipper; raise :class:`TrackingUnavailable`
        when the server is still unreachable."""
        drained = self.flush(timeout_s)
        with self._cond:
            self._stop = True
            left = len(self._pending)
            self._cond.notify_all()
        self._thread.join(timeout=15)  # at most one client call in flight (short client timeouts)
        if not drained:
            raise TrackingUnavailable(
                f"the MLflow tracking server has been unreachable since {_clock(self.down_since)} ({self.last_error}); "
                f"{left} metric values of run {self.run_id} were not shipped. Training itself finished: its metrics are "
                f"safe in {self.kept_in or 'the run folder'} and in the checkpoint. Re-run the same command once the "
                f"server is back: the run resumes at its last step and back-fills the missing metrics into MLflow."
            )

    # --- the shipper thread ---

    def _ship_forever(self) -> None:
        backoff = 1.0
        while True:
            with self._cond:
                while not self._due():
                    if self._stop:
                        return
                    wait = None if not self._pending else max(0.0, self.flush_every_s - (time.monotonic() - self._last_ship))
                    self._cond.wait(wait)
                if self._stop and not self._flush_wanted and self.down_since is not None:
                    return  # closing during an outage: close() reports what is left
                batch, tags = self._pending[:MAX_METRICS_PER_BATCH], dict(self._tags)
            if self._send(batch, tags):
                backoff = 1.0
                continue
            with self._cond:  # woken early by flush / close, so the end-of-task drain retries promptly
                self._cond.wait(backoff)
            backoff = min(self.retry_max_s, backoff * 2)

    def _due(self) -> bool:
        if not self._pending and not self._tags:
            return False
        return (self._flush_wanted or self._stop or bool(self._tags) or len(self._pending) >= self.max_buffer
                or time.monotonic() - self._last_ship >= self.flush_every_s)

    def _send(self, batch: list, tags: dict[str, str]) -> bool:
        from mlflow.entities import RunTag

        t0 = time.perf_counter()
        try:
            self.client.log_batch(self.run_id, metrics=batch, tags=[RunTag(k, v) for k, v in tags.items()])
        except Exception as e:  # noqa: BLE001 - any failure: keep the batch, training goes on
            self.seconds += time.perf_counter() - t0
            self.last_error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            if self.down_since is None:
                self.down_since = time.time()
                self._warn(
                    f"MLflow tracking server unreachable since {_clock(self.down_since)} ({self.last_error}); training "
                    f"continues, metrics are kept in {self.kept_in or 'memory'} and will be shipped when it returns"
                )
            return False
        self.seconds += time.perf_counter() - t0
        with self._cond:
            del self._pending[: len(batch)]  # only this thread removes from the head
            for k in tags:
                if self._tags.get(k) == tags[k]:
                    del self._tags[k]
            self.n_calls += 1
            self._last_ship = time.monotonic()
            if self.down_since is not None:  # back: record the outage with the next batch
                lasted = time.time() - self.down_since
                self.outage_s += lasted
                self.outages += 1
                self.down_since = None
                self._tags.update({"a3po.tracking_outage_s": f"{self.outage_s:.1f}", "a3po.tracking_outages": str(self.outages)})
                self._warn(f"MLflow tracking server reachable again after {lasted:.0f} s; shipping the {len(self._pending)} buffered metric values")
            self._cond.notify_all()
        return True


def _clock(t: float | None) -> str:
    return "?" if t is None else dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


# The metrics the training loop may log after the step they belong to (rl.eval_mode: background; a resumed
# run evaluating its checkpoint's pending version): a retried task's logger lets them through at an old step.
LATE_PREFIX = "eval/"


def metric_steps(client, run_id: str, key: str) -> frozenset[int]:
    """The steps at which run ``run_id`` holds metric ``key``."""
    return frozenset(m.step for m in client.get_metric_history(run_id, key))


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
    output dir (its folder lock free or held by this process) are marked KILLED first (they
    can never finish); a live flow's are never touched."""
    client = client_for(tracking_uri)
    exp_id = ensure_experiment(client, experiment, tracking_uri)
    out = str(Path(output_dir).resolve())
    ids = prefect_ids()
    kill_stale_runs(client, exp_id, {"a3po.output_dir": out, "a3po.role": "parent"}, "a3po.output_dir", note=ids.get("prefect.flow_run_id", "rerun"))
    own = {"a3po.output_dir": out, "a3po.role": "parent", "a3po.host": socket.gethostname()}
    run_id = create_run(client, exp_id, run_name, {**tags, **ids, **own}, params)
    return TrackingRef(tracking_uri, exp_id, run_id)


@task(cache_policy=NO_CACHE)
def close_parent_run(ref: TrackingRef, status: str = "FINISHED", tags: dict[str, str] | None = None) -> None:
    client = client_for(ref.tracking_uri)
    for k, v in (tags or {}).items():
        client.set_tag(ref.parent_run_id, k, str(v))
    client.set_terminated(ref.parent_run_id, status=status)


def close_parent_run_quietly(ref: TrackingRef, status: str = "FAILED", timeout_s: int = 5) -> None:
    """Close the parent run on the way out of a failed or stopped flow: one try, each MLflow call
    bounded by ``timeout_s`` and no retries (a store that is down would otherwise hold a SIGTERMed
    flow for minutes), never raising over the flow's own error. A run left RUNNING is marked
    KILLED by the next run of the same output dir."""
    try:
        with short_client_retries(max_retries=0, timeout_s=timeout_s):
            client_for(ref.tracking_uri).set_terminated(ref.parent_run_id, status=status)
    except Exception as e:  # noqa: BLE001 - the flow's error is the one to report
        run_logger().warning(f"could not mark MLflow run {ref.parent_run_id} {status} ({type(e).__name__}); "
                             "the next run of this output dir marks it KILLED")


DIGEST_CHARS = 36  # MLflow's dataset digest column holds 36 characters: the sha256's first 36 hex digits


def file_dataset(path: str | Path, name: str, context: str) -> DatasetInput:
    """A data file as an MLflow dataset input: ``name``, its source path, its content digest (the
    file's sha256, as the project's caches key it) and its row count (non-empty lines; a JSON file
    counts as one), used in ``context`` (``training``, ``evaluation``)."""
    with open(path, "rb") as f:
        rows = sum(1 for line in f if line.strip())
    dataset = Dataset(name=name, digest=sha256_file(path)[:DIGEST_CHARS], source_type="local",
                      source=json.dumps({"uri": str(Path(path).resolve())}), profile=json.dumps({"num_rows": rows}))
    return DatasetInput(dataset, [InputTag(MLFLOW_DATASET_CONTEXT, context)])


def log_dataset_inputs(client, run_id: str, inputs: list[DatasetInput]) -> None:
    """Record ``inputs`` on the run; a store that refuses them costs a warning naming them, never the run."""
    if not inputs:
        return
    try:
        client.log_inputs(run_id, datasets=inputs)
    except Exception as e:  # noqa: BLE001 - an old server or a store without datasets: the run goes on
        run_logger().warning(f"MLflow run {run_id}: the dataset inputs ({', '.join(i.dataset.name for i in inputs)}) "
                             f"were not recorded: {type(e).__name__}: {e}")


@task(cache_policy=NO_CACHE)
def log_evaluation(ref: TrackingRef, run_id: str, evaluation: dict[str, Any]) -> None:
    """Evaluation metrics (``eval/final/...``) on the variant's child run, the weights' dtype they
    were decoded from as the ``eval.dtype`` tag, the benchmark files as dataset inputs
    (:func:`file_dataset`); skipped benchmarks become ``eval.skipped.<name>`` tags carrying the reason."""
    client = client_for(ref.tracking_uri)
    log_metrics_now(client, run_id, evaluation["metrics"], step=evaluation.get("step", 0))
    files = evaluation.get("benchmark_files") or {}
    log_dataset_inputs(client, run_id, [file_dataset(path, f"{bench}:{Path(path).name}", "evaluation")
                                        for bench, path in sorted(files.items()) if Path(path).is_file()])
    if evaluation.get("dtype"):
        client.set_tag(run_id, "eval.dtype", evaluation["dtype"])
    for name, reason in evaluation.get("skipped", {}).items():
        client.set_tag(run_id, f"eval.skipped.{name}", reason[:5000])
    if evaluation.get("results_path") and Path(evaluation["results_path"]).exists():
        client.log_artifact(run_id, evaluation["results_path"], artifact_path="eval")


@task(cache_policy=NO_CACHE)
def log_to_parent(ref: TrackingRef, metrics: dict[str, float], artifacts: list[str], tags: dict[str, str] | None = None,
                  artifact_path: str | None = None) -> None:
    """Summary metrics, tags and artifact files on the parent run."""
    client = client_for(ref.tracking_uri)
    if metrics:
        log_metrics_now(client, ref.parent_run_id, metrics)
    for k, v in (tags or {}).items():
        client.set_tag(ref.parent_run_id, k, str(v))
    for path in artifacts:
        client.log_artifact(ref.parent_run_id, path, artifact_path=artifact_path)
