"""Metric reporting without a tracking dependency: the library calls a :class:`MetricLogger`;
MLflow is one implementation (in ``tasks/``), a JSONL file another.

Metric names are namespaced and valid MLflow keys (letters, digits, ``_ - . /``). One row a
key (``a|b`` names two keys, ``*`` a family); "the step's tokens" are the generated tokens of
the step's batch, all minibatches together.

======================================  ===================================================
``reward/mean``, ``reward/std``         reward of the training batch (grader score, 0..1)
``reward/groups_all_equal``             groups of the training batch whose rewards are all
                                        equal (no signal under a group-relative estimator)
``filter/prompts_drawn``                (``rl.filter_groups``) prompts the step drew, its
                                        batch's included (``a3po.producer.group_filter``)
``filter/filtered_frac``                ... of those, the groups without signal
``filter/signal_groups|short_groups``   ... of the batch's groups, with signal and filled up
                                        without (the cap reached)
``filter/prompts_per_signal_group``     ... drawn over trained with signal (none: absent)
``filter/refill_gen_s``                 ... the refills' generation and grading seconds
``filter/generated_reward_mean``        ... mean reward of every sample drawn
``step_size/ess|ess_ratio``             (``rl.step_size: ess_sqrt``) Kish effective sample
                                        size of the minibatch's sequence behaviour weights,
                                        and over its sequences; mean over minibatches
``step_size/lr_scale``                  ... the rate's multiplier sqrt(ess_ratio), mean over
                                        minibatches (``a3po.algorithms.step_size``)
``stability/behav_iw_mean|p99|max``     behaviour importance weight pi_prox / pi_behav (the
                                        off-policy correction) over the step's tokens
                                        (``a3po.algorithms.stability``); with a rollout
                                        correction pi_behav is the trainer's log-prob of the
                                        behaviour version (the staleness part alone)
``stability/behav_iw_capped_frac``      fraction of the step's tokens with that weight above
                                        ``rl.behav_weight_cap`` (dropped from the loss)
``stability/trust_ratio_mean|p99|max``  trust-region ratio pi_theta / pi_prox, same tokens
``stability/trust_ratio_clipped_frac``  fraction of the step's tokens whose clipped term is
                                        active (ratio outside the clip range: no gradient)
``policy/approx_kl``                    KL(pi_prox || pi_theta) per token, nats: k3 estimator
                                        importance-weighted by pi_prox / pi_behav because the
                                        tokens were sampled from pi_behav; step's tokens
``policy/entropy``                      mean next-token entropy on generated tokens, nats
``policy/grad_norm``                    gradient norm before clipping, mean over minibatches
``loss/policy``                         decoupled PPO loss, mean over minibatches
``staleness/mean|max``                  trainer version minus token version, over generated
                                        tokens
``staleness/tokens_<d>``                how many of the step's generated tokens were ``d``
                                        versions behind (d = 0 .. the step's max): the
                                        staleness histogram, summed over steps
``staleness/bound``                     the staleness bound in force after this step (for the
                                        batches admitted from now on): ``rl.max_staleness``
                                        (fixed), moved by ``rl.staleness_control: adaptive``
                                        and lowered by the guard's ``tighten``
                                        (``a3po.training.staleness``); 0 for sync
``staleness/bound_changed``             this step's move of that bound: +1, -1 or 0 (the
                                        reason goes to the ``a3po.staleness`` log and a row
                                        of the run's actions: ``a3po.training.actions``)
``prox/time_s``                         wall time to obtain proximal log-probs this step
``prox/approx_abs_err|approx_iw_err``   (``proximal: metrics``) mean |loglinear - recomputed|
                                        log-prob, and the mean |exp(difference) - 1| it puts
                                        into the importance weight
``guard/abs_err_mean|p99|max``          (``rl.guard_every``, checked steps only) |approximate -
                                        exact| proximal log-prob over one minibatch's
                                        generated tokens, nats (``a3po.training.guard``)
``guard/iw_err_p99``                    ... p99 of |exp(difference) - 1|: the relative error
                                        it puts into the behaviour weight
``guard/behav_iw_p99|max``              ... the exact behaviour weight pi_prox / pi_behav
``guard/tokens``                        ... how many tokens were compared
``guard/nonfinite_tokens``              ... how many of them held NaN or inf (any: fired)
``guard/fired``                         1 when a bound was crossed (``rl.guard_max_err``,
                                        ``rl.guard_max_iw``; the reason goes to the
                                        ``a3po.guard`` log and a row of the run's actions:
                                        ``a3po.training.actions``), else 0
``guard/over_max_err|over_max_iw``      ... which bound: 1 where ``guard/abs_err_p99``
                                        passed ``rl.guard_max_err``, resp.
                                        ``guard/behav_iw_p99`` passed ``rl.guard_max_iw``
                                        (a NaN figure counts as passed)
``guard/recomputed``                    1 when the step then trained on the recomputed
                                        anchor (``rl.guard_policy: recompute``)
``guard/tightened``                     1 when the staleness bound was lowered by one
                                        (``rl.guard_policy: tighten``)
``guard/bound``                         the staleness bound in force after the check
``guard/time_s``                        wall time of the check (its one-minibatch forward)
``rollout/behav_logp_abs_err|_max``     (``proximal: metrics``, or a rollout correction) mean
                                        and max |engine - trainer| behaviour log-prob of the
                                        same weights
``rollout/behav_iw_err``                ... and the mean |exp(difference) - 1| it puts into
                                        the behaviour weight
``correction/ratio_p50|p99|max``        (``rl.rollout_correction`` on) engine-vs-trainer ratio
                                        rho = pi_trainer(v) / pi_engine(v) of the step's
                                        tokens at their behaviour version v
                                        (``a3po.algorithms.rollout_correction``)
``correction/masked_frac``              fraction of the step's tokens the correction dropped
                                        (weight 0: icepop's band, mis's rejected sequences)
``correction/truncated_frac``           ... whose weight it cut to the cap (tis, mis truncate)
``correction/seq_masked_frac``          fraction of the batch's sequences with every token
                                        dropped
``correction/weight_mean``              mean correction weight c_t over the step's tokens
``correction/seq_ratio_p50|p99|max``    (mis) the sequence ratio it thresholds: the product
                                        of rho, or its geometric mean (level geometric)
``correction/time_s``                   wall time to obtain the trainer's behaviour log-probs
                                        and the weights in the step (sync: a forward unless
                                        recompute ran one; async: the producer's re-scoring
                                        is not in it)
``perf/step_time_s``                    wall time of the training step (rollout wait excluded)
``perf/wait_time_s``                    time the trainer waited for rollouts
``perf/gen_time_s``                     wall time the producer spent generating the batch
``perf/tokens_per_s``                   generated tokens trained per second of step wall time
``perf/generate_s|train_s|idle_s``      the step seen from the trainer: the batch's
                                        generation, its own training, its wait for the batch
``perf/trainer_busy_frac``              train_s / (train_s + idle_s)
``perf/generator_busy_frac``            generate_s / (train_s + idle_s); above 1 when
                                        generation overlaps training
``time/train_wall_s``                   trainer wall clock so far: rollout waits + steps,
                                        evaluations excluded (time to target reads it)
``time/eval_wait_s``                    seconds this step spent on held-out evaluations
                                        after its update: the whole evaluation inline; the
                                        snapshot and any wait for a running one with
                                        ``rl.eval_mode: background``
                                        (``a3po.training.evaluations``); 0 on other steps
``version``                             the policy version after this step
``weights/store_mb``                    MiB of policy versions the weight store keeps after
                                        this step (full weights, or with ``model.lora``
                                        the adapters alone)
``response/length_mean``                generated tokens per sample
``response/truncated_frac``             fraction of samples cut at ``rl.max_new_tokens``
``eval/heldout_acc``                    held-out accuracy, **sampled**: mean@n
                                        (``rl.eval_samples`` completions per problem) at the
                                        training temperature, fixed sampling seed
                                        (``a3po.training.heldout``); step 0 = warm start
``eval/heldout_greedy_acc``             held-out accuracy, greedy pass@1 (temperature 0);
                                        both logged at the evaluated version's step, in
                                        background mode by a later call of their own
``eval/final/*``                        (after training, ``tasks.evaluation``) the held-out
                                        figures of the final checkpoint, and
                                        ``eval/final/<benchmark>/<metric>`` per benchmark
``grader/calls``                        completions graded for this step's batch (counts,
                                        per batch)
``grader/fast``                         ... decided by the exact plain-number compare
``grader/math_verify``                  ... sent to the math-verify worker
``grader/timeouts``                     ... whose math-verify comparison hit the timeout
                                        (scored 0)
``grader/worker_errors``                ... math-verify could not decide (evaluator error;
                                        scored 0)
``grader/no_answer``                    ... with no final answer found (scored 0)
``grader/too_long``                     ... whose answer exceeded the grader's length bound
                                        (scored 0)
``ppo/kl``, ``ppo/kl_seq``              (kl_coef > 0) KL of the sampling policy to the
                                        reference (frozen warm start), ``ppo.kl_estimator``
                                        per token: mean per token / per sequence, nats
``ppo/value_loss``                      (critic) clipped value loss, 0.5 * squared error,
                                        token mean
``ppo/value_clip_frac``                 fraction of tokens where the clipped value term is
                                        active
``ppo/value_grad_norm``                 the critic's gradient norm before clipping
``ppo/value_loss_last_epoch``           (ppo.critic_epochs > 1) mean value loss of the
                                        critic's last pass over the batch
``ppo/value_mean``                      mean critic value on generated tokens when the batch
                                        is scored
``ppo/return_mean``                     mean GAE return (the critic's target) on generated
                                        tokens
``ppo/explained_variance``              1 - Var(R - V) / Var(R): 1 perfect critic, 0 a
                                        constant, < 0 worse (per token, over the batch)
``ppo/ev_prompt_ceiling``               share of the batch's score variance between prompts
                                        (ANOVA): the explained variance of a critic knowing
                                        each prompt's success rate but not judging the answer
``reward/model_mean``                   (reward: model) mean reward-model score,
                                        sigmoid(logit) in 0..1
``reward/model_grader_agreement``       fraction of samples where RM score > 0.5 matches the
                                        grader
``reward_model/heldout_acc``            (offline RM training, on the flow's parent run)
                                        held-out accuracy; ``reward_model/heldout_majority_acc``
                                        is the always-commoner-label baseline;
                                        ``_balanced_acc`` (TPR + TNR) / 2 and ``_auc`` are
                                        0.5 for a constant guess
``reward_model/heldout_positive_frac``  share of correct samples in the held-out split
``reward_model/train_acc|train_auc``    the same figures on the training samples, and
``reward_model/train_loss``             the last training loss
``reward_model/n_train|n_heldout``      samples in each split
``oppo/delta``                          (OPPO inter-step) groups admitted beyond the batch
``oppo/carried``                        unfinished samples carried to the next step
``oppo/carried_age_max``                steps the oldest carried sample has waited
``oppo/trained_age_max``                steps the oldest trained sample waited since admitted
``oppo/chunk_size``, ``oppo/chunks``    (OPPO intra-step) tokens per streamed chunk, chunks
                                        sent this step
``oppo/scorer_busy_s/<scorer>``         seconds each streaming scorer thread computed
======================================  ===================================================
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Protocol

from a3po.storage.atomic import atomic_write_bytes

_VALID_KEY = re.compile(r"^[A-Za-z0-9_\-./ ]+$")


def valid_metric_key(name: str) -> bool:
    return bool(_VALID_KEY.match(name)) and ".." not in name and not name.startswith("/")


class MetricLogger(Protocol):
    """Takes each step's metrics once, in step order; a step's figures computed later (a background
    held-out evaluation: ``a3po.training.evaluations``) come in a further call with that step."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...


