"""PPO scoring models for the OPPO tests: micro-sized reference, critic and reward model whose
outputs are far from trivial, so a wrong column, shift or critic version shows."""

from __future__ import annotations

import torch
from transformers import AutoModelForSequenceClassification

from a3po.data.arithmetic import WORDS
from a3po.models.critic import build_critic, frozen_copy
from a3po.models.factory import build_tiny_model
from a3po.training.ppo_parts import PPOParts


def micro_ppo_parts(policy, tok) -> PPOParts:
    other, _ = build_tiny_model("micro", WORDS, seed=1)  # a reference unlike the actor: KL is not 0
    cfg = other.config.__class__(**{**other.config.to_dict(), "num_labels": 1, "pad_token_id": tok.pad_token_id})
    torch.manual_seed(3)
    rm = AutoModelForSequenceClassification.from_config(cfg).eval()
    critic = build_critic(policy)
    with torch.no_grad():  # a critic head far from 0, so a wrong shift or column shows
        critic.score.weight.normal_(0, 1.0)
    return PPOParts(reference=frozen_copy(other), critic=critic, reward_model=rm, temperature=1.0)
