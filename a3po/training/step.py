"""The RL training step.

One step reads top to bottom: rollout (already produced, maybe stale) -> rewards (grader or
reward model) -> reference KL -> critic values -> advantages -> proximal log-probs -> rollout
correction (``rl.rollout_correction``; none by default) -> minibatch updates of the decoupled
PPO loss (and the critic's value loss) -> metrics. The PPO
parts (:mod:`a3po.training.ppo_parts`) act only when configured; without them the step is GRPO's. The variants
differ only in the proximal method and the staleness bound, both resolved once in the run's plan
(:class:`a3po.config.plan.RunPlan`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from a3po.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, groups_with_signal
from a3po.algorithms.checks import NonFiniteError
from a3po.algorithms.losses import decoupled_ppo_loss
from a3po.algorithms.minibatches import MINIBATCH_SPLITS
from a3po.algorithms.proximal import PROXIMAL_METHODS, ProximalMethod, ProxInputs
from a3po.algorithms.rollout_correction import ROLLOUT_CORRECTIONS
from a3po.algorithms.stability import TokenStats, stability_metrics
from a3po.algorithms.step_size import STEP_SIZE_RULES, ess_of_parts, ess_parts, sequence_log_weights
from a3po.algorithms.value import between_prompt_share, explained_variance, token_rewards
from a3po.config import RLConfig, correction_settings
from a3po.devices import synchronize
from a3po.models.logprobs import prefix_repeats, token_logprobs
from a3po.models.lora import is_lora
from a3po.parallel.ranks import Ranks
from a3po.parallel.updaters import LocalUpdater, Updater
from a3po.producer.producer import ScoredBatch
from a3po.rollout.logprob_mismatch import behaviour_mismatch
from a3po.training.guard import ApproximationGuard
from a3po.training.lr_schedule import learning_rate
from a3po.training.ppo_parts import PPOParts


def minibatch_seed(seed: int, version: int) -> int:
    """The seed of step ``version``'s minibatch orders (the policy's and the critic's passes):
    drawn on the CPU from the run's seed and the step, so every rank and a resumed run draw the same."""
    return seed * 100_003 + version


@dataclass
class ScoredTokens:
    """A batch scored for the update: per-token advantages ``(N, L)``, the critic's values and
    returns (None without a critic), each row's prompt group ``(N,)``, and the ppo/* figures."""

    advantages: torch.Tensor
    values: torch.Tensor | None
    returns: torch.Tensor | None
    group_ids: torch.Tensor
    metrics: dict[str, float]


@dataclass
class BehaviourCorrection:
    """What the loss divides by and multiplies with: the behaviour log-probs ``(N, L)`` (the
    engine's, or with a rollout correction the trainer's of the same versions), the correction's
    weights ``(N, L)`` (None: none), and the correction/* figures."""

    behav_logp: torch.Tensor
    weights: torch.Tensor | None
    metrics: dict[str, float]


@dataclass
class MinibatchResult:
    """One minibatch's update: its metrics, its tokens' statistics, the entropy summed over its
    response tokens (and their count), and the seconds the proximal method took."""

    metrics: dict[str, float]
    tokens: TokenStats
    entropy_sum: float
    entropy_n: int
    prox_time_s: float


def score_batch(scored: ScoredBatch, cfg: RLConfig, ppo: PPOParts) -> ScoredTokens:
    """Rewards -> KL penalty against the reference -> critic values -> per-token advantages
    ``(N, L)``. GRPO: grader scores, no KL, no values, one advantage per sequence broadcast.
    With OPPO's intra-step overlap the producer already scored them while decoding (``scored.streamed``)."""
    batch, streamed = scored.rollout, scored.streamed
    resp = batch.response_mask
    scores, ppo_metrics = ppo.scores(batch, scored.rewards, streamed.get("scores"))
    kl, kl_metrics = ppo.kl(batch, streamed.get("ref_logp"))
    estimator = ADVANTAGE_ESTIMATORS.get(cfg.advantage)
    values = ppo.values(batch, streamed.get("values")) if estimator.needs_values else None
    group_ids = torch.tensor([m["group"] for m in batch.meta], device=batch.input_ids.device)
    est = estimator(AdvantageInputs(token_rewards(scores, resp, kl, ppo.cfg.kl_coef), resp, group_ids, values,
                                    ppo.cfg.gamma, ppo.cfg.lam))
    ppo_metrics.update(kl_metrics)
    if values is not None:
        ppo_metrics.update(_value_metrics(values, est.returns, resp))
        # what knowing each prompt's rate explains
        ppo_metrics["ppo/ev_prompt_ceiling"] = between_prompt_share(scores, group_ids)
    return ScoredTokens(est.advantages, values, est.returns, group_ids, ppo_metrics)


