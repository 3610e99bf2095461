"""The RL training step and loop.

One step reads top to bottom: rollout (already produced, maybe stale) -> rewards (grader or
reward model) -> reference KL -> critic values -> advantages -> proximal log-probs ->
minibatch updates of the decoupled PPO loss (and the critic's value loss) -> metrics. The PPO
parts (:mod:`a3po.training.ppo_parts`) act only when configured; without them the step is GRPO's. The variants
differ only in the proximal method and the staleness bound, both resolved before the loop.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from a3po.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs
from a3po.algorithms.losses import decoupled_ppo_loss
from a3po.algorithms.minibatches import MINIBATCH_SPLITS
from a3po.algorithms.proximal import PROXIMAL_METHODS, ProximalMethod, ProxInputs
from a3po.algorithms.stability import TokenStats, stability_metrics
from a3po.config import RLConfig, TrainConfig, config_differences, config_to_dict, effective_max_staleness, proximal_method_name
from a3po.devices import synchronize
from a3po.grading.rewards import check_grader, score_completions
from a3po.models.logprobs import token_logprobs
from a3po.parallel.ranks import Ranks, init_ranks
from a3po.parallel.updaters import LocalUpdater, Updater, make_updater, plain_model
from a3po.placement.in_process import RolloutInputs, weight_retention
from a3po.placement.registry import ROLLOUT_PLACEMENTS, placement_name
from a3po.producer.producer import ScoredBatch
from a3po.producer.weight_store import Retention, WeightStore, clone_state
from a3po.storage.checkpoint import CheckpointError, load_latest_checkpoint, save_checkpoint
from a3po.training.heldout import evaluate_heldout
from a3po.training.metrics import MetricLogger, NullLogger, rewind_logger
from a3po.training.ppo_parts import PPOParts, between_prompt_share, build_ppo_parts, explained_variance, token_rewards
from a3po.training.threads import intra_op_threads, update_threads


def _masked_stats(x: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    v = x[mask.bool()].float()
    return (v.mean().item(), v.max().item()) if v.numel() else (0.0, 0.0)


def combine_minibatch_metrics(per_minibatch: list[dict[str, float]], tokens: list[TokenStats]) -> dict[str, float]:
    """A step's metrics from its minibatches': the stability statistics (``a3po.algorithms.stability``) over
    all the step's tokens together (a quantile of the step, not a mean of minibatch quantiles);
    every other metric the mean over minibatches (the maximum for ``*_max``)."""
    metrics = {k: (max if k.endswith("_max") else (lambda v: sum(v) / len(v)))([m[k] for m in per_minibatch]) for k in per_minibatch[0]}
    metrics.update(stability_metrics(TokenStats.cat(tokens)))
    return metrics


def train_step(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Updater,
    scored: ScoredBatch,
    version: int,
    cfg: RLConfig,
    method: ProximalMethod,
    ranks: Ranks = Ranks(),
    ppo: PPOParts = PPOParts(),
) -> dict[str, float]:
    """One policy update on one (possibly stale) batch; returns the step's metrics.

    ``optimizer`` is a torch optimizer (one process) or an :class:`a3po.parallel.updaters.Updater`;
    under data parallelism every rank holds the whole batch and trains on its shard of each
    minibatch, and the metrics are those of the whole minibatch on every rank. ``ppo`` holds the
    reward model, reference and critic when the config uses them (see :mod:`a3po.training.ppo_parts`)."""
    updater = LocalUpdater(policy, optimizer, cfg.grad_clip) if isinstance(optimizer, torch.optim.Optimizer) else optimizer
    t_start = time.perf_counter()
    batch, rewards = scored.rollout, scored.rewards
    ids, attn, resp = batch.input_ids, batch.attention_mask, batch.response_mask
    n, device = len(batch), ids.device

    # 1. Rewards -> KL penalty against the reference -> critic values -> per-token advantages
    #    (N, L). GRPO: grader scores, no KL, no values, one advantage per sequence broadcast.
    #    With OPPO's intra-step overlap the producer already scored them while decoding (scored.streamed).
    streamed = scored.streamed
    scores, ppo_metrics = ppo.scores(batch, rewards, streamed.get("scores"))
    kl, kl_metrics = ppo.kl(batch, streamed.get("ref_logp"))
    estimator = ADVANTAGE_ESTIMATORS.get(cfg.advantage)
    values = ppo.values(batch, streamed.get("values")) if estimator.needs_values else None
    group_ids = torch.tensor([m["group"] for m in batch.meta], device=device)
    est = estimator(AdvantageInputs(token_rewards(scores, resp, kl, ppo.cfg.kl_coef), resp, group_ids, values, ppo.cfg.gamma, ppo.cfg.lam))
    adv = est.advantages
    ppo_metrics.update(kl_metrics)
    if values is not None:
        ppo_metrics.update(_value_metrics(values, est.returns, resp))
        ppo_metrics["ppo/ev_prompt_ceiling"] = between_prompt_share(scores, group_ids)  # what knowing each prompt's rate explains

    # 2. Staleness of every generated token: trainer version minus the version that sampled it.
    staleness = torch.where(resp, version - batch.versions, torch.full_like(batch.versions, -1))

    # 3. Proximal anchor = the weights before this update. Only methods that need it pay for
    #    the extra forward pass (recompute, metrics); loglinear never runs the model here.
    synchronize(device)
    t0 = time.perf_counter()
    exact_prox = None
    if method.needs_forward:
        with torch.no_grad():
            exact_prox = token_logprobs(policy, ids, attn, cfg.temperature, start=batch.prompt_len,
                                        share_prompt=cfg.shared_prompt_forward)
        synchronize(device)  # time the forward, not its launch (no-op on CPU)
    prox_time = time.perf_counter() - t0

    # 4. Minibatch updates of the decoupled PPO loss. The order is drawn on the CPU and moved:
    #    the same minibatches on every device.
    split = MINIBATCH_SPLITS.get(cfg.minibatch_split)
    perm = split(group_ids, torch.Generator().manual_seed(cfg.seed * 100_003 + version)).to(device)
    policy.train()
    step_metrics: list[dict[str, float]] = []
    step_tokens: list[TokenStats] = []
    entropy_sum, entropy_n = 0.0, 0
    for mb in perm.chunk(cfg.minibatches):
        rows = ranks.shard(mb)  # this rank's rows of the minibatch (all of them in one process)
        logp, ent = token_logprobs(policy, ids[rows], attn[rows], cfg.temperature, return_entropy=True, start=batch.prompt_len,
                                   share_prompt=cfg.shared_prompt_forward)
        synchronize(device)  # the proximal timer must not include this forward (no-op on CPU)
        t0 = time.perf_counter()
        prox, prox_metrics = method(
            ProxInputs(
                behav_logp=batch.behav_logp[rows],
                theta_logp=logp.detach(),
                staleness=staleness[rows],
                mask=resp[rows],
                recompute_logp=lambda rows=rows: exact_prox[rows],
            )
        )
        synchronize(device)
        prox_time += time.perf_counter() - t0
        # Token mean over the whole minibatch, whatever the number of ranks sharing it.
        n_tokens = ranks.sum(resp[rows].sum())
        loss, loss_metrics, tokens = decoupled_ppo_loss(
            logp, prox, batch.behav_logp[rows], adv[rows], resp[rows], cfg.eps_clip, cfg.eps_clip_high, cfg.behav_weight_cap,
            n_tokens=n_tokens, return_tokens=True,
        )
        grad_norm = updater.update(loss)
        if ranks.world_size > 1:
            # Metrics of the whole minibatch as one process computes them (a p99 does not reduce).
            logp, ent = ranks.gather_rows(logp.detach()), ranks.gather_rows(ent)
            prox, prox_metrics = method(
                ProxInputs(batch.behav_logp[mb], logp, staleness[mb], resp[mb], recompute_logp=lambda mb=mb: exact_prox[mb])
            )
            _, loss_metrics, tokens = decoupled_ppo_loss(
                logp, prox, batch.behav_logp[mb], adv[mb], resp[mb], cfg.eps_clip, cfg.eps_clip_high, cfg.behav_weight_cap,
                return_tokens=True,
            )
        step_metrics.append({**loss_metrics, **prox_metrics, "policy/grad_norm": grad_norm})
        step_tokens.append(tokens)
        if est.returns is not None:  # the critic learns the returns on the same minibatch
            step_metrics[-1].update(ppo.update_critic(batch, rows, values, est.returns, cfg.grad_clip))
        entropy_sum += ent[resp[mb]].sum().item()
        entropy_n += int(resp[mb].sum())
    policy.eval()
    if est.returns is not None:  # the critic's further passes over the batch (ppo.critic_epochs)
        ppo_metrics.update(ppo.further_critic_epochs(batch, values, est.returns, cfg.minibatches, ranks.shard, cfg.seed * 100_003 + version, cfg.grad_clip))

    # 5. Metrics: the minibatches' combined (stability over all the step's tokens), plus rollout-level figures.
    step_time = time.perf_counter() - t_start
    metrics = combine_minibatch_metrics(step_metrics, step_tokens)
    st_mean, st_max = _masked_stats(staleness, resp)
    n_tokens = int(resp.sum())
    metrics.update(
        {
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std(unbiased=False).item(),
            "policy/entropy": entropy_sum / max(entropy_n, 1),
            "staleness/mean": st_mean,
            "staleness/max": st_max,
            "prox/time_s": prox_time,
            "perf/step_time_s": step_time,
            "perf/gen_time_s": scored.gen_time_s,
            "perf/tokens_per_s": n_tokens / step_time,
            "response/length_mean": n_tokens / n,
            "response/truncated_frac": 1.0 - batch.finished.float().mean().item(),
            **{f"grader/{k}": float(v) for k, v in scored.grader.items()},
            **ppo_metrics,
        }
    )
    return metrics


def _latency_breakdown(generate_s: float, train_s: float, idle_s: float) -> dict[str, float]:
    """Where a step's time went, seen from the trainer: ``idle`` is the wait for the batch.
    Busy fractions are over the trainer's step period (wait + train); the generator's can
    exceed 1 when it decodes while the trainer trains (the overlap)."""
    period = max(train_s + idle_s, 1e-9)
    return {"perf/generate_s": generate_s, "perf/train_s": train_s, "perf/idle_s": idle_s,
            "perf/trainer_busy_frac": train_s / period, "perf/generator_busy_frac": generate_s / period}


def _value_metrics(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The critic's figures when the batch is scored (before this step's value updates)."""
    m = mask.bool()
    return {
        "ppo/value_mean": values[m].mean().item() if m.any() else 0.0,
        "ppo/return_mean": returns[m].mean().item() if m.any() else 0.0,
        "ppo/explained_variance": explained_variance(values, returns, mask),
    }


