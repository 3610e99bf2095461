"""Stability statistics of the decoupled PPO loss, as the A-3PO paper means them.

The decoupled loss (``a3po.algorithms.losses``) has two ratios with two roles (Hilton et al. 2022; AReaL,
Fu et al. 2025; A-3PO, Li, Wu and Shen 2025, arXiv:2512.06547):

====================  =======================  ====================================================
name                  per generated token      role
====================  =======================  ====================================================
behaviour IW ``w``    pi_prox / pi_behav       off-policy correction (importance weight). A-3PO's
                                               stability claim ("more controlled importance
                                               weights") is about this one; tokens with
                                               ``w > rl.behav_weight_cap`` are dropped (capped)
trust ratio ``r``     pi_theta / pi_prox       trust region: what PPO's clip bounds to
                                               ``[1 - eps, 1 + eps_high]``
====================  =======================  ====================================================

A training step's statistics are over **all the step's generated tokens, every minibatch
together** (:meth:`TokenStats.cat`), not means of per-minibatch figures: the step's p99 is the
quantile of the step's tokens, which a mean of per-minibatch quantiles is not. ``r`` of a token
is taken at the forward of its minibatch (after the step's earlier minibatches' updates).

Metric names (valid MLflow keys; glossary in ``a3po.training.metrics``):

- ``stability/behav_iw_mean|p99|max``: mean, 99th percentile, maximum of ``w``;
- ``stability/behav_iw_capped_frac``: fraction of tokens with ``w`` above the cap (dropped);
- ``stability/trust_ratio_mean|p99|max``: the same of ``r``;
- ``stability/trust_ratio_clipped_frac``: fraction of tokens whose clipped term is the active
  branch of the max (``r`` outside the clip range on the side the advantage pushes it: no gradient);
- ``policy/approx_kl``: see :func:`stability_metrics`.

Quantiles interpolate linearly between order statistics (numpy's default ``linear``, Hyndman and
Fan type 7): ``p = q (n - 1)``, ``x_(floor p) + (p - floor p)(x_(floor p + 1) - x_(floor p))``
over the sorted values ``x_(0) <= ... <= x_(n-1)``. An empty step (no generated token) gives 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class TokenStats:
    """Per-token values of one loss call, 1-D over its generated tokens (``mask`` True), detached.

    ``kl_terms`` is ``w * ((r - 1) - log r)``, the importance-weighted k3 term of
    :func:`stability_metrics`' ``policy/approx_kl``."""

    behav_iw: torch.Tensor  # w = pi_prox / pi_behav
    trust_ratio: torch.Tensor  # r = pi_theta / pi_prox
    capped: torch.Tensor  # bool: w > cap, dropped from the loss
    clipped: torch.Tensor  # bool: the clipped branch of the max is active
    kl_terms: torch.Tensor

    @staticmethod
    def cat(parts: Sequence["TokenStats"]) -> "TokenStats":
        """The tokens of several loss calls (a step's minibatches) as one set."""
        if not parts:
            raise ValueError("no token statistics to concatenate")
        return TokenStats(*(torch.cat([getattr(p, f) for p in parts]) for f in TokenStats.__dataclass_fields__))


def quantile(x: torch.Tensor, q: float) -> float:
    """The ``q`` quantile of the values of ``x`` (linear interpolation, type 7); 0 when empty.
    By sorting, so no size limit (``torch.quantile`` refuses inputs over 2**24 elements)."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile level must be in [0, 1], got {q}")
    v = x.detach().reshape(-1).double().sort().values
    if v.numel() == 0:
        return 0.0
    p = q * (v.numel() - 1)
    lo = math.floor(p)
    hi = min(lo + 1, v.numel() - 1)
    return (v[lo] + (p - lo) * (v[hi] - v[lo])).item()


def _mean(x: torch.Tensor) -> float:
    return x.double().mean().item() if x.numel() else 0.0


def _max(x: torch.Tensor) -> float:
    return x.max().item() if x.numel() else 0.0


def stability_metrics(t: TokenStats) -> dict[str, float]:
    """The stability metrics of a set of tokens (one loss call, or a whole step via
    :meth:`TokenStats.cat`); definitions in the module docstring.

    ``policy/approx_kl`` estimates the mean over the tokens' contexts of
    ``KL(pi_prox(.|context) || pi_theta(.|context))`` in nats. The tokens were sampled from
    ``pi_behav``, not ``pi_prox``, so Schulman's k3 term ``(r - 1) - log r`` (unbiased for that KL
    on samples of ``pi_prox``) is importance-weighted by ``w``: ``E_behav[w ((r - 1) - log r)] =
    E_prox[(r - 1) - log r] = KL(prox || theta)`` per context. Uncapped ``w``: it is an estimate,
    not the loss. Each term is >= 0 (``x - 1 - log x >= 0``)."""
    return {
        "stability/behav_iw_mean": _mean(t.behav_iw),
        "stability/behav_iw_p99": quantile(t.behav_iw, 0.99),
        "stability/behav_iw_max": _max(t.behav_iw),
        "stability/behav_iw_capped_frac": _mean(t.capped.float()),
        "stability/trust_ratio_mean": _mean(t.trust_ratio),
        "stability/trust_ratio_p99": quantile(t.trust_ratio, 0.99),
        "stability/trust_ratio_max": _max(t.trust_ratio),
        "stability/trust_ratio_clipped_frac": _mean(t.clipped.float()),
        "policy/approx_kl": _mean(t.kl_terms),
    }
