"""The RL training loop: resume, then one :func:`a3po.training.step.train_step` per batch the
producer delivers, with the held-out evaluation, the checkpoints and the run's extensions
(:mod:`a3po.training.extensions`: the PPO parts, OPPO's intra-step scoring and carry-over) around it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from a3po.algorithms.proximal import PROXIMAL_METHODS, ProximalMethod
from a3po.config import RunPlan, TrainConfig, config_to_dict, filter_settings
from a3po.devices import model_device, native_bf16, set_autocast
from a3po.grading.rewards import check_grader, score_completions
from a3po.models.lora import load_trained_state, trained_state, with_lora
from a3po.parallel.ranks import Ranks, init_ranks
from a3po.parallel.updaters import Updater, make_updater
from a3po.placement.cores import usable_cores
from a3po.placement.in_process import RolloutInputs, weight_retention
from a3po.placement.registry import ROLLOUT_PLACEMENTS, Producer
from a3po.producer.producer import ScoredBatch
from a3po.producer.weight_store import WeightStore, clone_state
from a3po.storage.checkpoint import save_checkpoint
from a3po.training.actions import ActionLog
from a3po.training.completions import CompletionTables
from a3po.training.evaluations import Evaluated, Evaluations, HeldOut
from a3po.training.extensions import Extension, IntraCritic, ProducerCarryOver
from a3po.training.guard import ApproximationGuard
from a3po.training.inputs import input_hashes
from a3po.training.lr_schedule import learning_rate
from a3po.training.metrics import MetricLogger, NullLogger, rewind_logger
from a3po.training.ppo_parts import PPOParts, build_ppo_parts
from a3po.training.run_state import PendingEvaluation, RunState, resume
from a3po.training.staleness import StalenessBound
from a3po.training.step import train_step
from a3po.training.threads import intra_op_threads


def checked_rollout_inputs(
    cfg: TrainConfig, plan: RunPlan, policy: torch.nn.Module, tokenizer, train_rows: list[dict]
) -> RolloutInputs:
    """What generating and scoring need, in a trainer or a rollout worker's process; a grader that
    cannot start fails the run now, not as zero rewards."""
    check_grader(cfg.data.task)
    return RolloutInputs(
        cfg, plan, policy, tokenizer, train_rows,
        score=lambda comps, meta: score_completions(cfg.data.task, comps,
                                                    [m["gold"] for m in meta], [m["id"] for m in meta]),
    )


class SignalDrained(RuntimeError):
    """The group filter (``rl.filter_groups``) found no group with signal for ``rl.filter_patience`` steps in a row."""


def stop_if_drained(history: list[dict[str, float]], patience: int, step: int) -> None:
    """Raise :class:`SignalDrained` when the last ``patience`` steps of ``history`` trained no group with
    signal (``filter/signal_groups`` 0): the filter would otherwise draw its cap of prompts at every step,
    for an update of zero, until the run ends."""
    tail = history[-patience:]
    if len(tail) < patience or any(m.get("filter/signal_groups", 1.0) > 0 for m in tail):
        return
    last = tail[-1]
    reward = last.get("reward/mean", float("nan"))
    cause = ("every reward 0: a grader that never matches the answers' format, or a task too hard for the model"
             if reward == 0 else "every reward 1: a task too easy for the model" if reward == 1 else
             "each group's rewards equal: a grader that ignores the answer, or samples that do not differ "
             "(rl.temperature)")
    raise SignalDrained(f"step {step}: no group with signal in {patience} steps in a row (rl.filter_patience): "
                        f"filtered fraction {last['filter/filtered_frac']:.2f} of "
                        f"{last['filter/prompts_drawn']:.0f} prompts drawn, reward/mean {reward:.3f}; likely "
                        f"{cause}")


def _latency_breakdown(generate_s: float, train_s: float, idle_s: float) -> dict[str, float]:
    """Where a step's time went, seen from the trainer: ``idle`` is the wait for the batch.
    Busy fractions are over the trainer's step period (wait + train); the generator's can
    exceed 1 when it decodes while the trainer trains (the overlap)."""
    period = max(train_s + idle_s, 1e-9)
    return {"perf/generate_s": generate_s, "perf/train_s": train_s, "perf/idle_s": idle_s,
            "perf/trainer_busy_frac": train_s / period, "perf/generator_busy_frac": generate_s / period}


def save_rank_checkpoint(ckpt_dir: str, run: RunState, policy: torch.nn.Module, updater: Updater, ranks: Ranks,
                         keep: int) -> str | None:
    """Every rank calls this (the optimizer state is a collective under DeepSpeed); rank 0 alone
    writes the step's checkpoint folder (a3po.storage.checkpoint): the policy (ZeRO-1/2 keep full
    weights on every rank, ZeRO-3's partitions are gathered), every rank's optimizer partition, and
    ``run``'s entries. Returns the file on rank 0, None elsewhere."""
    optimizer_state = updater.optimizer_state()
    with updater.full_weights():  # every rank enters: a gather under ZeRO-3
        policy_state = None
        if ranks.is_main:
            policy_state = clone_state(policy) if updater.partitioned else trained_state(policy)
    if not ranks.is_main:
        return None
    state = {"policy": policy_state, "optimizer": optimizer_state, **run.to_checkpoint()}
    return str(save_checkpoint(ckpt_dir, run.step, state, keep=keep))


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

    def record(self) -> dict:
        """What ``result.json`` holds: the summary's fields unrounded (a run reused from its record
        reports what it measured) and the held-out curve."""
        exact = {"warmstart_acc": self.warmstart_acc, "final_acc": self.final_acc, "wall_s": self.wall_s}
        return {**self.summary(), **exact, "eval_curve": self.eval_curve}


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
    completions_dir: str | None = None,
    ranks: Ranks | None = None,
    plan: RunPlan | None = None,
    actions_path: str | None = None,
) -> TrainResult:
    """RL-train ``policy`` in place; resumes from the newest intact checkpoint in ``ckpt_dir``
    (raises :class:`~a3po.storage.checkpoint.NoIntactCheckpoint` when there are checkpoints but none is
    intact) and rewinds ``logger`` to the checkpoint's step. With ``completions_dir`` and
    ``rl.log_completions`` > 0, each held-out evaluation writes a completion table there
    (:mod:`a3po.training.completions`; tables of steps after the checkpoint are removed). With
    ``model.lora`` peft injects adapters into ``policy`` (:func:`a3po.models.lora.with_lora`) and only they train.
    ``rl.eval_mode``: the held-out evaluations run in this thread or beside training, with the same
    record (:mod:`a3po.training.evaluations`; a checkpoint may record its own step's as pending, and
    a run resumed from it evaluates the restored weights first). With ``actions_path``, what the guard
    and the staleness bound in force did, and why, goes there a row each (:mod:`a3po.training.actions`;
    rows of steps after the checkpoint are removed, as the logger is rewound).

    Under a launcher with ``distributed.deepspeed_config`` set, every rank calls this; rank 0
    alone evaluates (the figures are broadcast), logs, reports progress and writes checkpoints.
    With ``distributed.rollout_workers`` this runs on the trainer's rank only; a worker's rank
    serves batches instead (:func:`a3po.training.run.train_variant` dispatches).

    ``ranks`` and ``plan``: this process's place in the launch and the run's plan, as the caller
    resolved them (:func:`~a3po.training.run.train_variant`); a caller without them (a test, a
    benchmark) gets them resolved here, once."""
    rl = cfg.rl
    if ranks is None:
        ranks = init_ranks(cfg.distributed.deepspeed_config, cfg.distributed.rollout_workers)
    if plan is None:
        device = model_device(policy)
        plan = RunPlan.of(cfg, usable_cores(), native_bf16(device), device.type)
    if ranks.is_rollout_worker:
        raise RuntimeError("rl_train runs on trainer ranks; a rollout worker's rank serves batches "
                           "(a3po.placement.worker_loop.serve_rollouts)")
    logger = (logger or NullLogger()) if ranks.is_main else NullLogger()
    progress = progress if ranks.is_main else None
    # dtype auto where bf16 is native: forwards under bf16 autocast; weights and AdamW state stay fp32.
    set_autocast(policy, plan.precision.autocast)
    policy = with_lora(policy, cfg.model.lora)  # model.lora: adapters injected in place; only they train
    rollout_inputs = checked_rollout_inputs(cfg, plan, policy, tokenizer, train_rows)
    # The reference is the policy as it is now (the warm start), so build before a checkpoint loads.
    ppo = build_ppo_parts(cfg.ppo, policy, rl.temperature)
    skipped: list[str] = []
    inputs = input_hashes(cfg)  # the files' content now: a checkpoint of other contents is not resumed
    resumed = resume(ckpt_dir, cfg, inputs, on_skip=skipped.append, precision=plan.precision.name)
    updater, store = _restore(cfg, plan, policy, ppo, resumed, ranks)
    run = resumed or RunState(step=0, warmstart_acc=warmstart_acc, config=config_to_dict(cfg), inputs=inputs,
                              precision=plan.precision.name)
    resumed_from = resumed.step if resumed is not None else None  # run.step moves on with the loop
    rewind_logger(logger, run.step, run.history)  # a file logger drops lines of steps after the checkpoint
    actions = ActionLog(actions_path) if actions_path and ranks.is_main else None
    if actions is not None:
        actions.rewind(run.step)  # the resumed run records them again
    tables = None
    if completions_dir and rl.log_completions and ranks.is_main:
        tables = CompletionTables(completions_dir, rl.log_completions, train_rows, heldout_rows)
        tables.rewind(run.step)  # the resumed run writes them again
    if store.latest < run.step:
        with updater.full_weights():  # the rollout copy reads full weights (gathered under ZeRO-3)
            store.publish(run.step, clone_state(policy))
    heldout = HeldOut(cfg, policy, tokenizer, heldout_rows, updater, store, ranks)
    evaluations = Evaluations(heldout, background=rl.eval_mode == "background")
    if run.warmstart_acc is None:
        ws_eval = heldout()
        run.warmstart_acc = ws_eval["eval/heldout_acc"]
        logger.log_metrics(ws_eval, 0)
        if tables is not None:
            tables.write(0, heldout=heldout.greedy)
    run.eval_curve = run.eval_curve or [(0, run.warmstart_acc)]
    if run.pending_evaluation is not None:  # the checkpoint's own version was still being evaluated beside training
        _record_evaluation(evaluations.resume(run.pending_evaluation), run.step, None, run, tables, logger)
        run.pending_evaluation = None
    producer, extensions = _start_producer(cfg, plan, ppo, tokenizer, rollout_inputs, store, resumed, run.step, ranks)
    method = PROXIMAL_METHODS.get(plan.proximal)
    on_action = actions.record if actions is not None else None  # each firing of the guard, each move of the bound
    guard = ApproximationGuard(rl, plan.max_staleness, on_action) if rl.guard_every else None  # guard_every 0: off
    # the bound in force (rl.staleness_control), under the guard's
    bound = StalenessBound(rl, plan, guard, ranks, on_action)
    producer.start()
    t_run = time.perf_counter()  # the RL loop (setup and warm-start evaluation aside)
    last_ckpt = run.path
    try:
        for step in range(run.step, rl.steps):
            metrics, scored = _train_next_batch(
                step, policy, producer, updater, store, extensions, run, cfg, plan, method, ranks, ppo, guard, bound)
            last = step + 1 == rl.steps
            checkpoint_due = bool(ckpt_dir) and ((step + 1) % rl.checkpoint_every == 0 or last)
            eval_due = (step + 1) % rl.eval_every == 0 or last
            rows = tables.training_rows(step + 1, scored) if eval_due and tables is not None else None
            # rl.eval_mode: evaluated here, or started beside the next steps (a checkpoint records its own step's as
            # pending); the earlier ones are collected before a checkpoint, all of them at the last step
            finished, metrics["time/eval_wait_s"] = evaluations.after_step(
                step + 1, rows, due=eval_due, settle=checkpoint_due or last, last=last)
            for evaluated in finished:
                _record_evaluation(evaluated, step + 1, metrics, run, tables, logger)
            run.history.append(metrics)
            run.step = step + 1
            logger.log_metrics(metrics, step + 1)
            if actions is not None:  # the step's actions follow its metrics line: a crashed step leaves neither
                actions.flush()
            if progress is not None:
                progress(step + 1, metrics)
            if checkpoint_due:
                snapshot = _snapshot(run, store, extensions, plan.max_staleness, evaluations.pending())
                saved = save_rank_checkpoint(ckpt_dir, snapshot, policy, updater, ranks, keep=rl.keep_checkpoints)
                last_ckpt = saved or last_ckpt
            if rl.filter_groups:  # after the step's line and checkpoint: what was trained is kept
                stop_if_drained(run.history, filter_settings(rl)[1], step + 1)
    finally:
        evaluations.close()  # a stop with an evaluation in flight ends as it does inline
        producer.stop()
        for ext in extensions:  # scorer threads end before the producer is joined
            ext.close()
        producer.join(timeout=30)
        producer.close()
    return TrainResult(
        variant=rl.variant.value, seed=rl.seed, warmstart_acc=run.warmstart_acc, final_acc=run.eval_curve[-1][1],
        steps=rl.steps,
        wall_s=time.perf_counter() - t_run, history=run.history, eval_curve=run.eval_curve, checkpoint=last_ckpt,
        resumed_from=resumed_from, checkpoints_skipped=skipped,
        final_weights=store.get(store.latest) if updater.partitioned else None,
    )


