"""Rewards are the benchmark grader itself (``eval.grading.score``), so a grading error can
never make training and evaluation disagree. Non-finite rewards raise naming the row."""

from __future__ import annotations

import math


class RewardError(ValueError):
    pass


def score_completions(task: str, completions: list[str], golds: list[str], ids: list[str] | None = None) -> list[float]:
    from eval.grading import score  # the grader lives in eval/; imported lazily (eval imports a3po)

    out = []
    for i, (c, g) in enumerate(zip(completions, golds)):
        r = float(score(task, c, g))
        if not math.isfinite(r):
            row = ids[i] if ids else i
            raise RewardError(f"reward for row {row!r} is not finite ({r}); refusing to train on it")
        out.append(r)
    return out
