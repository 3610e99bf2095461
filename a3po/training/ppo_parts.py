"""PPO's extra components, beside the proximal method and the advantage estimator:

* the KL penalty against a frozen reference policy (per token, ``k1`` or ``k3``), folded into
  the per-token rewards;
* the critic: a causal LM with a scalar value per token (``AutoModelForTokenClassification``,
  ``num_labels=1``), by default initialised from the warm-started policy, trained with a
  clipped value loss by its own optimizer;
* :func:`token_rewards`: the sequence score at its last response token, minus the penalty.

Pure tensor functions return ``(tensor, metrics)`` or tensors; the models are plain torch
modules. Shapes: ``(N, L)`` per token, aligned to ``input_ids`` as :func:`a3po.models.logprobs.token_logprobs`
(column ``t`` scores token ``t`` given the prefix before it).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from a3po.algorithms.checks import require_finite, require_same_shape
from a3po.algorithms.optimizers import adamw
from a3po.config import PPOConfig
from a3po.devices import autocast_for
from a3po.models.logprobs import position_ids_from_mask, token_logprobs
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


def token_rewards(scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None, kl_coef: float = 0.0) -> torch.Tensor:
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

    ``clip=None`` is the plain ``0.5 * (V - R)^2``. ``values`` carries the gradient; ``old_values``
    (the critic's values when the batch was scored) and ``returns`` are constants. ``n_tokens``
    replaces ``mask.sum()`` as the denominator (see :func:`a3po.algorithms.losses.decoupled_ppo_loss`).
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
        clipped_frac = ((clipped > unclipped) & mask).float().sum() / mask.sum().clamp(min=1)
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


# --- models -------------------------------------------------------------------------------


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The reference policy: a copy of ``model`` now (the warm start), no gradients, eval mode."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def build_critic(policy: torch.nn.Module, init_path: str | None = None) -> torch.nn.Module:
    """A value model from the policy: the same backbone (copied weights) with a fresh scalar
    head per token (``AutoModelForTokenClassification``, ``num_labels=1``, no dropout), on the
    policy's device and in its dtype. The head starts near 0 (std ``initializer_range``).
    ``init_path``: the backbone comes from that reward model instead (same architecture)."""
    from transformers import AutoModelForTokenClassification

    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    config.classifier_dropout = 0.0  # the default 0.1 would make V_old and V differ by noise
    param = next(policy.parameters())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the head's initialisation does not consume the run's random stream
        critic = AutoModelForTokenClassification.from_config(config)
    critic.to(device=param.device, dtype=param.dtype)
    # base_model of a *ForCausalLM is its backbone: the critic starts with the policy's features.
    backbone = policy.base_model if init_path is None else load_reward_model(init_path, param.device, param.dtype, "ppo.critic_init_path").base_model
    critic.base_model.load_state_dict(backbone.state_dict())
    return critic.eval()


def token_values(critic: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``V(s_t)`` per token ``(N, L)`` in fp32, aligned like log-probs: column ``t`` is the value
    of the prefix before token ``t`` (the head's output at position ``t - 1``); column 0 is 0."""
    with autocast_for(critic):
        out = critic(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask), use_cache=False)
    v = out.logits[..., 0].float()  # (N, L)
    return torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)


def reward_model_scores(reward_model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``sigmoid(logit)`` per sequence ``(N,)``, fp32, of a one-label sequence-classification
    model (it reads its logit at each row's rightmost non-pad token: the last response token):
    the probability that the completion is correct, on the grader's 0..1 scale."""
    with torch.no_grad(), autocast_for(reward_model):
        out = reward_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask), use_cache=False)
    return torch.sigmoid(out.logits[:, 0].float())


