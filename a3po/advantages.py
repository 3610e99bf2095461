"""Advantage estimators, registered by name in :data:`ADVANTAGE_ESTIMATORS`.

Each takes per-sequence rewards ``(N,)`` and group ids ``(N,)`` (samples of the same prompt
share an id) and returns per-sequence advantages ``(N,)``.
"""

from __future__ import annotations

from typing import Callable

import torch

from a3po.checks import require_finite
from a3po.registry import Registry

AdvantageEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised advantages (GRPO; Shao et al., 2024, DeepSeekMath, sec. 4.1.2):
    ``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)`` over the samples ``g`` of the same prompt.
    A group whose rewards are all equal gets zero advantage (no signal, no noise)."""
    require_finite("rewards", rewards)
    rewards = rewards.to(torch.float32)
    adv = torch.zeros_like(rewards)
    for g in torch.unique(group_ids):
        idx = group_ids == g
        r = rewards[idx]
        std = r.std(unbiased=False) if r.numel() > 1 else r.new_zeros(())
        adv[idx] = (r - r.mean()) / (std + eps)
    return adv


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def mean_centered_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Group-mean baseline without std scaling (Dr. GRPO; Liu et al., 2025): ``A_i = r_i - mean_g(r)``."""
    require_finite("rewards", rewards)
    rewards = rewards.to(torch.float32)
    adv = torch.zeros_like(rewards)
    for g in torch.unique(group_ids):
        idx = group_ids == g
        adv[idx] = rewards[idx] - rewards[idx].mean()
    return adv
