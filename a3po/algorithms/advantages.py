"""Advantage estimators, registered by name in :data:`ADVANTAGE_ESTIMATORS`.

Every estimator maps one :class:`AdvantageInputs` to per-token :class:`Advantages` ``(N, L)``
(zero outside the response mask), so the loss never asks which one ran:

* sequence-level estimators (``grpo``, ``dr_grpo``) score each sequence by the sum of its
  token rewards, compare it with its group (samples of the same prompt share a group id) and
  broadcast the advantage over the sequence's response tokens;
* ``gae`` (PPO) discounts per-token rewards against a critic's values.

An estimator declares what it needs (``needs_values``: the trainer runs the critic only for
those), as proximal methods declare ``needs_forward``. :class:`SequenceLevel` lifts a
``(rewards (N,), group_ids (N,)) -> (N,)`` function into an estimator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from a3po.algorithms.checks import require_finite, require_same_shape
from a3po.registry import Registry


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may use. All per-token tensors are ``(N, L)``, aligned to ``input_ids``."""

    # (N, L) float32: the sequence's score at its last response token, minus the KL penalty per token; 0 outside mask
    token_rewards: torch.Tensor
    mask: torch.Tensor  # (N, L) bool, generated tokens (contiguous in each row)
    group_ids: torch.Tensor  # (N,) samples of the same prompt share an id
    # (N, L) critic values V(s_t) of the state before token t (estimators with needs_values)
    values: torch.Tensor | None = None
    gamma: float = 1.0  # discount per token (gae)
    lam: float = 0.95  # GAE lambda (gae)


@dataclass(frozen=True)
class Advantages:
    advantages: torch.Tensor  # (N, L), 0 outside mask
    returns: torch.Tensor | None = None  # (N, L) value-loss targets (estimators with needs_values)


class AdvantageEstimator(Protocol):
    needs_values: bool
    group_relative: bool
    """Whether a sample's advantage is its reward against its group's others (a group of one: 0)."""

    def __call__(self, inp: AdvantageInputs) -> Advantages: ...


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


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


def mean_centered_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Group-mean baseline without std scaling (Dr. GRPO; Liu et al., 2025): ``A_i = r_i - mean_g(r)``."""
    require_finite("rewards", rewards)
    rewards = rewards.to(torch.float32)
    adv = torch.zeros_like(rewards)
    for g in torch.unique(group_ids):
        idx = group_ids == g
        adv[idx] = rewards[idx] - rewards[idx].mean()
    return adv


def groups_with_signal(rewards: torch.Tensor, group_ids: torch.Tensor) -> dict[int, bool]:
    """Per group id, whether its rewards differ: ``max_g(r) > min_g(r)``. A group whose rewards are
    all equal has ``A_i = 0`` for every sample under a group-relative estimator (``r_i - mean_g(r) = 0``),
    so its update is zero for the cost of a full one (DAPO's dynamic sampling filters it: Yu et al.,
    2025, "DAPO", sec. 3.2). Exact equality: rewards are graded scores, not noisy floats."""
    require_finite("rewards", rewards)
    out: dict[int, bool] = {}
    for g in torch.unique(group_ids).tolist():
        r = rewards[group_ids == g]
        out[int(g)] = bool(r.max() > r.min())
    return out


class SequenceLevel:
    """A per-sequence estimator ``f(rewards (N,), group_ids (N,)) -> (N,)`` as a registered
    estimator: the sequence reward is the sum of its token rewards, the advantage is broadcast
    over its response tokens."""

    needs_values = False

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], group_relative: bool = True) -> None:
        self.fn, self.group_relative = fn, group_relative
        self.__doc__ = fn.__doc__

    def __call__(self, inp: AdvantageInputs) -> Advantages:
        mask = inp.mask.bool()
        # Adding the zeros outside the mask is exact: without a KL penalty r_i is the score itself.
        rewards = torch.where(mask, inp.token_rewards, torch.zeros_like(inp.token_rewards)).sum(-1)
        adv = self.fn(rewards, inp.group_ids)  # (N,)
        return Advantages(torch.where(mask, adv[:, None].to(torch.float32), torch.zeros_like(inp.token_rewards)))


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al., 2016, "High-dimensional continuous
    control using GAE", eq. 16) over each row's response tokens; returns ``(advantages, returns)``.

    Per response token ``t`` (action: emit token t; state: the prefix before it)::

        delta_t = r_t + gamma * V_{t+1} - V_t          (V_{t+1} = 0 after the last token: terminal)
        A_t     = delta_t + gamma * lam * A_{t+1}      (A = 0 after the last token)
        R_t     = A_t + V_t                            (the value-loss target, TD(lambda) return)

    Shapes ``(N, L)``; ``mask`` bool and contiguous per row; outputs are 0 outside it.
    """
    require_same_shape(token_rewards=token_rewards, values=values, mask=mask)
    mask = mask.bool()
    require_finite("token_rewards", token_rewards, mask)
    require_finite("values", values.detach(), mask)
    r = torch.where(mask, token_rewards.float(), torch.zeros_like(token_rewards, dtype=torch.float32))
    v = torch.where(mask, values.detach().float(), torch.zeros_like(r))
    adv = torch.zeros_like(r)
    next_v = torch.zeros_like(r[:, 0])
    next_a = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):  # L is tens of tokens: a loop over columns is cheap
        delta = r[:, t] + gamma * next_v - v[:, t]
        a_t = torch.where(mask[:, t], delta + gamma * lam * next_a, torch.zeros_like(delta))
        adv[:, t] = a_t
        next_v = torch.where(mask[:, t], v[:, t], torch.zeros_like(delta))  # pad after the response: terminal
        next_a = a_t
    return adv, torch.where(mask, adv + v, torch.zeros_like(r))


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` over the tokens in ``mask`` (0 outside), as PPO
    implementations normalise advantages per batch (CleanRL ``norm_adv``, verl, TRL)."""
    m = mask.bool()
    vals = x[m]
    if vals.numel() < 2:
        return torch.where(m, x - vals.mean() if vals.numel() else x, torch.zeros_like(x))
    return torch.where(m, (x - vals.mean()) / (vals.std(unbiased=False) + eps), torch.zeros_like(x))


class GAE:
    """PPO's estimator: :func:`gae` against the critic's values, advantages whitened over the
    batch's response tokens, returns left raw (they are the critic's targets)."""

    needs_values = True
    group_relative = False

    def __call__(self, inp: AdvantageInputs) -> Advantages:
        if inp.values is None:
            raise ValueError("the gae advantage estimator needs critic values (ppo.critic must not be 'none')")
        adv, returns = gae(inp.token_rewards, inp.values, inp.mask, inp.gamma, inp.lam)
        return Advantages(whiten(adv, inp.mask), returns)


ADVANTAGE_ESTIMATORS.register("grpo")(SequenceLevel(grpo_advantages))
ADVANTAGE_ESTIMATORS.register("dr_grpo")(SequenceLevel(mean_centered_advantages))
ADVANTAGE_ESTIMATORS.register("gae")(GAE())