@dataclass
class PPOParts:
    """The models the PPO path adds to a run (each None when the config does not use it), and
    the step's helpers over them; built by :func:`build_ppo_parts`. With the defaults every
    helper is the identity of the GRPO path (grader rewards, no KL, no values)."""

    cfg: PPOConfig = field(default_factory=PPOConfig)
    reference: torch.nn.Module | None = None  # frozen warm start (kl_coef > 0)
    critic: torch.nn.Module | None = None
    critic_optimizer: torch.optim.Optimizer | None = None
    reward_model: torch.nn.Module | None = None
    temperature: float = 1.0  # the sampling temperature: the reference is scored on the same distribution

    def scores(self, batch, grader_scores: torch.Tensor, streamed: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """Per-sequence scores ``(N,)``: the grader's, or the reward model's (``streamed``: already
        computed while decoding, OPPO's intra-step overlap)."""
        if self.reward_model is None:
            return grader_scores, {}
        s = streamed if streamed is not None else reward_model_scores(self.reward_model, batch.input_ids, batch.attention_mask)
        agree = ((s > 0.5).float() == (grader_scores > 0.5).float()).float().mean()
        return s, {"reward/model_mean": s.mean().item(), "reward/model_grader_agreement": agree.item()}

    def kl(self, batch, ref_logp: torch.Tensor | None = None) -> tuple[torch.Tensor | None, dict[str, float]]:
        """Per-token KL ``(N, L)`` of the sampling policy against the reference, or None
        (``ref_logp``: the reference's log-probs already streamed while decoding)."""
        if self.reference is None:
            return None, {}
        if ref_logp is None:
            with torch.no_grad():
                ref_logp = token_logprobs(self.reference, batch.input_ids, batch.attention_mask, self.temperature)
        kl = kl_penalty(batch.behav_logp, ref_logp, batch.response_mask, self.cfg.kl_estimator)
        n_seq = max(len(batch), 1)
        return kl, {"ppo/kl": (kl.sum() / batch.response_mask.sum().clamp(min=1)).item(), "ppo/kl_seq": kl.sum().item() / n_seq}

    def values(self, batch, streamed: torch.Tensor | None = None) -> torch.Tensor:
        """The critic's values ``(N, L)`` when the batch is scored (``V_old`` of the value clip);
        ``streamed``: already computed while decoding (see :mod:`a3po.oppo.intra` for which critic)."""
        if self.critic is None:
            raise ValueError("values were asked for but no critic is configured (ppo.critic: none)")
        if streamed is not None:
            return streamed
        with torch.no_grad():
            return token_values(self.critic, batch.input_ids, batch.attention_mask)

    def update_critic(self, batch, rows: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, grad_clip: float) -> dict[str, float]:
        """One optimizer step of the critic on ``rows``: the clipped value loss, scaled by ``vf_coef``."""
        self.critic.train()
        v = token_values(self.critic, batch.input_ids[rows], batch.attention_mask[rows])
        loss, metrics = clipped_value_loss(v, old_values[rows], returns[rows], batch.response_mask[rows], self.cfg.value_clip)
        self.critic_optimizer.zero_grad(set_to_none=True)
        (self.cfg.vf_coef * loss).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.critic.parameters(), grad_clip)
        self.critic_optimizer.step()
        self.critic.eval()
        return {**metrics, "ppo/value_grad_norm": grad_norm.item()}

    def further_critic_epochs(
        self, batch, old_values: torch.Tensor, returns: torch.Tensor, minibatches: int, shard, seed: int, grad_clip: float
    ) -> dict[str, float]:
        """Passes 2..``critic_epochs`` of the critic over the batch (the first runs beside the
        policy's minibatches), each in its own permutation drawn on the CPU from ``seed`` (the
        same minibatches on every device and on resume); ``shard`` picks this rank's rows."""
        losses: list[float] = []
        for epoch in range(1, self.cfg.critic_epochs):
            gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            perm = torch.randperm(len(batch), generator=gen).to(batch.input_ids.device)
            losses = [self.update_critic(batch, shard(mb), old_values, returns, grad_clip)["ppo/value_loss"] for mb in perm.chunk(minibatches)]
        return {"ppo/value_loss_last_epoch": sum(losses) / len(losses)} if losses else {}

    def state(self) -> dict:
        """What a checkpoint keeps (the critic and its optimizer; the reference and the reward
        model are rebuilt from the warm start and the config)."""
        if self.critic is None:
            return {}
        return {"critic": self.critic.state_dict(), "critic_optimizer": self.critic_optimizer.state_dict()}

    def load_state(self, state: dict) -> None:
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
            self.critic_optimizer.load_state_dict(state["critic_optimizer"])


def load_reward_model(path: str, device: torch.device, dtype: torch.dtype, field: str = "ppo.reward_model_path") -> torch.nn.Module:
    """A one-label sequence-classification model from a local directory (safetensors: loading
    runs no code), frozen, in eval mode."""
    from pathlib import Path

    from transformers import AutoModelForSequenceClassification

    if not Path(path).is_dir():
        raise FileNotFoundError(f"{field} {path} is not a model directory")
    rm = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype).to(device)
    if rm.config.num_labels != 1:
        raise ValueError(f"{path}: a reward model has one label (a scalar score), this one has {rm.config.num_labels}")
    if rm.config.pad_token_id is None:
        raise ValueError(f"{path}: the reward model's config has no pad_token_id (needed to find each row's last token)")
    for p in rm.parameters():
        p.requires_grad_(False)
    return rm.eval()


def build_ppo_parts(cfg: PPOConfig, policy: torch.nn.Module, temperature: float) -> PPOParts:
    """The PPO models of a run, from ``policy`` as it is now (the warm start: call this before a
    checkpoint's weights are loaded into it)."""
    param = next(policy.parameters())
    parts = PPOParts(cfg=cfg, temperature=temperature)
    if cfg.kl_coef > 0:
        parts.reference = frozen_copy(policy)
    if cfg.critic == "policy_copy":
        parts.critic = build_critic(policy, cfg.critic_init_path)
        parts.critic_optimizer = adamw(parts.critic.parameters(), cfg.critic_lr)
    if cfg.reward == "model":
        parts.reward_model = load_reward_model(cfg.reward_model_path, param.device, param.dtype)
    return parts
