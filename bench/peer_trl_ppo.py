"""TRL's PPOTrainer (TRL 1.12, ``trl.experimental.ppo``) on the project's PPO work: seconds per PPO
step, generation tokens/s, busy fractions and reward, as a row beside the project's PPO path.

    make setup-trl-ppo                               # once: .venv-trl-ppo, TRL 1.12 (the 'bench-ppo' extra)
    python -m bench.peer_trl_ppo --preset tiny --warmstart-cache DIR --steps 12
    python -m bench.oppo --path ppo --preset tiny --warmstart-cache DIR   # side by side

TRL 1.12 is the last TRL release with a PPO trainer (1.16, the ``bench`` extra that
bench/peer_trl.py uses, has none), so it lives in a venv of its own, ``.venv-trl-ppo``
(``A3PO_TRL_PPO_VENV=DIR`` for one elsewhere). Started from another interpreter, the bench
re-runs itself in that venv when it exists; where it does not, it prints the make target and
ends with a "not run" JSON line.

The work is bench.oppo's PPO path with OPPO off (the ``tiny-ppo`` settings on the long-tailed
workload): the same policy (the warm start, or the tiny init without ``--warmstart-cache``), the
same critic (``a3po.models.critic.build_critic``: the policy's backbone with a fresh one-label
token-classification head; TRL reads it through ``base_model_prefix`` and ``score``), the same
frozen reference (``a3po.models.critic.frozen_copy``), the same prompts in the same order (the project's
``PromptSampler``: batch ``j`` is ``batch_prompts`` prompts x ``group_size`` samples, fed to TRL
unshuffled, one response per row) and the same reward. TRL's PPO only takes a reward *model*
(``get_reward`` runs ``getattr(rm, rm.base_model_prefix)`` and ``rm.score(hidden[-1])``, read at
the last response token). tiny-ppo rewards with the rule grader, so TRL gets :class:`GraderReward`:
a module with that interface whose "score" is the project's grader on the decoded completion
(the same call, same decoding). That keeps the work equal: a neural reward model on TRL's side
only would charge TRL a forward the project does not run. With ``ppo.reward: model`` TRL gets the
same reward model behind :class:`SigmoidReward` (the project's reward is ``sigmoid(logit)``).

Settings, TRL 1.12 ``PPOConfig`` <- the project's config:

    per_device_train_batch_size   <- rl.batch_prompts * rl.group_size (one rollout batch; no grad accumulation)
    local_rollout_forward_batch_size <- the same (one generate call per batch, as the project's engine)
    total_episodes                <- steps * batch (one PPO step per batch)
    num_ppo_epochs                <- 1 (the project takes one pass over each batch)
    num_mini_batches              <- rl.minibatches (optimizer steps per batch)
    response_length, stop_token   <- rl.max_new_tokens, "eos"
    temperature (top_k 0, top_p 1) <- rl.temperature (rl.top_p is 1 for training)
    cliprange                     <- rl.eps_clip (TRL has no separate upper bound: rl.eps_clip_high must be null)
    cliprange_value, vf_coef      <- ppo.value_clip (null: unbounded), ppo.vf_coef
    gamma, lam                    <- ppo.gamma, ppo.lam (GAE; both whiten the advantages over the batch)
    kl_coef, kl_estimator         <- ppo.kl_coef, ppo.kl_estimator (per-token penalty in the rewards)
    whiten_rewards, missing_eos_penalty <- False, None (the project does neither)
    optimizer                     <- AdamW, weight decay 0, two groups: the policy at rl.lr on the
                                     project's schedule (a3po.training.lr_schedule.learning_rate: warm-up, cosine),
                                     the critic at ppo.critic_lr, constant (the project's own critic optimizer)
    seed, fp32, CPU, no gradient checkpointing, no logging/saving.
    threads                       <- --trl-threads (0: every usable core, as bench/peer_trl.py gives TRL's
                                     GRPO). The project's async PPO runs its producer and trainer threads
                                     on one intra-op thread each; TRL works in one thread, so it gets the
                                     cores as intra-op threads. On an oversubscribed machine two OpenMP
                                     threads can be ~10x slower than one (measured: see docs/results.md).

What TRL 1.12 cannot match: it never clips gradients (``optimizer.step()`` without
``clip_grad_norm_``; the project clips policy and critic at rl.grad_clip); policy and critic take
one summed loss (``pg + vf_coef * vf``) through one optimizer (separate parameters, so the
gradients are the same; only the clip differs); it is on-policy (PPO ratio against the
behaviour log-probs; no decoupled proximal policy, no ``rl.behav_weight_cap``); it puts the score
one position after the EOS (its ``sequence_lengths + 1``) and keeps the value there; one
response per prompt row (the group structure is only the repeated prompts).

Figures (steps after the first; the first pays for start-up): ``step_s_median`` = median time
between the ends of consecutive PPO steps (TRL's ``on_step_end``); ``generator_busy`` = the
generate call's share of the step; ``scorer_busy`` = the reference, critic and reward passes'
share (TRL's no-grad ``forward`` and ``get_reward``); ``trainer_busy`` = the rest (GAE, the
PPO minibatch updates and TRL's own ``gc.collect()`` twice a step, ~0.5 s each in this process's
heap). TRL runs them one after another in one thread, so the three add to 1.
``gen_tok_s`` = generated tokens (EOS included) / generate time, median. ``reward_mean`` = mean
grader score (TRL's ``objective/scores``) over all steps, as bench.oppo averages its settings'.
Prints a table, then as the very last line one JSON object.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from a3po.config import TrainConfig
from a3po.data.datasets import prompt_style
from a3po.grading.rewards import score_completions
from a3po.models.critic import build_critic, frozen_copy, load_reward_model
from a3po.placement.cores import usable_cores
from a3po.producer.producer import PromptSampler
from a3po.training.lr_schedule import learning_rate
from bench._peer_venvs import TRL_PPO
from bench._ppo_workload import parse_args, setting_config, setting_model


def trl_ppo_missing() -> str | None:
    """Why TRL's PPOTrainer cannot be imported here, with how to install it; None when it can."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # its import warning is not news here
    try:
        from trl.experimental.ppo import PPOConfig, PPOTrainer  # noqa: F401
    except ImportError as e:
        try:
            import trl

            have = f"TRL {trl.__version__} is installed but has no PPOTrainer ({e})"
        except ImportError:
            have = f"TRL is not installed ({e})"
        return f"{have}; TRL 1.12 is the last release with PPO, in a venv of its own: {TRL_PPO.install_hint('bench.peer_trl_ppo')}"
    return None


