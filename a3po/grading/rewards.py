"""Rewards are the benchmark grader itself (``a3po.grading.score``; ``eval`` scores benchmarks
with the same module), so a grading error can never make training and evaluation disagree.
Non-finite rewards raise naming the row. No completion or gold text can raise: the grader
scores it, or scores it 0 and counts why (``grader/too_long``, ``grader/worker_errors``).

A grader that cannot work fails the run instead of training on zeros: when the math-verify
worker cannot start, or fails every symbolic comparison of a batch, scoring raises
``a3po.grading.GraderUnavailable`` with the reason. Not when every failure is a gold that
math-verify cannot read and the evaluator still passes its self-check: those are bad rows
(scored 0 and counted), not a broken grader. ``grader_counts()`` collects the grader's
counters of one batch (logged per step as ``grader/*``)."""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator

from a3po import grading
from a3po.grading.verify_worker import GOLD_NOT_PARSED


class RewardError(ValueError):
    pass


# a3po.grading's counter -> metric name under grader/ (see the glossary in a3po.training.metrics).
GRADER_METRICS = {
    "calls": "calls", "fast": "fast", "math_verify": "math_verify", "timeouts": "timeouts",
    "errors": "worker_errors", "no_answer": "no_answer", "too_long": "too_long",
}


@contextmanager
def grader_counts() -> Iterator[dict[str, int]]:
    """The grader's counters for the scoring this thread does inside the block, named as the
    ``grader/*`` metrics (without the prefix); filled when the block exits."""
    out: dict[str, int] = {}
    with grading.counting() as counts:
        yield out
    out.update({GRADER_METRICS[k]: v for k, v in counts.items()})


def check_grader(task: str) -> None:
    """Start the math-verify worker now when ``task`` can need it, so a broken grader stops a
    run before its first step (``GraderUnavailable``), not after hours of zero rewards."""
    if grading.needs_worker(task):
        grading.warmup()


def score_completions(task: str, completions: list[str], golds: list[str], ids: list[str] | None = None) -> list[float]:
    if len(completions) != len(golds):
        raise ValueError(f"{len(completions)} completions for {len(golds)} golds")
    out, errors = [], []
    with grading.counting() as counts:  # through the module: tests may replace grading.grade
        for i, (c, g) in enumerate(zip(completions, golds, strict=True)):
            result = grading.grade(task, c, g, strict=True)
            r = float(result.score)
            if not math.isfinite(r):
                row = ids[i] if ids else i
                raise RewardError(f"reward for row {row!r} is not finite ({r}); refusing to train on it")
            if result.worker_error:
                errors.append(result.error)
            out.append(r)
    # One pathological answer may crash the evaluator; all of them failing means the grader is
    # broken, unless they all failed on golds it cannot read while it still reads 1/2 = 0.5.
    if counts["math_verify"] >= 2 and len(errors) == counts["math_verify"] and not (
        all(str(e).startswith(GOLD_NOT_PARSED) for e in errors) and grading.evaluator_works()
    ):
        raise grading.GraderUnavailable(
            f"every math-verify comparison of the batch failed ({len(errors)} of {len(out)} answers; "
            f"first error: {errors[0]}); refusing to train on zero rewards"
        )
    return out
