"""Policy losses as pure tensor functions returning ``(loss, metrics)``.

Shapes: every per-token tensor is ``(B, T)``; ``mask`` is bool (True on generated tokens).
Normalisation: sums are divided by the number of tokens in ``mask`` (token-mean, as in
DAPO/AReaL), so the scale of the gradient does not depend on how many tokens a cap drops.
"""

from __future__ import annotations

import torch

from a3po.algorithms.checks import require_finite, require_same_shape
from a3po.algorithms.stability import TokenStats, stability_metrics


def decoupled_ppo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    behav_weight_cap: float | None = None,
    n_tokens: torch.Tensor | int | None = None,
    return_tokens: bool = False,
    correction: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]] | tuple[torch.Tensor, dict[str, float], TokenStats]:
    """Decoupled PPO clipped loss (Hilton et al., 2022, eq. 4; AReaL, Fu et al., 2025, eq. 5).

    Per token::

        r = pi_theta / pi_prox                       (grad flows through pi_theta only)
        w = stopgrad(pi_prox / pi_behav)             (behaviour importance weight)
        l = w * max(-A * r, -A * clip(r, 1 - eps, 1 + eps_high))

    Tokens with ``w > behav_weight_cap`` are dropped from the sum (their weight is unreliable);
    the sum is divided by ``mask.sum()`` including dropped tokens, so masking never inflates the
    gradient. ``eps_clip_high`` defaults to ``eps_clip`` (symmetric clip; DAPO's clip-higher
    sets it larger). With ``prox_logp == behav_logp`` this is standard PPO-clip.

    Rollout correction (``a3po.algorithms.rollout_correction``): ``correction`` ``(B, T)`` holds the
    weights ``c_t >= 0`` that replace the engine-vs-trainer mismatch ratio ``rho_t``, and the caller
    passes the *trainer's* log-probs of the behaviour versions as ``behav_logp``, so ``w`` is the
    staleness part alone and a token's term is ``c_t * w * max(...)``::

        pi_prox / pi_engine = (pi_prox / pi_trainer(v)) * rho_t   ->   w * c_t

    None (``rl.rollout_correction: none``): ``behav_logp`` is the engine's and ``w`` carries ``rho_t``
    uncorrected, the loss as it always was.

    Args are ``(B, T)`` tensors; ``advantages`` may also be ``(B,)`` (one per sequence).
    ``n_tokens`` replaces ``mask.sum()`` as the denominator of the loss (not of the metrics):
    a data-parallel rank passes the whole minibatch's token count, so the ranks' losses add up
    to the token mean of the minibatch.
    Metrics: ``loss/policy`` and the stability statistics of this call's tokens
    (``a3po.algorithms.stability``); ``return_tokens`` also returns the per-token values
    (:class:`~a3po.algorithms.stability.TokenStats`), from which a trainer computes a whole step's statistics.
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    require_same_shape(logp=logp, prox_logp=prox_logp, behav_logp=behav_logp, advantages=advantages, mask=mask)
    mask = mask.bool()
    for name, t in (("logp", logp), ("prox_logp", prox_logp), ("behav_logp", behav_logp), ("advantages", advantages)):
        require_finite(name, t.detach(), mask)
    if eps_clip <= 0:
        raise ValueError(f"eps_clip must be > 0, got {eps_clip}")
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    fmask = mask.to(logp.dtype)
    # Zero outside the mask first so padding can never produce inf * 0 = NaN.
    logp_m = torch.where(mask, logp, torch.zeros_like(logp))
    prox_m = torch.where(mask, prox_logp.detach(), torch.zeros_like(logp))
    behav_m = torch.where(mask, behav_logp.detach(), torch.zeros_like(logp))
    adv = torch.where(mask, advantages.detach(), torch.zeros_like(logp))

    ratio = torch.exp(logp_m - prox_m)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_clip, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)

    behav_w = torch.exp(prox_m - behav_m)
    keep = mask
    if behav_weight_cap is not None:
        keep = mask & (behav_w <= behav_weight_cap)
    per_token = per_token * behav_w * keep.to(logp.dtype)
    if correction is not None:
        require_same_shape(logp=logp, correction=correction)
        require_finite("correction", correction.detach(), mask)
        per_token = per_token * torch.where(mask, correction.detach().to(logp.dtype), torch.zeros_like(logp))
    denom = fmask.sum() if n_tokens is None else torch.as_tensor(n_tokens, dtype=logp.dtype)
    loss = per_token.sum() / denom.clamp(min=1)

    with torch.no_grad():
        r, w = ratio[mask].detach(), behav_w[mask]
        tokens = TokenStats(
            behav_iw=w,
            trust_ratio=r,
            capped=~keep[mask],
            clipped=(clipped > unclipped)[mask],
            kl_terms=w * ((r - 1) - (logp_m - prox_m)[mask].detach()),
        )
        metrics = {"loss/policy": loss.item(), **stability_metrics(tokens)}
    return (loss, metrics, tokens) if return_tokens else (loss, metrics)


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Standard PPO-clip (Schulman et al., 2017, eq. 7) with token-mean normalisation:
    ``l = max(-A * r, -A * clip(r, 1 - eps, 1 + eps_high))``, ``r = pi_theta / pi_old``.
    It is the decoupled loss with ``prox = behav = old`` (so ``w = 1``)."""
    return decoupled_ppo_loss(logp, old_logp, old_logp, advantages, mask, eps_clip, eps_clip_high, None)