class _Passthrough(torch.nn.Module):
    """A "backbone" whose last hidden state is the token ids and mask themselves ``(N, L, 2)``."""

    def forward(self, input_ids, attention_mask, **_):
        return SimpleNamespace(hidden_states=(torch.stack([input_ids, attention_mask.long()], -1),))


class GraderReward(torch.nn.Module):
    """The rule grader behind TRL's reward-model interface (``base_model_prefix`` backbone +
    ``score``): ``score`` decodes each row's completion (the columns after ``context_length``, the
    current batch's prompt width) exactly as the project's producer does, grades it against the
    gold of its prompt, and returns that score at every position ``(N, L, 1)``."""

    base_model_prefix = "backbone"

    def __init__(self, task: str, tokenizer, golds: dict[tuple[int, ...], tuple[str, str]]) -> None:
        super().__init__()
        self.backbone = _Passthrough()
        self.task, self.tok, self.golds = task, tokenizer, golds
        self.context_length = 0  # set per batch (the left-padded prompt width)
        self.seconds = 0.0  # grading time

    def score(self, h: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        ids, mask = h[..., 0], h[..., 1].bool()
        c, eos = self.context_length, self.tok.eos_token_id
        comps, golds, rows = [], [], []
        for i in range(ids.shape[0]):
            gold, row = self.golds[tuple(ids[i, :c][mask[i, :c]].tolist())]
            resp = [t for t in ids[i, c:][mask[i, c:]].tolist() if t != eos]
            comps.append(self.tok.decode(resp, skip_special_tokens=True))
            golds.append(gold)
            rows.append(row)
        s = torch.tensor(score_completions(self.task, comps, golds, rows), dtype=torch.float32)
        self.seconds += time.perf_counter() - t0
        return s[:, None, None].expand(ids.shape[0], ids.shape[1], 1)


class SigmoidReward(torch.nn.Module):
    """A one-label sequence-classification reward model as the project scores with it
    (``sigmoid(logit)``, ``a3po.models.critic.reward_model_scores``), behind TRL's interface."""

    def __init__(self, rm: torch.nn.Module) -> None:
        super().__init__()
        self.base_model_prefix = rm.base_model_prefix
        setattr(self, rm.base_model_prefix, getattr(rm, rm.base_model_prefix))
        self.head = rm.score

    def score(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.head(h).float())


def trl_ppo_config(cfg: TrainConfig, steps: int, out_dir: Path):
    """TRL 1.12's ``PPOConfig`` for ``cfg``'s PPO settings (the mapping is the module docstring's)."""
    from trl.experimental.ppo import PPOConfig

    rl, ppo = cfg.rl, cfg.ppo
    if rl.eps_clip_high is not None:
        raise ValueError(f"rl.eps_clip_high={rl.eps_clip_high}: TRL's PPO has one clip range (cliprange); set it to null to compare")
    batch = rl.batch_prompts * rl.group_size
    return PPOConfig(
        output_dir=str(out_dir), total_episodes=steps * batch, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        local_rollout_forward_batch_size=batch, num_ppo_epochs=1, num_mini_batches=rl.minibatches,
        response_length=rl.max_new_tokens, stop_token="eos", temperature=rl.temperature, missing_eos_penalty=None,
        cliprange=rl.eps_clip, cliprange_value=ppo.value_clip if ppo.value_clip is not None else float("inf"),
        vf_coef=ppo.vf_coef, gamma=ppo.gamma, lam=ppo.lam, kl_coef=ppo.kl_coef, kl_estimator=ppo.kl_estimator,
        whiten_rewards=False, learning_rate=rl.lr, num_sample_generations=0, seed=rl.seed,
        bf16=False, fp16=False, use_cpu=True, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
    )


def run_trl_ppo(cfg: TrainConfig, policy: torch.nn.Module, tokenizer, train_rows: list[dict], steps: int,
                out_dir: str | Path | None = None, threads: int | None = None) -> dict:
    """``steps`` PPO steps of TRL's PPOTrainer on ``cfg``'s work from a copy of ``policy`` (left
    as it is); returns the figures of the module docstring. Needs TRL 1.12 (:func:`trl_ppo_missing`)."""
    import trl
    import trl.experimental.ppo.ppo_trainer as ppo_mod
    from datasets import Dataset
    from torch.utils.data import DataLoader
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl.experimental.ppo import PPOTrainer

    if steps < 2:
        raise ValueError(f"steps must be >= 2 (the first step is not timed), got {steps}")
    rl, ppo = cfg.rl, cfg.ppo
    if ppo.critic == "none":
        raise ValueError("TRL's PPO needs a critic: the config's ppo.critic is 'none' (use the tiny-ppo settings)")
    out_dir = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="a3po-trl-ppo-"))
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads or usable_cores())  # TRL's one thread of work may use every core
    try:
        model = copy.deepcopy(policy).float().train()
        ref, critic = frozen_copy(model), build_critic(model)
        # The same prompts in the same order as the project's batches 0 .. steps-1.
        sampler = PromptSampler(train_rows, tokenizer, rl.batch_prompts, rl.group_size, rl.seed, prompt_style(cfg.data))
        ids, golds = [], {}
        for j in range(steps):
            prompts, meta = sampler.batch(j)
            ids += prompts
            golds.update({tuple(p): (m["gold"], m["id"]) for p, m in zip(prompts, meta, strict=False)})
        dataset = Dataset.from_dict({"input_ids": ids})
        if ppo.reward == "model":
            reward = SigmoidReward(load_reward_model(ppo.reward_model_path, torch.device("cpu"), torch.float32))
        else:
            reward = GraderReward(cfg.data.task, tokenizer, golds)
        groups = [{"params": list(model.parameters()), "lr": rl.lr}, {"params": list(critic.parameters()), "lr": ppo.critic_lr}]
        optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda s: learning_rate(rl, s) / rl.lr, lambda s: 1.0])

        ends: list[float] = []
        rewards: list[float] = []
        per_step: list[dict[str, float]] = []
        acc = {"gen_s": 0.0, "score_s": 0.0, "tokens": 0, "rows": 0}

        class StepTimer(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kw):
                if logs and "objective/scores" in logs:
                    rewards.append(float(logs["objective/scores"]))

            def on_step_end(self, args, state, control, **kw):
                ends.append(time.perf_counter())
                per_step.append(dict(acc))
                acc.update(gen_s=0.0, score_s=0.0, tokens=0, rows=0)

        trainer = PPOTrainer(args=trl_ppo_config(cfg, steps, out_dir / "trl_ppo"), processing_class=tokenizer, model=model,
                             ref_model=ref, reward_model=reward, value_model=critic, train_dataset=dataset, eval_dataset=dataset,
                             optimizers=(optimizer, schedule), callbacks=[StepTimer()])
        trainer.remove_callback(PrinterCallback)  # it prints every step's metrics (disable_tqdm)
        # TRL shuffles its prompts; the project's order instead (batch j = sampler.batch(j)), padded
        # on the left whatever the tokenizer's side (TRL's responses start at the prompt block's end).
        trainer.dataloader = DataLoader(dataset, batch_size=rl.batch_prompts * rl.group_size, shuffle=False, drop_last=True,
                                        collate_fn=lambda rows: tokenizer.pad(rows, padding_side="left", return_tensors="pt"))

        originals = {name: getattr(ppo_mod, name) for name in ("batch_generation", "forward", "get_reward")}

        def timed_generation(model, queries, *a, **kw):
            if bool((queries[:, -1] == tokenizer.pad_token_id).any()):
                raise RuntimeError("TRL was handed right-padded prompts: it would generate after the padding")
            if isinstance(reward, GraderReward):
                reward.context_length = queries.shape[1]
            t0 = time.perf_counter()
            query_responses, logits = originals["batch_generation"](model, queries, *a, **kw)
            acc["gen_s"] += time.perf_counter() - t0
            acc["tokens"] += int((query_responses[:, queries.shape[1]:] != tokenizer.pad_token_id).sum())  # EOS included
            acc["rows"] += queries.shape[0]
            return query_responses, logits

        def timed(name):
            def call(*a, **kw):
                if torch.is_grad_enabled():  # a training forward (policy + value), not scoring
                    return originals[name](*a, **kw)
                t0 = time.perf_counter()
                out = originals[name](*a, **kw)
                acc["score_s"] += time.perf_counter() - t0
                return out
            return call

        ppo_mod.batch_generation, ppo_mod.forward, ppo_mod.get_reward = timed_generation, timed("forward"), timed("get_reward")
        try:
            trainer.train()
        finally:
            for name, fn in originals.items():
                setattr(ppo_mod, name, fn)
    finally:
        torch.set_num_threads(threads_before)

    timed_steps = [(b - a, s) for a, b, s in zip(ends[:-1], ends[1:], per_step[1:], strict=False)]  # the first step is not timed
    period = [p for p, _ in timed_steps]
    return {
        "trl_version": trl.__version__,
        "reward_source": "model (sigmoid of its logit)" if ppo.reward == "model" else "grader (GraderReward)",
        "steps": len(ends),
        "step_s_median": statistics.median(period),
        "trainer_busy": statistics.mean((p - s["gen_s"] - s["score_s"]) / p for p, s in timed_steps),
        "generator_busy": statistics.mean(s["gen_s"] / p for p, s in timed_steps),
        "scorer_busy": statistics.mean(s["score_s"] / p for p, s in timed_steps),
        "gen_tok_s": statistics.median(s["tokens"] / max(s["gen_s"], 1e-9) for _, s in timed_steps),
        "reward_mean": statistics.mean(rewards),
        "reward_curve": [round(r, 4) for r in rewards],
        "response_len": statistics.mean(s["tokens"] / max(s["rows"], 1) for s in per_step),
        "threads": threads or usable_cores(),
    }


