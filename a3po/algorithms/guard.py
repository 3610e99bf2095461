"""The guard on an approximate proximal anchor (loglinear): a periodic exact check, and what the run
does when the approximation strays.

Every ``rl.guard_every`` steps the trainer recomputes the exact proximal log-probs (the weights before
the step's update) of one minibatch's rows, and compares them with the anchor the run's method builds
from the same rows (:func:`approximation_stats`). When a statistic crosses its bound
(:class:`GuardBounds`, :func:`breaches`) the run acts by the policy ``rl.guard_policy`` names
(:data:`GUARD_POLICIES`): warn, tighten the staleness bound, or train that step on the recomputed anchor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from a3po.algorithms.checks import require_same_shape
from a3po.algorithms.stability import quantile
from a3po.registry import Registry


def approximation_stats(approx: torch.Tensor, exact: torch.Tensor, behav: torch.Tensor,
                        mask: torch.Tensor) -> dict[str, float]:
    """The approximate anchor against the exact one over the generated tokens ``mask``:

    * ``guard/abs_err_mean|p99|max``: ``|log pi_prox~ - log pi_prox|``, nats;
    * ``guard/iw_err_p99``: ``|exp(log pi_prox~ - log pi_prox) - 1|``, the relative error the
      approximation puts into the behaviour weight ``w = pi_prox / pi_behav`` (and into ``r``);
    * ``guard/behav_iw_p99|max``: the exact behaviour weight ``pi_prox / pi_behav``, how far the
      samples are off-policy for the weights being trained;
    * ``guard/tokens``: how many tokens were compared;
    * ``guard/nonfinite_tokens``: how many of them hold NaN or inf in ``approx``, ``exact`` or
      ``behav`` (a quantile can pass over a few: sorted last, they may sit above the p99).

    Shapes: all ``(B, T)``; ``mask`` bool. Nothing outside ``mask`` is read."""
    require_same_shape(approx=approx, exact=exact, behav=behav, mask=mask)
    m = mask.bool()
    err = (approx - exact)[m].float()
    iw = (exact - behav)[m].float().exp()
    finite = torch.isfinite(approx[m]) & torch.isfinite(exact[m]) & torch.isfinite(behav[m])
    return {
        "guard/abs_err_mean": err.abs().mean().item() if err.numel() else 0.0,
        "guard/abs_err_p99": quantile(err.abs(), 0.99),
        "guard/abs_err_max": err.abs().max().item() if err.numel() else 0.0,
        "guard/iw_err_p99": quantile((err.exp() - 1.0).abs(), 0.99),
        "guard/behav_iw_p99": quantile(iw, 0.99),
        "guard/behav_iw_max": iw.max().item() if iw.numel() else 0.0,
        "guard/tokens": float(err.numel()),
        "guard/nonfinite_tokens": float((~finite).sum()),
    }


@dataclass(frozen=True)
class GuardBounds:
    """Where the approximation is no longer trusted: the p99 of its log-prob error (nats) and the
    p99 of the exact behaviour weight (the samples too far off-policy for the anchor to matter little)."""

    max_err: float
    max_iw: float


def over(value: float, bound: float) -> bool:
    """Whether a checked figure crosses its bound: above it, or not a number at all (NaN; ``NaN >
    bound`` is false). A check that could not compute its figure fires, never passes."""
    return not value <= bound


def breaches(stats: dict[str, float], bounds: GuardBounds) -> list[str]:
    """The reasons ``stats`` (of :func:`approximation_stats`) cross ``bounds``, one line each; none:
    quiet. A NaN figure crosses its bound (:func:`over`), and so does any non-finite token checked."""
    out = []
    if stats.get("guard/nonfinite_tokens", 0.0) > 0:
        out.append(f"guard/nonfinite_tokens {stats['guard/nonfinite_tokens']:.0f} of {stats['guard/tokens']:.0f} "
                   "checked: the anchor or behaviour log-probs hold NaN or inf")
    for key, field, bound in (("guard/abs_err_p99", "rl.guard_max_err", bounds.max_err),
                              ("guard/behav_iw_p99", "rl.guard_max_iw", bounds.max_iw)):
        value = stats[key]
        if math.isnan(value):
            out.append(f"{key} is NaN (the anchors compared hold NaN or inf): counted as over {field} {bound:g}")
        elif over(value, bound):
            out.append(f"{key} {value:.4g} > {field} {bound:g}")
    return out


@dataclass(frozen=True)
class GuardPolicy:
    """What a run does when the guard fires (besides logging it, which every policy does)."""

    anchor: str | None
    """A proximal method (:data:`a3po.algorithms.proximal.PROXIMAL_METHODS`) the step then trains
    with instead of the run's (its forward paid on that step alone); None: the run's own."""
    tightens: bool
    """Whether the staleness bound in force drops by one (never below 1) for the batches not yet admitted."""


GUARD_POLICIES: Registry[GuardPolicy] = Registry("guard policy")
GUARD_POLICIES.register("warn")(GuardPolicy(anchor=None, tightens=False))
GUARD_POLICIES.register("tighten")(GuardPolicy(anchor=None, tightens=True))
GUARD_POLICIES.register("recompute")(GuardPolicy(anchor="recompute", tightens=False))