def _restore(
    cfg: TrainConfig, plan: RunPlan, policy: torch.nn.Module, ppo: PPOParts, resumed: RunState | None, ranks: Ranks
) -> tuple[Updater, WeightStore]:
    """The updater (optimizer) and the store of policy versions, with the checkpoint's weights,
    optimizer state, PPO parts and the versions the producer still needs when ``resumed``."""
    if resumed is not None:
        load_trained_state(policy, resumed.policy)  # before DeepSpeed copies the weights into its partitions
        ppo.load_weights(resumed.extensions)  # the critic's likewise, before its own engine
    updater = make_updater(policy, cfg.rl, cfg.distributed.deepspeed_config, ranks)
    ppo.make_updater(cfg.rl, cfg.distributed.deepspeed_config, ranks)
    store = WeightStore(weight_retention(plan))  # a version while a batch not yet trained can read it
    if resumed is not None:
        updater.load_optimizer_state(resumed.optimizer)
        ppo.load_state(resumed.extensions)
        for v, w in sorted(resumed.weights_history.items()):
            store.publish(v, w)
        resumed.policy = resumed.optimizer = None  # loaded: do not hold a second copy for the whole run
        resumed.weights_history = {}
    return updater, store


def _start_producer(
    cfg: TrainConfig, plan: RunPlan, ppo: PPOParts, tokenizer, inputs: RolloutInputs, store: WeightStore,
    resumed: RunState | None, start: int, ranks: Ranks,
) -> tuple[Producer, list[Extension]]:
    """The producer of batches ``start, start + 1, ...`` (a thread of this process or rollout-worker
    processes, as the plan places it: a3po.placement.registry) and the run's extensions, restored from ``resumed``."""
    extensions: list[Extension] = [ppo]  # restored with the weights (the intra scorers copy its critic)
    if cfg.oppo.intra:  # the producer's scorers read the critic's version of each batch (a3po.oppo.intra)
        intra = IntraCritic(cfg, ppo, tokenizer.pad_token_id, lag=plan.max_staleness, retention=store.retention)
        if resumed is not None:
            intra.load_state(resumed.extensions)
        intra.begin(start)
        inputs = replace(inputs, intra=intra.scoring)
        extensions.append(intra)
    producer = ROLLOUT_PLACEMENTS.get(plan.placement)(inputs, store, start, ranks)
    if cfg.oppo.inter:
        carry = ProducerCarryOver(producer)
        if resumed is not None:
            carry.load_state(resumed.extensions)  # the carry-over buffer as it was before batch `start`
        extensions.append(carry)
    return producer, extensions