def table(name: str, f: dict) -> str:
    head = f"{'side':10} {'step_s':>8} {'trainer_busy':>13} {'gen_busy':>9} {'scorer_busy':>12} {'gen_tok/s':>10} {'reward':>7} {'resp_len':>9}"
    return "\n".join([head, f"{name:10} {f['step_s_median']:8.3f} {f['trainer_busy']:13.2f} {f['generator_busy']:9.2f} "
                            f"{f['scorer_busy']:12.2f} {f['gen_tok_s']:10.0f} {f['reward_mean']:7.3f} {f['response_len']:9.1f}"])


def main(argv: list[str] | None = None) -> dict:
    # The workload is bench.oppo's PPO path with OPPO off.
    args = parse_args(argv, prog="python -m bench.peer_trl_ppo", description=__doc__.split("\n\n")[0])
    args.path = "ppo"
    command = "python -m bench.peer_trl_ppo " + " ".join(argv if argv is not None else sys.argv[1:])
    missing = trl_ppo_missing()
    if missing:
        print(f"peer_trl_ppo: not run: {missing}")
        out = {"bench": "peer_trl_ppo", "trl_ppo": "not run", "why": missing, "command": command}
    else:
        cfg = setting_config(args, {})
        model, tok, train, _ = setting_model(args, cfg)
        figures = run_trl_ppo(cfg, model, tok, train, args.steps, threads=args.trl_threads or None)
        print(f"peer_trl_ppo: TRL {figures['trl_version']} PPOTrainer, {args.steps} steps (first not timed), {figures['threads']} threads")
        print(table("TRL PPO", figures))
        out = {"bench": "peer_trl_ppo", "trl_ppo": figures, "command": command}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    if trl_ppo_missing():
        TRL_PPO.rerun_here("bench.peer_trl_ppo", sys.argv[1:])
    main()
