"""The KL penalty against a frozen reference policy, per token: the estimators ``k1`` and ``k3``
(registered by name) and the masked penalty over a batch. Shapes ``(N, L)``, aligned to ``input_ids`` as
:func:`a3po.models.logprobs.token_logprobs` (column ``t`` scores token ``t`` given the prefix before it)."""

from __future__ import annotations

import torch

from a3po.algorithms.checks import require_finite, require_same_shape
from a3po.registry import Registry

KL_ESTIMATORS: Registry = Registry("KL estimator")  # (logp, ref_logp) -> per-token estimate


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """``k1 = log pi(x) - log pi_ref(x)``, x ~ pi: unbiased for KL(pi || pi_ref), high variance,
    negative on some tokens (Schulman, 2020, "Approximating KL divergence")."""
    return logp - ref_logp


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """``k3 = (rho - 1) - log rho``, ``rho = pi_ref(x) / pi(x)``, x ~ pi: unbiased for
    KL(pi || pi_ref), never negative, lower variance (Schulman, 2020)."""
    log_rho = ref_logp - logp
    return torch.expm1(log_rho) - log_rho


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate ``(N, L)`` of the sampling policy against the reference (0 outside
    ``mask``); ``logp`` are the log-probs of the sampled tokens under the policy that sampled them."""
    require_same_shape(logp=logp, ref_logp=ref_logp, mask=mask)
    mask = mask.bool()
    require_finite("logp", logp, mask)
    require_finite("ref_logp", ref_logp, mask)
    zero = torch.zeros_like(logp, dtype=torch.float32)
    kl = KL_ESTIMATORS.get(estimator)(torch.where(mask, logp.float(), zero), torch.where(mask, ref_logp.float(), zero))
    return torch.where(mask, kl, zero)