def proximal_anchor(policy: torch.nn.Module, scored: ScoredBatch, cfg: RLConfig,
                    method: ProximalMethod) -> tuple[torch.Tensor | None, float]:
    """The proximal anchor: log-probs ``(N, L)`` of the weights before this update, and the
    seconds they took. Only methods that need it pay for the extra forward pass (recompute,
    metrics); loglinear never runs the model here (None)."""
    batch = scored.rollout
    device = batch.input_ids.device
    synchronize(device)
    t0 = time.perf_counter()
    exact_prox = None
    if method.needs_forward:
        with torch.no_grad():
            exact_prox = token_logprobs(policy, batch.input_ids, batch.attention_mask, cfg.temperature,
                                        start=batch.prompt_len,
                                        share_prompt=cfg.shared_prompt_forward)
        synchronize(device)  # time the forward, not its launch (no-op on CPU)
    return exact_prox, time.perf_counter() - t0


def rollout_correction(
    policy: torch.nn.Module,
    scored: ScoredBatch,
    cfg: RLConfig,
    staleness: torch.Tensor,
    exact_prox: torch.Tensor | None,
    source: str | None = None,
) -> BehaviourCorrection:
    """The engine-vs-trainer mismatch of the behaviour log-probs, corrected by ``rl.rollout_correction``
    (``a3po.algorithms.rollout_correction``): ``log rho_t = log pi_trainer(v) - log pi_engine(v)`` per
    generated token, the method's weights ``c_t``, and the trainer's log-probs for the loss's ``w``.

    The trainer's log-probs of the behaviour versions come from ``source``, where the run's plan
    found them cheapest exactly (:attr:`a3po.config.plan.RunPlan.trainer_logp`): ``'trainer'``, every
    token on-policy (sync), the weights before this update, so the proximal forward when the method
    ran one (recompute) and one no-grad forward here otherwise; ``'producer'``, asynchronously, the
    producer's re-scoring of each version (``scored.streamed['trainer_behav_logp']``). None: no
    correction, nothing is computed (``none``)."""
    batch = scored.rollout
    if source is None:
        name = cfg.rollout_correction
        if ROLLOUT_CORRECTIONS.get(name).needs_trainer_logp:  # the caller did not pass the plan's source
            raise ValueError(f"rl.rollout_correction {name!r} needs the trainer's log-probs: pass the run plan's "
                             "trainer_logp (a3po.config.plan.RunPlan) as the source")
        return BehaviourCorrection(batch.behav_logp, None, {})
    resp, device = batch.response_mask, batch.input_ids.device
    synchronize(device)
    t0 = time.perf_counter()
    if source == "trainer":
        if bool((staleness[resp] != 0).any()):  # the weights before this update are not every token's behaviour version
            raise RuntimeError("rollout correction from the trainer's forward needs every "
                               "token on-policy (staleness 0)")
        trainer_logp = exact_prox
        if trainer_logp is None:
            with torch.no_grad():
                trainer_logp = token_logprobs(policy, batch.input_ids, batch.attention_mask, cfg.temperature,
                                              start=batch.prompt_len,
                                              share_prompt=cfg.shared_prompt_forward)
            synchronize(device)
    else:
        trainer_logp = scored.streamed.get("trainer_behav_logp")
        if trainer_logp is None:
            raise RuntimeError(f"batch {scored.index} has no trainer log-probs of its behaviour "
                               "versions: the producer must re-score it "
                               "(a3po.rollout.logprob_mismatch.BehaviourCheck with keep_logp)")
    log_ratio = torch.where(resp, trainer_logp - batch.behav_logp, torch.zeros_like(batch.behav_logp))
    corr = ROLLOUT_CORRECTIONS.get(cfg.rollout_correction)(log_ratio, resp, correction_settings(cfg))
    metrics = {**corr.metrics, "correction/time_s": time.perf_counter() - t0}
    if source == "trainer":  # the producer reports these itself when it re-scores
        metrics.update(behaviour_mismatch(batch.behav_logp, trainer_logp, resp))
    return BehaviourCorrection(torch.where(resp, trainer_logp, batch.behav_logp), corr.weights, metrics)