def _train_next_batch(
    step: int, policy: torch.nn.Module, producer: Producer, updater: Updater, store: WeightStore,
    extensions: list[Extension],
    run: RunState, cfg: TrainConfig, plan: RunPlan, method: ProximalMethod, ranks: Ranks, ppo: PPOParts,
    guard: ApproximationGuard | None = None,
    bound: StalenessBound | None = None,
) -> tuple[dict[str, float], ScoredBatch]:
    """Wait for batch ``step``, update the policy on it, tell the extensions, publish version ``step + 1``;
    returns the step's metrics and the batch."""
    t0 = time.perf_counter()
    scored = producer.next_batch()
    wait = time.perf_counter() - t0
    if scored.index != step:
        raise RuntimeError(f"producer delivered batch {scored.index} for step {step}")
    updater.set_lr(learning_rate(cfg.rl, step))
    with intra_op_threads(plan.update_threads):  # every core where the producer idles meanwhile (sync)
        metrics = train_step(updater.model, updater, scored, step, cfg.rl, method, ranks, ppo,
                             trainer_logp=plan.trainer_logp, guard=guard)
    if bound is not None:  # before version step + 1 is published (admission waits on it)
        in_force = bound.bound
        metrics.update(bound.after_step(step, metrics, wait))
        if bound.bound != in_force:
            producer.set_bound(bound.bound)  # in process: its admission; rollout workers: with the next version
    for ext in extensions:
        ext.after_update(step, scored)
    with updater.full_weights():
        store.publish(step + 1, clone_state(policy))
    run.train_wall_s += wait + metrics["perf/step_time_s"]
    metrics.update({"perf/wait_time_s": wait, "time/train_wall_s": run.train_wall_s, "version": float(step + 1),
                    "weights/store_mb": store.nbytes() / 2**20})
    metrics.update(scored.metrics)
    metrics.update(_latency_breakdown(scored.gen_time_s, metrics["perf/step_time_s"], wait))
    return metrics, scored


