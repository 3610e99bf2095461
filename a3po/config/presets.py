"""Built-in configs by name (``a3po train --preset``)."""

from __future__ import annotations

from typing import Any

from a3po.config.loading import config_from_dict
from a3po.config.schema import TrainConfig

PRESETS: dict[str, dict[str, Any]] = {
    # The embedded default: learns on 2 CPU cores in minutes.
    "tiny": {},
    # Seconds, for tests and smoke runs; learning is not expected.
    "micro": {
        "model": {"name": "micro"},
        "data": {"n_train": 200, "n_heldout": 16},
        "warm_start": {"steps": 5, "batch_size": 16},
        "rl": {"steps": 4, "batch_prompts": 4, "group_size": 2, "minibatches": 2, "max_new_tokens": 8,
               "eval_every": 2, "checkpoint_every": 2},
    },
    # PPO on the embedded task: GAE against a critic copied from the warm start, a small
    # per-token KL penalty against the frozen warm start, the grader's reward. Same batches and
    # policy settings as tiny, so it compares with GRPO.
    "tiny-ppo": {
        "rl": {"advantage": "gae"},
        "ppo": {"critic": "policy_copy", "critic_lr": 1e-3, "gamma": 1.0, "lam": 0.95, "kl_coef": 0.01, "kl_estimator": "k3"},
    },
}


def preset(name: str) -> TrainConfig:
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; valid: {sorted(PRESETS)}")
    return config_from_dict(PRESETS[name], where=f"preset {name}")
