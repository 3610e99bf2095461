"""Prefect tasks over the a3po library, the MLflow side of tracking, and the pipeline's rules.

The tasks (``@task``) are typed wrappers over library calls; what crosses a task boundary is a
path, an id, a hash or a small record, never a model or a tensor, so Prefect's cache keys and
persisted results stay small and meaningful. Some do more than one thing where a retry must
see them together (``train_arm`` trains, and logs to its MLflow child run as it goes). The
other modules are plain code the flows and tasks share: the arms, the MLflow child run, the
comparison's summary, the parity and claims rules.

- ``tasks.runtime``    offline defaults (telemetry off, project-local Prefect home), the
                       temporary Prefect server, the default MLflow store
- ``tasks.tracking``   the MLflow :class:`~a3po.training.metrics.MetricLogger` (batched ``log_batch``),
                       parent / child runs by explicit id, params, artifacts
- ``tasks.data``       ``prepare_dataset``: validated train / held-out JSONL, cached by content
- ``tasks.arms``       an arm of a comparison (:class:`~tasks.arms.Arm`: variant, OPPO mode, placement)
- ``tasks.training``   ``warm_start`` (cached) and ``train_arm`` (resumes; safe to retry), in the flow's process
- ``tasks.launched``   the same arm trained by launched ranks (``python -m a3po.training.command`` under torchrun / DeepSpeed)
- ``tasks.child_run``  the MLflow child run of one arm x seed: opened (or reused on retry), finished, failed
- ``tasks.completions`` the run folder's completion tables as MLflow tables (``log_table``)
- ``tasks.evaluation`` ``evaluate_checkpoint``: in-domain held-out + GSM8K / MATH500 / AIME24
- ``tasks.summary``    the comparison table, speedups, plots
- ``tasks.parity``     the paired-bootstrap convergence-parity rule of the nightly run
- ``tasks.claims``     the A-3PO paper's claims judged on a comparison's rows
- ``tasks.verdicts``   the rule every verdict follows: nothing to judge is not a pass
- ``tasks.launch``     ``launch_ranks``: torchrun / DeepSpeed ranks from a flow (over ``infra.launch``)
- ``tasks.links``      direct links into the MLflow UI (a parent run, its children compared)
- ``tasks.reward_model`` ``train_reward_model``: the embedded default's reward model, trained once

Importing this package does not import Prefect (``tasks.runtime`` must run before it does).
"""