def _start_intra(cfg: TrainConfig, ppo: PPOParts, tokenizer, state: dict | None, start: int, retention: Retention):
    """The scorer threads of OPPO's intra-step overlap, with the critic versions the producer
    will ask for: the checkpoint's history on resume, the current critic as version ``start``."""
    from a3po.oppo.intra import IntraScoring

    intra = IntraScoring(ppo, cfg.oppo, tokenizer.pad_token_id, retention)
    for v, w in sorted((state or {}).get("intra_critic_history", {}).items()):
        intra.critic_store.publish(int(v), w)
    if (state or {}).get("intra_state") is not None:  # the chunk tuner continues its schedule
        intra.load_state_dict(state["intra_state"])
    if intra.critic_store is not None and intra.critic_store.latest < start:
        intra.publish_critic(start, ppo.critic)
    return intra


def save_rank_checkpoint(
    ckpt_dir: str, step: int, policy: torch.nn.Module, updater: Updater, ranks: Ranks, extra: dict, keep: int
) -> str | None:
    """Every rank calls this (the optimizer state is a collective under DeepSpeed); rank 0 alone
    writes the step's checkpoint folder (a3po.storage.checkpoint): the policy (ZeRO-1/2 keep full weights on every rank, ZeRO-3's
    partitions are gathered), every rank's optimizer partition, and ``extra``. Returns the file on
    rank 0, None elsewhere."""
    optimizer_state = updater.optimizer_state()
    with updater.full_weights():  # every rank enters: a gather under ZeRO-3
        policy_state = (clone_state(policy) if updater.partitioned else policy.state_dict()) if ranks.is_main else None
    if not ranks.is_main:
        return None
    state = {"step": step, "policy": policy_state, "optimizer": optimizer_state, **extra}
    return str(save_checkpoint(ckpt_dir, step, state, keep=keep))


