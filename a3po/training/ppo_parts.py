"""PPO's stateful parts, beside the proximal method and the advantage estimator: the frozen
reference (KL penalty, :mod:`a3po.algorithms.kl`), the critic and its optimizer (clipped value
loss, :mod:`a3po.algorithms.value`) and the reward model (:mod:`a3po.models.critic`), held in
:class:`PPOParts` with the step's helpers over them; built by :func:`build_ppo_parts`.

Under DeepSpeed trainer ranks the critic trains as the policy does (:mod:`a3po.parallel.ranks`):
its own engine and AdamW (:func:`a3po.parallel.updaters.make_critic_updater`), each rank on its
shard of every minibatch, the value loss's token denominator all-reduced and scaled by the world
size, so 2 ranks compute the single process's update. Every rank holds the whole batch and
computes its values (``V_old``, GAE) on it with the same weights: the same values everywhere.

Shapes: ``(N, L)`` per token, aligned to ``input_ids`` as :func:`a3po.models.logprobs.token_logprobs`
(column ``t`` scores token ``t`` given the prefix before it).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

from a3po.algorithms.kl import kl_penalty
from a3po.algorithms.optimizers import adamw
from a3po.algorithms.value import clipped_value_loss
from a3po.config import PPOConfig
from a3po.models.critic import build_critic, frozen_copy, load_reward_model, reward_model_scores, token_values
from a3po.models.logprobs import token_logprobs
from a3po.parallel.ranks import Ranks
from a3po.parallel.updaters import LocalUpdater, Updater, make_critic_updater, plain_model


@dataclass
class PPOParts:
    """The models the PPO path adds to a run (each None when the config does not use it), and
    the step's helpers over them; built by :func:`build_ppo_parts`. With the defaults every
    helper is the identity of the GRPO path (grader rewards, no KL, no values). An
    :class:`a3po.training.extensions.Extension` of the run: it checkpoints the critic and its optimizer.

    ``critic_updater`` (:meth:`make_updater`) steps the critic; without one (a step called
    outside the loop) its AdamW steps in this process."""

    cfg: PPOConfig = field(default_factory=PPOConfig)
    reference: torch.nn.Module | None = None  # frozen warm start (kl_coef > 0)
    critic: torch.nn.Module | None = None
    critic_optimizer: torch.optim.Optimizer | None = None
    reward_model: torch.nn.Module | None = None
    temperature: float = 1.0  # the sampling temperature: the reference is scored on the same distribution
    critic_updater: Updater | None = None
    ranks: Ranks = field(default_factory=Ranks)

    def make_updater(self, rl, deepspeed_config: str | None, ranks: Ranks) -> None:
        """The critic's updater (its own DeepSpeed engine under ``deepspeed_config``); call after
        :meth:`load_weights` on resume and before :meth:`load_state`."""
        if self.critic is not None:
            self.critic_updater = make_critic_updater(self.critic, self.critic_optimizer, rl, deepspeed_config, ranks)
        self.ranks = ranks

    @property
    def _critic_model(self) -> torch.nn.Module:
        """What the critic's forwards call: its engine under DeepSpeed, else the module."""
        return self.critic_updater.model if self.critic_updater is not None else self.critic

    def critic_full_weights(self) -> AbstractContextManager:
        """Inside it the critic's parameters hold the full weights on every rank (a gather under
        ZeRO-3: every rank enters it; read-only)."""
        return self.critic_updater.full_weights() if self.critic_updater is not None else nullcontext()

    def plain_critic(self) -> torch.nn.Module:
        """The critic as a plain module outside DeepSpeed, for scorers that run their own forwards:
        the module itself in one process, else a copy of its full weights (gathered under ZeRO-3:
        a collective, every rank calls it), free of the engine's hooks and flat buffers."""
        if self.critic_updater is None or isinstance(self.critic_updater, LocalUpdater):
            return self.critic
        # the copy's init draws nothing from the run's stream
        with self.critic_full_weights(), torch.random.fork_rng(devices=[]):
            weights = {k: v.detach().clone() for k, v in self.critic.state_dict().items()}
            return plain_model(self.critic, weights)

    def scores(self, batch, grader_scores: torch.Tensor,
               streamed: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """Per-sequence scores ``(N,)``: the grader's, or the reward model's (``streamed``: already
        computed while decoding, OPPO's intra-step overlap)."""
        if self.reward_model is None:
            return grader_scores, {}
        s = streamed if streamed is not None else reward_model_scores(self.reward_model, batch.input_ids,
                                                                      batch.attention_mask)
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
        return kl, {"ppo/kl": (kl.sum() / batch.response_mask.sum().clamp(min=1)).item(),
                    "ppo/kl_seq": kl.sum().item() / n_seq}

    def values(self, batch, streamed: torch.Tensor | None = None) -> torch.Tensor:
        """The critic's values ``(N, L)`` when the batch is scored (``V_old`` of the value clip);
        ``streamed``: already computed while decoding (see :mod:`a3po.oppo.intra` for which critic)."""
        if self.critic is None:
            raise ValueError("values were asked for but no critic is configured (ppo.critic: none)")
        if streamed is not None:
            return streamed
        with torch.no_grad():  # the whole batch on every rank (a collective forward under ZeRO-3: every rank runs it)
            return token_values(self._critic_model, batch.input_ids, batch.attention_mask)

    def update_critic(self, batch, rows: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                      grad_clip: float) -> dict[str, float]:
        """One optimizer step of the critic on ``rows`` (this rank's shard of a minibatch): the
        clipped value loss, scaled by ``vf_coef``, its token mean over the whole minibatch (the
        denominator all-reduced, as the policy's loss). The metrics are the whole minibatch's."""
        if self.critic_updater is None:
            self.critic_updater = LocalUpdater(self.critic, self.critic_optimizer, grad_clip, what="critic")
        model, resp, clip = self._critic_model, batch.response_mask, self.cfg.value_clip
        model.train()
        v = token_values(model, batch.input_ids[rows], batch.attention_mask[rows])
        loss, metrics = clipped_value_loss(v, old_values[rows], returns[rows], resp[rows], clip,
                                           n_tokens=self.ranks.sum(resp[rows].sum()))
        grad_norm = self.critic_updater.update(self.cfg.vf_coef * loss)
        model.eval()
        if self.ranks.world_size > 1:  # the figures of the whole minibatch, as one process computes them
            mb = self.ranks.gather_rows(rows)
            _, metrics = clipped_value_loss(self.ranks.gather_rows(v.detach()), old_values[mb], returns[mb],
                                            resp[mb], clip)
        return {**metrics, "ppo/value_grad_norm": grad_norm}

    def further_critic_epochs(
        self, batch, old_values: torch.Tensor, returns: torch.Tensor, minibatches: int, shard, seed: int,
        grad_clip: float
    ) -> dict[str, float]:
        """Passes 2..``critic_epochs`` of the critic over the batch (the first runs beside the
        policy's minibatches), each in its own permutation drawn on the CPU from ``seed`` (the
        same minibatches on every device and on resume); ``shard`` picks this rank's rows."""
        losses: list[float] = []
        for epoch in range(1, self.cfg.critic_epochs):
            gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            perm = torch.randperm(len(batch), generator=gen).to(batch.input_ids.device)
            losses = [self.update_critic(batch, shard(mb), old_values, returns, grad_clip)["ppo/value_loss"]
                      for mb in perm.chunk(minibatches)]
        return {"ppo/value_loss_last_epoch": sum(losses) / len(losses)} if losses else {}

    def state(self) -> dict:
        """What a checkpoint keeps (the critic and its optimizer; the reference and the reward
        model are rebuilt from the warm start and the config). Under DeepSpeed a collective (every
        rank calls it): the full weights (gathered under ZeRO-3) and every rank's optimizer
        partition, on rank 0."""
        if self.critic is None:
            return {}
        if self.critic_updater is None:
            return {"critic": self.critic.state_dict(), "critic_optimizer": self.critic_optimizer.state_dict()}
        optimizer = self.critic_updater.optimizer_state()
        with self.critic_full_weights():  # ZeRO-3's gathered tensors are freed on exit: copy them
            state = self.critic.state_dict() if self.ranks.is_main else None
            weights = state
            if state is not None and self.critic_updater.partitioned:
                weights = {k: v.detach().clone() for k, v in state.items()}
        return {"critic": weights, "critic_optimizer": optimizer}

    def load_weights(self, state: dict) -> None:
        """The checkpoint's critic weights, before :meth:`make_updater` (ZeRO-3 partitions the
        weights the module holds when its engine is built)."""
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])

    def load_state(self, state: dict) -> None:
        """The checkpoint's critic: its weights and optimizer state; with an updater made, its
        optimizer state alone (:meth:`load_weights` came before)."""
        if self.critic is None:
            return
        if self.critic_updater is None:
            self.load_weights(state)
            self.critic_optimizer.load_state_dict(state["critic_optimizer"])
        else:
            self.critic_updater.load_optimizer_state(state["critic_optimizer"])

    def after_update(self, step: int, scored) -> None:
        pass  # the critic learns inside the step (update_critic); nothing to publish

    def close(self) -> None:
        pass  # plain modules: nothing runs in the background


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
