"""Step-size rules, registered by name in :data:`STEP_SIZE_RULES` (``rl.step_size``): a multiplier
of the learning rate for one optimizer step, from the minibatch it trains on.

* ``fixed``: 1 (the learning-rate schedule alone).
* ``ess_sqrt``: VCPO's ESS-guided step scaling (Huang, Zhang, Hu, Yang and Han, 2026, "Stable
  Asynchrony: Variance-Controlled Off-Policy RL for LLMs", arXiv:2602.17616). Stale rollouts give
  heavy-tailed importance weights: a few sequences dominate the update and the gradient estimate
  carries the information of fewer samples than the batch holds. The paper finds the collapse of
  asynchronous runs predicted by the effective sample size of those weights and scales the step by
  it, following the square-root rule of Adam-style optimizers (a batch of ``n`` samples supports a
  rate ``~ sqrt(n)``): with the minibatch's ``N`` sequences and their Kish effective sample size
  ``ESS``, the rate is ``lr * sqrt(ESS / N)``.

The weights are the behaviour importance weights of the decoupled loss, per sequence: with
``w_t = pi_prox(y_t) / pi_behav(y_t)`` per generated token (``a3po.algorithms.stability``: the
off-policy correction, not the trust ratio ``pi_theta / pi_prox``), a sequence's weight is
``W_i = prod_t w_t``, so ``log W_i = sum_t (log pi_prox - log pi_behav)``. On-policy every
``W_i = 1``: ``ESS = N`` and the rate is the schedule's. This project's reading of the paper's rule
is what is here (the paper's code applies it in its own trainer); the equations are each function's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from a3po.algorithms.checks import require_same_shape
from a3po.registry import Registry


def sequence_log_weights(prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log W_i = sum_t mask_it (log pi_prox(y_it) - log pi_behav(y_it))``, ``(N,)`` from ``(N, L)``."""
    require_same_shape(prox_logp=prox_logp, behav_logp=behav_logp, mask=mask)
    diff = prox_logp.detach().double() - behav_logp.detach().double()
    return torch.where(mask.bool(), diff, torch.zeros_like(diff)).sum(-1)


def ess_parts(log_w: torch.Tensor) -> torch.Tensor:
    """The sums the ESS needs, shifted by the largest log-weight so nothing overflows:
    ``[M, sum_i exp(s_i - M), sum_i exp(2 (s_i - M)), n]`` with ``M = max_i s_i`` (float64; ``M`` is
    ``-inf`` and the sums 0 for no sequence). Parts of several ranks combine with :func:`ess_of_parts`."""
    log_w = log_w.detach().double().reshape(-1)
    if not log_w.numel():
        return torch.tensor([-math.inf, 0.0, 0.0, 0.0], dtype=torch.float64, device=log_w.device)
    if not bool(torch.isfinite(log_w).all()):
        raise ValueError("a sequence's log importance weight is not finite: the effective sample size is unknown")
    top = log_w.max()
    e = torch.exp(log_w - top)
    return torch.stack([top, e.sum(), (e * e).sum(), torch.tensor(float(log_w.numel()), dtype=torch.float64,
                                                                  device=log_w.device)])


def ess_of_parts(parts: torch.Tensor) -> tuple[float, float]:
    """Kish's effective sample size ``ESS = (sum_i W_i)^2 / sum_i W_i^2`` and its ratio ``ESS / N``
    from :func:`ess_parts` rows ``(K, 4)`` (one per rank): each row's sums are rescaled to the largest
    ``M`` (``exp(M_k - M)`` and its square). ``ESS`` lies in ``[1, N]``: ``N`` when every weight is
    equal, 1 when one sequence carries all of it."""
    parts = parts.double().reshape(-1, 4)
    n = float(parts[:, 3].sum())
    if n == 0:
        raise ValueError("the effective sample size of no sequence")
    kept = parts[parts[:, 3] > 0]
    top = kept[:, 0].max()
    scale = torch.exp(kept[:, 0] - top)
    s1, s2 = float((kept[:, 1] * scale).sum()), float((kept[:, 2] * scale * scale).sum())
    ess = s1 * s1 / s2
    return ess, ess / n


@dataclass(frozen=True)
class StepSizeRule:
    needs_weights: bool
    """Whether the rule reads the behaviour importance weights (a variant without them is refused)."""
    scale: Callable[[float], float]
    """``ESS / N -> `` the multiplier of the learning rate."""


STEP_SIZE_RULES: Registry[StepSizeRule] = Registry("step-size rule")
STEP_SIZE_RULES.register("fixed")(StepSizeRule(False, lambda ratio: 1.0))
STEP_SIZE_RULES.register("ess_sqrt")(StepSizeRule(True, math.sqrt))
