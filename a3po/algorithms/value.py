"""PPO's reward shaping and critic figures as pure tensor functions: :func:`token_rewards` (the
sequence score at its last response token, minus the KL penalty), the clipped value loss, the
critic's explained variance and the share of the outcome variance that lies between prompts.
Shapes ``(N, L)`` per token, aligned to ``input_ids`` as :func:`a3po.models.logprobs.token_logprobs`."""

from __future__ import annotations

import torch

from a3po.algorithms.checks import require_finite, require_same_shape


def token_rewards(scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                  kl_coef: float = 0.0) -> torch.Tensor:
    """Per-token rewards ``(N, L)``: ``scores[i]`` at row i's last response token, minus
    ``kl_coef * kl`` on every response token (Ziegler et al., 2019; Ouyang et al., 2022, eq. 2).
    A row without response tokens gets no reward (nothing was generated to credit)."""
    mask = mask.bool()
    n, width = mask.shape
    cols = torch.arange(width, device=mask.device).expand(n, width)
    last = torch.where(mask, cols, torch.full_like(cols, -1)).max(-1).values  # (N,) -1: empty row
    out = torch.zeros((n, width), dtype=torch.float32, device=mask.device)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = scores.to(torch.float32)[rows]
    if kl is not None and kl_coef:
        out = out - kl_coef * torch.where(mask, kl.float(), torch.zeros_like(out))
    return out


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None,
    n_tokens: torch.Tensor | int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss (PPO2, Dhariwal et al., 2017; CleanRL ``clip_vloss``), token mean::

        V_clip = V_old + clip(V - V_old, -eps_v, eps_v)
        l      = 0.5 * max((V - R)^2, (V_clip - R)^2)

    ``clip=None`` is the plain ``0.5 * (V - R)^2``. ``ppo/value_clip_frac``: the share of tokens
    where the clip binds (``|V - V_old| > eps_v`` and the clipped term is the larger). ``values``
    carries the gradient; ``old_values`` (the critic's values when the batch was scored) and
    ``returns`` are constants. ``n_tokens`` replaces ``mask.sum()`` as the denominator (see
    :func:`a3po.algorithms.losses.decoupled_ppo_loss`).
    """
    require_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    mask = mask.bool()
    for name, t in (("values", values.detach()), ("old_values", old_values), ("returns", returns)):
        require_finite(name, t, mask)
    zero = torch.zeros_like(values)
    v = torch.where(mask, values, zero)
    old = torch.where(mask, old_values.detach().to(values.dtype), zero)
    ret = torch.where(mask, returns.detach().to(values.dtype), zero)
    unclipped = (v - ret) ** 2
    if clip is None:
        per_token = unclipped
        clipped_frac = torch.zeros(())
    else:
        v_clip = old + (v - old).clamp(-clip, clip)
        clipped = (v_clip - ret) ** 2
        per_token = torch.maximum(unclipped, clipped)
        # The clip binds where it moved V (|V - V_old| > eps_v) and the clipped error is the larger: where V == V_old
        # up to float noise (a minibatch's first update) the two squares tie and a bare ">" would count noise.
        binds = ((v - old).abs() > clip) & (clipped > unclipped)
        clipped_frac = (binds & mask).float().sum() / mask.sum().clamp(min=1)
    denom = mask.sum() if n_tokens is None else torch.as_tensor(n_tokens)
    loss = 0.5 * (per_token * mask).sum() / denom.clamp(min=1).to(values.dtype)
    return loss, {"ppo/value_loss": loss.item(), "ppo/value_clip_frac": clipped_frac.item()}


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over ``mask``: 1 is a perfect critic, 0 no better than a
    constant, negative worse (CleanRL's ``explained_var``); 0 when the returns do not vary."""
    m = mask.bool()
    r, v = returns[m].float(), values[m].float()
    var_r = r.var(unbiased=False) if r.numel() else torch.zeros(())
    if var_r.item() == 0:
        return 0.0
    return (1 - (r - v).var(unbiased=False) / var_r).item()


def between_prompt_share(scores: torch.Tensor, group_ids: torch.Tensor) -> float:
    """Share of the outcome variance that lies between prompts (one-way random-effects ANOVA)::

        MSB  = sum_g n_g (mean_g - mean)^2 / (G - 1)
        MSW  = sum_g sum_i (y_gi - mean_g)^2 / (N - G)
        n0   = (N - sum_g n_g^2 / N) / (G - 1)
        s2_b = max(0, (MSB - MSW) / n0)        share = s2_b / (s2_b + MSW)

    The explained variance of an oracle critic that knows each prompt's success rate and nothing
    about the sampled answer: what a value model can reach without judging the answer itself.
    ``scores`` ``(N,)``, ``group_ids`` ``(N,)``; 0 when the scores do not vary (as
    :func:`explained_variance`), nan with < 2 groups or no group of 2 samples."""
    require_same_shape(scores=scores, group_ids=group_ids)
    y = scores.double()
    _, inv, n_g = torch.unique(group_ids, return_inverse=True, return_counts=True)
    n, g = len(y), len(n_g)
    if g < 2 or n <= g:
        return float("nan")
    mean_g = torch.zeros(g, dtype=torch.float64).index_add_(0, inv, y) / n_g
    msb = (n_g * (mean_g - y.mean()) ** 2).sum() / (g - 1)
    msw = ((y - mean_g[inv]) ** 2).sum() / (n - g)
    n0 = (n - (n_g.double() ** 2).sum() / n) / (g - 1)
    s2_b = ((msb - msw) / n0).clamp(min=0)
    total = s2_b + msw
    return (s2_b / total).item() if total > 0 else 0.0
