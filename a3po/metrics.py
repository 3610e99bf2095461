"""Metric reporting without a tracking dependency: the library calls a :class:`MetricLogger`;
MLflow is one implementation (in ``tasks/``), a JSONL file another.

Metric names are namespaced and valid MLflow keys (letters, digits, ``_ - . /``):

==========================  ===============================================================
``reward/mean``, ``/std``   reward of the training batch (grader score, 0..1)
``policy/iw_mean|max|p99``  importance weight pi_theta / pi_prox over generated tokens
``policy/behav_w_*``        behaviour weight pi_prox / pi_behav
``policy/clip_frac``        fraction of tokens where the clipped term is active
``policy/behav_cap_frac``   fraction of tokens dropped by the behaviour-weight cap
``policy/approx_kl``        k3 estimate of KL(prox || theta), nats per token
``policy/entropy``          mean next-token entropy on generated tokens, nats
``staleness/mean|max``      trainer version minus token version, over generated tokens
``prox/time_s``             wall time to obtain proximal log-probs this step
``prox/approx_abs_err``     (``metrics`` method) mean |loglinear - recomputed| log-prob
``perf/step_time_s``        wall time of the training step (rollout wait excluded)
``perf/wait_time_s``        time the trainer waited for rollouts
``perf/tokens_per_s``       generated tokens trained per second of step wall time
``response/length_mean``    generated tokens per sample
``eval/heldout_acc``        greedy accuracy on the held-out split
``grader/calls``            completions graded for this step's batch (counts, per batch)
``grader/fast``             ... decided by the exact plain-number compare
``grader/math_verify``      ... sent to the math-verify worker
``grader/timeouts``         ... whose math-verify comparison hit the timeout (scored 0)
``grader/worker_errors``    ... math-verify could not decide (evaluator error; scored 0)
``grader/no_answer``        ... with no final answer found (scored 0)
``grader/too_long``         ... whose answer exceeded the grader's length bound (scored 0)
==========================  ===============================================================
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Protocol

_VALID_KEY = re.compile(r"^[A-Za-z0-9_\-./ ]+$")


def valid_metric_key(name: str) -> bool:
    return bool(_VALID_KEY.match(name)) and ".." not in name and not name.startswith("/")


class MetricLogger(Protocol):
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...


class NullLogger:
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass


class JsonlLogger:
    """Appends ``{"step": s, **metrics}`` per call; survives crashes line by line."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")


class FanoutLogger:
    def __init__(self, *loggers: MetricLogger) -> None:
        self.loggers = loggers

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for lg in self.loggers:
            lg.log_metrics(metrics, step)