def scaled_step(updater: Updater, prox: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor, cfg: RLConfig,
                base_lr: float | None, ranks: Ranks) -> dict[str, float]:
    """Set this optimizer step's rate by ``rl.step_size`` (``a3po.algorithms.step_size``) from the
    minibatch's behaviour weights ``pi_prox / pi_behav`` (this rank's rows; the ESS is the whole
    minibatch's, every rank's sums combined); its figures, none for a rule that reads no weights."""
    rule = STEP_SIZE_RULES.get(cfg.step_size)
    if not rule.needs_weights:
        return {}
    if base_lr is None:
        raise ValueError(f"rl.step_size {cfg.step_size!r} scales the step's learning rate: pass it (base_lr)")
    parts = ranks.gather_rows(ess_parts(sequence_log_weights(prox, behav_logp, mask))[None])
    ess, ratio = ess_of_parts(parts)
    scale = rule.scale(ratio)
    updater.set_lr(base_lr * scale)
    return {"step_size/ess": ess, "step_size/ess_ratio": ratio, "step_size/lr_scale": scale}


def update_minibatch(
    policy: torch.nn.Module,
    updater: Updater,
    scored: ScoredBatch,
    mb: torch.Tensor,
    tokens: ScoredTokens,
    staleness: torch.Tensor,
    exact_prox: torch.Tensor | None,
    cfg: RLConfig,
    method: ProximalMethod,
    ranks: Ranks,
    ppo: PPOParts,
    behav: BehaviourCorrection | None = None,
    base_lr: float | None = None,
) -> MinibatchResult:
    """One optimizer step of the decoupled PPO loss on the minibatch ``mb`` (row indices), this
    rank training on its shard; the critic learns the returns on the same rows. The metrics are
    those of the whole minibatch on every rank. ``behav``: the rollout correction (None: none);
    ``base_lr``: the schedule's rate of this step, which ``rl.step_size`` scales."""
    batch, adv = scored.rollout, tokens.advantages
    behav = behav if behav is not None else BehaviourCorrection(batch.behav_logp, None, {})
    weights = behav.weights
    ids, attn, resp, device = batch.input_ids, batch.attention_mask, batch.response_mask, batch.input_ids.device
    rows = ranks.shard(mb)  # this rank's rows of the minibatch (all of them in one process)
    share = cfg.shared_prompt_forward
    if share and updater.partitioned and ranks.world_size > 1:
        # Under ZeRO-3 each forward is a collective (the ranks gather the parameters together), so every rank
        # must run as many: sharing runs two where a prompt of the shard repeats, one where none does.
        repeats = torch.tensor(int(prefix_repeats(ids[rows], attn[rows], batch.prompt_len)), device=device)
        share = int(ranks.sum(repeats)) == ranks.world_size
    logp, ent = token_logprobs(policy, ids[rows], attn[rows], cfg.temperature, return_entropy=True,
                               start=batch.prompt_len,
                               share_prompt=share)
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
    prox_time = time.perf_counter() - t0
    # Token mean over the whole minibatch, whatever the number of ranks sharing it.
    minibatch_tokens = ranks.sum(resp[rows].sum())
    loss, loss_metrics, token_stats = decoupled_ppo_loss(
        logp, prox, behav.behav_logp[rows], adv[rows], resp[rows], cfg.eps_clip, cfg.eps_clip_high,
        cfg.behav_weight_cap,
        n_tokens=minibatch_tokens, return_tokens=True, correction=None if weights is None else weights[rows],
    )
    step_size = scaled_step(updater, prox, behav.behav_logp[rows], resp[rows], cfg, base_lr, ranks)
    grad_norm = updater.update(loss)
    if step_size:
        updater.set_lr(base_lr)  # the next minibatch scales the schedule's rate, not this one's
    if ranks.world_size > 1:
        # Metrics of the whole minibatch as one process computes them (a p99 does not reduce).
        logp, ent = ranks.gather_rows(logp.detach()), ranks.gather_rows(ent)
        prox, prox_metrics = method(
            ProxInputs(batch.behav_logp[mb], logp, staleness[mb], resp[mb], recompute_logp=lambda mb=mb: exact_prox[mb])
        )
        _, loss_metrics, token_stats = decoupled_ppo_loss(
            logp, prox, behav.behav_logp[mb], adv[mb], resp[mb], cfg.eps_clip, cfg.eps_clip_high, cfg.behav_weight_cap,
            return_tokens=True, correction=None if weights is None else weights[mb],
        )
    metrics = {**loss_metrics, **prox_metrics, **step_size, "policy/grad_norm": grad_norm}
    if tokens.returns is not None:  # the critic learns the returns on the same minibatch
        metrics.update(ppo.update_critic(batch, rows, tokens.values, tokens.returns, cfg.grad_clip))
    return MinibatchResult(metrics, token_stats, ent[resp[mb]].sum().item(), int(resp[mb].sum()), prox_time)


