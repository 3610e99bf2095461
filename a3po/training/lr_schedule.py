"""The policy's learning-rate schedule: a function of the step, so resume needs no state."""

from __future__ import annotations

import math

from a3po.config import RLConfig


def learning_rate(rl: RLConfig, step: int) -> float:
    """Linear warm-up over ``rl.lr_warmup_steps`` steps, then constant or cosine decay to
    ``rl.lr_min_ratio * rl.lr`` at ``rl.steps``::

        warm-up:  lr * min(1, (step + 1) / warmup)
        cosine:   lr * (r + (1 - r) * (1 + cos(pi * p)) / 2),   p = (step - warmup) / (steps - warmup) clipped to 1

    Adam's first updates are sign-like (unit size per parameter whatever the gradient's noise);
    ramping the rate keeps them from knocking a warm-started policy off what it has learned."""
    warm = min(1.0, (step + 1) / max(1, rl.lr_warmup_steps))
    if rl.lr_schedule == "constant" or step < rl.lr_warmup_steps:
        return rl.lr * warm
    progress = min(1.0, (step - rl.lr_warmup_steps) / max(1, rl.steps - rl.lr_warmup_steps))
    return rl.lr * (rl.lr_min_ratio + (1 - rl.lr_min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
