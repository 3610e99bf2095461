"""Grading: one verifiable reward for RL and one scorer for the benchmarks.

The grader (``score``, ``grade``, its bounds and counters, the ``TASKS`` registry) lives in
``a3po.grading.grader`` and is re-exported here, so callers write ``from a3po import grading``;
answer extraction is ``answers``, RL rewards over a batch ``rewards``, the killable math-verify
worker and its caller ``verify_worker`` and ``verifier``.
"""

from a3po.grading.grader import (
    TASKS,
    GradePath,
    GradeResult,
    GraderUnavailable,
    GradingConfig,
    Method,
    TaskSpec,
    counting,
    evaluator_works,
    grade,
    needs_worker,
    reset_stats,
    score,
    set_config,
    shutdown,
    stats,
    warmup,
    worker_pid,
)

__all__ = [
    "TASKS",
    "GradePath",
    "GraderUnavailable",
    "GradeResult",
    "GradingConfig",
    "Method",
    "TaskSpec",
    "counting",
    "evaluator_works",
    "grade",
    "needs_worker",
    "reset_stats",
    "score",
    "set_config",
    "shutdown",
    "stats",
    "warmup",
    "worker_pid",
]