def step_metrics(
    scored: ScoredBatch, minibatches: list[MinibatchResult], staleness: torch.Tensor, prox_time_s: float,
    step_time_s: float,
    ppo_metrics: dict[str, float],
) -> dict[str, float]:
    """The step's metrics: the minibatches' combined (stability over all the step's tokens), plus
    rollout-level figures."""
    batch, rewards = scored.rollout, scored.rewards
    resp = batch.response_mask
    metrics = combine_minibatch_metrics([m.metrics for m in minibatches], [m.tokens for m in minibatches])
    st_mean, st_max = _masked_stats(staleness, resp)
    response_tokens = int(resp.sum())  # generated tokens in the whole batch
    metrics.update(
        {
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std(unbiased=False).item(),
            # groups whose graded rewards are all equal: no signal under a group-relative estimator (rl.filter_groups)
            "reward/groups_all_equal": float(sum(not s for s in groups_with_signal(
                rewards, torch.tensor([m["group"] for m in batch.meta], device=rewards.device)).values())),
            "policy/entropy": sum(m.entropy_sum for m in minibatches) / max(sum(m.entropy_n for m in minibatches), 1),
            "staleness/mean": st_mean,
            "staleness/max": st_max,
            **staleness_counts(staleness, resp),
            "prox/time_s": prox_time_s,
            "perf/step_time_s": step_time_s,
            "perf/gen_time_s": scored.gen_time_s,
            "perf/tokens_per_s": response_tokens / step_time_s,
            "response/length_mean": response_tokens / len(batch),
            "response/truncated_frac": 1.0 - batch.finished.float().mean().item(),
            **{f"grader/{k}": float(v) for k, v in scored.grader.items()},
            **ppo_metrics,
        }
    )
    return metrics


