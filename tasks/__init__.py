"""Prefect tasks over the a3po library, plus the MLflow side of tracking.

Each task is a thin, typed wrapper over one library call with one side effect; what crosses
a task boundary is a path, an id, a hash or a small record, never a model or a tensor, so
Prefect's cache keys and persisted results stay small and meaningful.

- ``tasks.runtime``    offline defaults (telemetry off, project-local Prefect home), the
                       temporary Prefect server, the default MLflow store
- ``tasks.tracking``   the MLflow :class:`~a3po.training.metrics.MetricLogger` (batched ``log_batch``),
                       parent / child runs by explicit id, params, artifacts
- ``tasks.data``       ``prepare_dataset``: validated train / held-out JSONL, cached by content
- ``tasks.training``   ``warm_start`` (cached) and ``train_variant`` (resumes; safe to retry)
- ``tasks.completions`` the run folder's completion tables as MLflow tables (``log_table``)
- ``tasks.evaluation`` ``evaluate_checkpoint``: in-domain held-out + GSM8K / MATH500 / AIME24
- ``tasks.summary``    the comparison table, speedups, plots
- ``tasks.parity``     the paired-bootstrap convergence-parity rule of the nightly run

Importing this package does not import Prefect (``tasks.runtime`` must run before it does).
"""