def _record_evaluation(ev: Evaluated, step: int, metrics: dict[str, float] | None, run: RunState,
                       tables: CompletionTables | None, logger: MetricLogger) -> None:
    """Record the held-out evaluation of version ``ev.version``, collected at the end of ``step``
    (``metrics``: its line, not logged yet; None when resuming, ``step`` being the checkpoint's),
    where an inline run has it: the eval curve, the completion table, and that step's metrics (a
    version whose line is out: its history entry, and logged at its own step by a call of its own)."""
    run.eval_curve.append((ev.version, ev.figures["eval/heldout_acc"]))
    if tables is not None:
        tables.write_rows(ev.version, [] if ev.train_rows is None else ev.train_rows, ev.greedy)
    if metrics is not None and ev.version == step:
        metrics.update(ev.figures)
    else:
        run.history[ev.version - 1].update(ev.figures)
        logger.log_metrics(ev.figures, ev.version)


def _snapshot(run: RunState, store: WeightStore, extensions: list[Extension], lag: int,
              pending: PendingEvaluation | None) -> RunState:
    """``run`` as a checkpoint keeps it: with the policy versions the producer still needs to
    regenerate the batches in flight, the extensions' entries, and the evaluation of its step
    still running beside training (``pending``)."""
    ext_state = {k: v for ext in extensions for k, v in ext.state().items()}
    return replace(run, weights_history=store.history(since=run.step - lag), extensions=ext_state,
                   pending_evaluation=pending)