def learning_rate(rl: RLConfig, step: int) -> float:
    """Linear warm-up over ``rl.lr_warmup_steps`` steps, then constant or cosine decay to
    ``rl.lr_min_ratio * rl.lr`` at ``rl.steps``. Adam's first updates are sign-like (unit size per
    parameter whatever the gradient's noise); ramping the rate keeps them from knocking a
    warm-started policy off what it has learned. A function of the step, so resume needs no state."""
    warm = min(1.0, (step + 1) / max(1, rl.lr_warmup_steps))
    if rl.lr_schedule == "constant" or step < rl.lr_warmup_steps:
        return rl.lr * warm
    progress = min(1.0, (step - rl.lr_warmup_steps) / max(1, rl.steps - rl.lr_warmup_steps))
    return rl.lr * (rl.lr_min_ratio + (1 - rl.lr_min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class TrainResult:
    variant: str
    seed: int
    warmstart_acc: float
    final_acc: float
    steps: int
    wall_s: float
    history: list[dict[str, float]] = field(default_factory=list)  # per-step metrics
    eval_curve: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out acc)
    checkpoint: str | None = None
    # The final weights when the policy module is ZeRO-3 partitioned (export these, not the module).
    final_weights: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    resumed_from: int | None = None
    checkpoints_skipped: list[str] = field(default_factory=list)  # damaged ones passed over at resume, and why

    def summary(self) -> dict:
        return {
            "variant": self.variant,
            "seed": self.seed,
            "warmstart_acc": round(self.warmstart_acc, 4),
            "final_acc": round(self.final_acc, 4),
            "steps": self.steps,
            "wall_s": round(self.wall_s, 2),
            "resumed_from": self.resumed_from,
        }


def rl_train(
    cfg: TrainConfig,
    policy: torch.nn.Module,
    tokenizer,
    train_rows: list[dict],
    heldout_rows: list[dict],
    ckpt_dir: str | None = None,
    logger: MetricLogger | None = None,
    warmstart_acc: float | None = None,
    progress: Callable[[int, dict[str, float]], None] | None = None,
) -> TrainResult:
    """RL-train ``policy`` in place; resumes from the newest intact checkpoint in ``ckpt_dir``
    (raises :class:`~a3po.storage.checkpoint.NoIntactCheckpoint` when there are checkpoints but none is
    intact) and rewinds ``logger`` to the checkpoint's step.

    Under a launcher with ``distributed.deepspeed_config`` set, every rank calls this; rank 0
    alone evaluates (the figures are broadcast), logs, reports progress and writes checkpoints.
    With ``distributed.rollout_workers``, on a worker's rank this generates batches for the
    trainer until the run ends (:mod:`a3po.placement.rollout_workers`) and returns a result without history."""
    rl = cfg.rl
    t_run = time.perf_counter()
    ranks = init_ranks(cfg.distributed.deepspeed_config, cfg.distributed.rollout_workers)
    logger = (logger or NullLogger()) if ranks.is_main else NullLogger()
    progress = progress if ranks.is_main else None
    s = effective_max_staleness(rl)
    method = PROXIMAL_METHODS.get(proximal_method_name(rl))
    store = WeightStore(weight_retention(cfg))  # a version while a batch not yet trained can read it
    history: list[dict[str, float]] = []
    eval_curve: list[tuple[int, float]] = []
    start, train_wall, resumed_from = 0, 0.0, None
    check_grader(cfg.data.task)  # a grader that cannot start fails the run now, not as zero rewards
    rollout_inputs = RolloutInputs(
        cfg, policy, tokenizer, train_rows,
        score=lambda comps, meta: score_completions(cfg.data.task, comps, [m["gold"] for m in meta], [m["id"] for m in meta]),
    )
    if ranks.is_rollout_worker:
        from a3po.placement.rollout_workers import serve_rollouts

        serve_rollouts(rollout_inputs, ranks)
        nan = float("nan")
        return TrainResult(rl.variant.value, rl.seed, nan, nan, rl.steps, time.perf_counter() - t_run)

    # The reference is the policy as it is now (the warm start), so build before a checkpoint loads.
    ppo = build_ppo_parts(cfg.ppo, policy, rl.temperature)

    skipped: list[str] = []
    found = load_latest_checkpoint(ckpt_dir, on_skip=skipped.append) if ckpt_dir else None
    ckpt, state = found if found is not None else (None, None)
    if state is not None:
        changed = config_differences(state["config"], config_to_dict(cfg))
        if changed:  # resuming would splice two different runs into one history
            raise CheckpointError(
                f"{ckpt} was saved by a run with a different config ({', '.join(changed)} differ); "
                f"resume it with the same config, or use another output dir (or delete {ckpt_dir} to start over)"
            )
        policy.load_state_dict(state["policy"])  # before DeepSpeed copies the weights into its partitions
    updater = make_updater(policy, rl, cfg.distributed.deepspeed_config, ranks)
    if state is not None:
        updater.load_optimizer_state(state["optimizer"])
        ppo.load_state(state)
        for v, w in sorted(state["weights_history"].items()):
            store.publish(v, w)
        start = resumed_from = state["step"]
        history, eval_curve = state["history"], [tuple(p) for p in state["eval_curve"]]  # JSON keeps lists
        train_wall, warmstart_acc = state["train_wall_s"], state["warmstart_acc"]
    rewind_logger(logger, start, history)  # a file logger drops lines of steps after the checkpoint
    if store.latest < start:
        with updater.full_weights():  # the rollout copy reads full weights (gathered under ZeRO-3)
            store.publish(start, clone_state(policy))
    eval_copy: list[torch.nn.Module] = []

    def heldout() -> dict[str, float]:
        """Rank 0 evaluates the newest weights; a ZeRO-3 policy through a plain copy of them (its
        partitioned forward would wait for the other ranks' all-gathers)."""
        if not updater.partitioned:
            return evaluate_heldout(policy, tokenizer, heldout_rows, cfg)
        eval_copy[:] = [plain_model(policy, store.get(store.latest), eval_copy[0] if eval_copy else None)]
        return evaluate_heldout(eval_copy[0], tokenizer, heldout_rows, cfg)

    if warmstart_acc is None:
        ws_eval = ranks.from_main(heldout() if ranks.is_main else None)
        warmstart_acc = ws_eval["eval/heldout_acc"]
        logger.log_metrics(ws_eval, 0)
    if not eval_curve:
        eval_curve = [(0, warmstart_acc)]

    # OPPO intra-step overlap: the producer's scorers read the critic's version of each batch (a3po.oppo.intra).
    intra = _start_intra(cfg, ppo, tokenizer, state, start, store.retention) if cfg.oppo.intra else None
    if intra is not None:
        rollout_inputs = replace(rollout_inputs, intra=intra)
    # Rollouts come from a thread of this process or from rollout-worker processes (a3po.placement.registry).
    producer = ROLLOUT_PLACEMENTS.get(placement_name(cfg.distributed))(rollout_inputs, store, start, ranks)
    if cfg.oppo.inter and state is not None:
        producer.load_state_dict(state["oppo_state"])  # the carry-over buffer as it was before batch `start`
    producer_state = intra_state = None
    train_threads = update_threads(cfg)
    producer.start()
    t_run = time.perf_counter()  # the RL loop (setup and warm-start evaluation aside)
    last_ckpt = str(ckpt) if ckpt else None
    try:
        for step in range(start, rl.steps):
            t0 = time.perf_counter()
            scored = producer.next_batch()
            wait = time.perf_counter() - t0
            if scored.index != step:
                raise RuntimeError(f"producer delivered batch {scored.index} for step {step}")
            updater.set_lr(learning_rate(rl, step))
            with intra_op_threads(train_threads):  # every core where the producer idles meanwhile (sync)
                metrics = train_step(updater.model, updater, scored, step, rl, method, ranks, ppo)
            if intra is not None:  # before the policy's: a batch on version step + 1 finds its critic
                intra.publish_critic(step + 1, ppo.critic)
            with updater.full_weights():
                store.publish(step + 1, clone_state(policy))
            train_wall += wait + metrics["perf/step_time_s"]
            metrics.update({"perf/wait_time_s": wait, "time/train_wall_s": train_wall, "version": float(step + 1)})
            metrics.update(scored.metrics)
            metrics.update(_latency_breakdown(scored.gen_time_s, metrics["perf/step_time_s"], wait))
            producer_state, intra_state = scored.producer_state, scored.stream_state
            if (step + 1) % rl.eval_every == 0 or step + 1 == rl.steps:
                held = ranks.from_main(heldout() if ranks.is_main else None)
                eval_curve.append((step + 1, held["eval/heldout_acc"]))
                metrics.update(held)
            history.append(metrics)
            logger.log_metrics(metrics, step + 1)
            if progress is not None:
                progress(step + 1, metrics)
            if ckpt_dir and ((step + 1) % rl.checkpoint_every == 0 or step + 1 == rl.steps):
                saved = save_rank_checkpoint(
                    ckpt_dir,
                    step + 1,
                    policy,
                    updater,
                    ranks,
                    {
                        # Versions the producer still needs to regenerate the in-flight batches.
                        "weights_history": store.history(since=step + 1 - s),
                        "history": history,
                        "eval_curve": eval_curve,
                        "train_wall_s": train_wall,
                        "warmstart_acc": warmstart_acc,
                        "config": config_to_dict(cfg),
                        **({"oppo_state": producer_state} if cfg.oppo.inter else {}),
                        **({"intra_critic_history": intra.critic_history(since=step + 1 - s),
                            "intra_state": intra_state} if intra is not None else {}),
                        **ppo.state(),
                    },
                    keep=rl.keep_checkpoints,
                )
                last_ckpt = saved or last_ckpt
    finally:
        producer.stop()
        if intra is not None:
            intra.close()
        producer.join(timeout=30)
        producer.close()
    final_acc = eval_curve[-1][1] if eval_curve else warmstart_acc
    return TrainResult(
        variant=rl.variant.value,
        seed=rl.seed,
        warmstart_acc=warmstart_acc,
        final_acc=final_acc,
        steps=rl.steps,
        wall_s=time.perf_counter() - t_run,
        history=history,
        eval_curve=eval_curve,
        checkpoint=last_ckpt,
        resumed_from=resumed_from,
        checkpoints_skipped=skipped,
        final_weights=store.get(store.latest) if updater.partitioned else None,
    )
