"""The PPO section: critic, GAE, KL penalty and reward model (:class:`PPOConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from a3po.config.errors import MAX_LR


@dataclass(frozen=True)
class PPOConfig:
    """The PPO path (critic, GAE, KL penalty, reward model); the defaults leave a GRPO run as it
    is. See ``a3po.training.ppo_parts`` and the ``tiny-ppo`` preset."""

    critic: Literal["none", "policy_copy"] = "none"
    """'policy_copy': a value model (the policy's backbone, copied at the start of RL, with a
    scalar head) trained beside the policy; needed by ``rl.advantage: gae``."""
    critic_init_path: str | None = None
    """A sequence-classification model directory (a reward model, ``a3po.training.reward_model``) whose
    backbone the critic starts from instead of the policy's, with a fresh head (InstructGPT
    starts its value function from the reward model); null: the policy's backbone."""
    critic_lr: float = 1e-4
    """The critic's own AdamW rate (constant after the policy's warm-up)."""
    critic_epochs: int = 1
    """Passes of the critic over each batch, in ``rl.minibatches`` minibatches each (the targets
    and ``V_old`` stay those of the scoring): the policy makes one pass, the critic's regression
    on binary outcomes needs more updates per sample (PPO implementations make several: CleanRL
    ``update_epochs`` 4, TRL ``num_ppo_epochs`` 4)."""
    vf_coef: float = 1.0
    """Scale of the value loss (the critic has its own optimizer: with Adam it matters only
    through gradient clipping at ``rl.grad_clip``)."""
    value_clip: float | None = 0.2
    """eps_v of the clipped value loss; null: unclipped."""
    gamma: float = 1.0
    """GAE discount per token."""
    lam: float = 0.95
    """GAE lambda."""
    kl_coef: float = 0.0
    """Per-token KL penalty against the reference (the frozen warm start) in the rewards; 0: no
    reference model is kept."""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """How the per-token KL is estimated from the sampled tokens (``a3po.algorithms.kl.KL_ESTIMATORS``)."""
    reward: Literal["grader", "model"] = "grader"
    """'grader': the task's grader scores each completion; 'model': a reward model does
    (the grader's score is still logged as ``reward/mean``)."""
    reward_model_path: str | None = None
    """With ``reward: model``: a sequence-classification model directory with one label (see
    ``a3po.training.reward_model``); its sigmoid is the reward."""

    def __post_init__(self) -> None:
        if not 0 < self.critic_lr <= MAX_LR or self.vf_coef <= 0:
            raise ValueError(f"ppo.critic_lr must be in (0, {MAX_LR}] and ppo.vf_coef > 0, got "
                             f"{self.critic_lr}, {self.vf_coef}")
        if self.critic_init_path is not None and self.critic != "policy_copy":
            raise ValueError("ppo.critic_init_path is set but ppo.critic is 'none'")
        if self.critic_epochs < 1:
            raise ValueError(f"ppo.critic_epochs must be >= 1, got {self.critic_epochs}")
        if self.value_clip is not None and self.value_clip <= 0:
            raise ValueError(f"ppo.value_clip must be > 0 (or null: unclipped), got {self.value_clip}")
        if not 0.0 <= self.gamma <= 1.0 or not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"ppo.gamma and ppo.lam must be in [0, 1], got {self.gamma}, {self.lam}")
        # Coefficients past 1000 dwarf every other term and overflow the loss or reward at the extreme.
        if not self.vf_coef <= 1000 or not 0 <= self.kl_coef <= 1000:
            raise ValueError("ppo.vf_coef must be in (0, 1000] and ppo.kl_coef in [0, 1000], got "
                             f"{self.vf_coef}, {self.kl_coef}")
        if self.reward == "model" and not self.reward_model_path:
            raise ValueError("ppo.reward is 'model' but ppo.reward_model_path is not set")
        if self.reward == "grader" and self.reward_model_path:
            raise ValueError("ppo.reward_model_path is set but ppo.reward is 'grader' (set "
                             "ppo.reward: model to use it)")