def rewind_logger(logger: MetricLogger, step: int, history: list[dict[str, float]]) -> None:
    """Tell ``logger`` the run continues after ``step`` with ``history`` (steps 1..step) as its
    record. Loggers that keep their own copy of the steps (a file) implement ``rewind``; others
    (MLflow's, which skips steps it already has) need nothing."""
    rewind = getattr(logger, "rewind", None)
    if rewind is not None:
        rewind(step, history)


class NullLogger:
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass


def _jsonl_line(step: int, metrics: dict[str, float]) -> bytes:
    return (json.dumps({"step": step, **metrics}) + "\n").encode()


def read_metrics_jsonl(path: str | Path) -> list[dict]:
    """The rows of a metrics JSONL file. A last line without its newline is torn (a process
    killed mid-write) and dropped; a bad complete line is an error naming the file and line."""
    path = Path(path)
    complete, _, _torn = path.read_bytes().rpartition(b"\n")
    rows = []
    for i, raw in enumerate(complete.split(b"\n") if complete else []):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"{path} line {i + 1}: not JSON: {e}") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ValueError(f"{path} line {i + 1}: not an object with an integer 'step'")
        rows.append(row)
    return rows


def cut_torn_line(path: str | Path) -> None:
    """Cut the last line of ``path`` when it has no newline (a process killed mid-write)."""
    path = Path(path)
    if not path.exists():
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def append_line(path: str | Path, line: bytes) -> None:
    """Append ``line`` (ending in a newline) to ``path`` in one ``write`` on an append-only file
    descriptor: a killed process leaves at most a torn last line, and a failed write (a full disk)
    is cut back so no partial line stays."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            if os.write(fd, line) != len(line):
                raise OSError(f"{path}: short write (disk full?)")
        except OSError:
            os.ftruncate(fd, size)  # no half line
            raise
    finally:
        os.close(fd)


class JsonlLogger:
    """``{"step": s, **metrics}`` per line. Each line is one ``write`` on an append-only file
    descriptor; a failed write (a full disk) is cut back so no partial line stays. A torn last
    line left by a killed process is cut before the first new line is appended (or the file is
    rewritten by :meth:`rewind`); until then the file is left as it is."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._repaired = False

    def repair(self) -> None:
        """Cut a last line that has no newline (a crash mid-write)."""
        cut_torn_line(self.path)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if not self._repaired:
            self.repair()
            self._repaired = True
        append_line(self.path, _jsonl_line(step, metrics))

    def rewind(self, step: int, history: list[dict[str, float]]) -> None:
        """Rewrite the file atomically as: its step-0 lines (logged before the first RL step,
        e.g. the warm-start evaluation), then one line per step of ``history``. A fresh start
        (``step`` 0) keeps nothing: an attempt killed before its first checkpoint is redone."""
        if len(history) != step:
            raise ValueError(f"rewind to step {step} with {len(history)} history entries")
        head: list[bytes] = []
        if step > 0 and self.path.exists():
            for raw in self.path.read_bytes().splitlines():
                try:
                    row = json.loads(raw)
                except ValueError:
                    continue  # replaced by the history below
                if isinstance(row, dict) and row.get("step") == 0:
                    head = [raw + b"\n"]  # once, the last one logged
        body = [_jsonl_line(i + 1, h) for i, h in enumerate(history)]
        atomic_write_bytes(self.path, lambda f: f.write(b"".join(head + body)))
        self._repaired = True


class FanoutLogger:
    def __init__(self, *loggers: MetricLogger) -> None:
        self.loggers = loggers

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for lg in self.loggers:
            lg.log_metrics(metrics, step)

    def rewind(self, step: int, history: list[dict[str, float]]) -> None:
        for lg in self.loggers:
            rewind_logger(lg, step, history)