def train_step(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Updater,
    scored: ScoredBatch,
    version: int,
    cfg: RLConfig,
    method: ProximalMethod,
    ranks: Ranks | None = None,
    ppo: PPOParts | None = None,
    trainer_logp: str | None = None,
    guard: ApproximationGuard | None = None,
) -> dict[str, float]:
    """One policy update on one (possibly stale) batch; returns the step's metrics.

    ``optimizer`` is a torch optimizer (one process) or an :class:`a3po.parallel.updaters.Updater`;
    under data parallelism every rank holds the whole batch and trains on its shard of each
    minibatch, and the metrics are those of the whole minibatch on every rank (``ranks``: one
    process when None). ``ppo`` holds the reward model, reference and critic when the config uses
    them (see :mod:`a3po.training.ppo_parts`; None: GRPO's path). ``trainer_logp``: where
    ``rl.rollout_correction`` reads the trainer's behaviour log-probs (the run plan's
    :attr:`~a3po.config.plan.RunPlan.trainer_logp`; None: no correction). ``guard``: the run's check
    of an approximate anchor (``rl.guard_every``, :mod:`a3po.training.guard`; None: none)."""
    ranks = ranks if ranks is not None else Ranks()
    ppo = ppo if ppo is not None else PPOParts()
    updater = optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        updater = LocalUpdater(policy, optimizer, cfg.grad_clip)
    t_start = time.perf_counter()
    batch = scored.rollout
    # 1. Rewards, KL, values -> per-token advantages.
    tokens = score_batch(scored, cfg, ppo)
    # 2. Staleness of every generated token: trainer version minus the version that sampled it.
    staleness = torch.where(batch.response_mask, version - batch.versions, torch.full_like(batch.versions, -1))
    # 3. Proximal anchor = the weights before this update.
    exact_prox, prox_time = proximal_anchor(policy, scored, cfg, method)
    # 3b. Rollout correction: the trainer's log-probs of the behaviour versions against the engine's.
    behav = rollout_correction(policy, scored, cfg, staleness, exact_prox, trainer_logp)
    tokens.metrics.update(behav.metrics)
    # 4. Minibatch updates of the decoupled PPO loss. The order is drawn on the CPU and moved:
    #    the same minibatches on every device.
    split = MINIBATCH_SPLITS.get(cfg.minibatch_split)
    gen = torch.Generator().manual_seed(minibatch_seed(cfg.seed, version))
    perm = split(tokens.group_ids, gen).to(batch.input_ids.device)
    # 4a. The guard (rl.guard_every): the run's anchor against the exact one on the first minibatch's
    #     rows; where it fires, its policy may have this step train on the exact anchor instead.
    if guard is not None and guard.due(version):
        verdict = guard.check(policy, scored, perm.chunk(cfg.minibatches)[0], staleness, method, cfg, ranks, version)
        tokens.metrics.update(verdict.metrics)
        if verdict.policy is not None and verdict.policy.anchor is not None:
            method = PROXIMAL_METHODS.get(verdict.policy.anchor)
            exact_prox, anchor_time = proximal_anchor(policy, scored, cfg, method)
            prox_time += anchor_time
    policy.train()
    try:
        done = [update_minibatch(policy, updater, scored, mb, tokens, staleness, exact_prox, cfg, method, ranks,
                                 ppo, behav, base_lr=learning_rate(cfg, version))
                for mb in perm.chunk(cfg.minibatches)]
        if tokens.returns is not None:  # the critic's further passes over the batch (ppo.critic_epochs)
            tokens.metrics.update(ppo.further_critic_epochs(batch, tokens.values, tokens.returns, cfg.minibatches,
                                                            ranks.shard,
                                                            minibatch_seed(cfg.seed, version), cfg.grad_clip))
    except NonFiniteError as e:  # say which step, and the settings that scale an update
        likely = "model.lora.alpha (adapters scale by alpha / r), rl.lr" if is_lora(policy) else "rl.lr, ppo.vf_coef"
        raise NonFiniteError(f"step {version + 1}: non-finite training, {e}; the run stops, its checkpoints "
                             f"hold the steps before (likely too large: {likely})") from None
    finally:
        policy.eval()
    # 5. Metrics.
    for m in done:
        prox_time += m.prox_time_s
    return step_metrics(scored, done, staleness, prox_time, time.perf_counter() - t_start, tokens.metrics)


def combine_minibatch_metrics(per_minibatch: list[dict[str, float]], tokens: list[TokenStats]) -> dict[str, float]:
    """A step's metrics from its minibatches': the stability statistics (``a3po.algorithms.stability``) over
    all the step's tokens together (a quantile of the step, not a mean of minibatch quantiles);
    every other metric the mean over minibatches (the maximum for ``*_max``)."""
    metrics = {k: (max if k.endswith("_max") else (lambda v: sum(v) / len(v)))([m[k] for m in per_minibatch])
               for k in per_minibatch[0]}
    metrics.update(stability_metrics(TokenStats.cat(tokens)))
    return metrics


def staleness_counts(staleness: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """``staleness/tokens_<d>``: how many of the step's generated tokens were ``d`` versions behind
    the trainer, for each ``d`` from 0 to the step's largest (a count vector the histogram of a run
    sums over steps; bounded by ``rl.max_staleness``)."""
    counts = torch.bincount(staleness[mask.bool()].long().clamp(min=0).flatten().cpu())
    return {f"staleness/tokens_{d}": float(n) for d, n in enumerate(counts.tolist())}


def _masked_stats(x: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    v = x[mask.bool()].float()
    return (v.mean().item(), v.max().item()) if v.numel() else (0.0, 0.0)


def _value_metrics(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The critic's figures when the batch is scored (before this step's value updates)."""
    m = mask.bool()
    return {
        "ppo/value_mean": values[m].mean().item() if m.any() else 0.0,
        "ppo/return_mean": returns[m].mean().item() if m.any() else 0.0,
        "ppo/explained_variance": explained_variance(values, returns, mask),
    }
