"""The rl section (:class:`RLConfig`): the variant, the batch, the optimizer and the loss, then
five features, each with its fields in the class and its rules in a function of its own below
it: the guard (:func:`check_guard`), staleness control (:func:`check_staleness_control`,
:func:`staleness_settings`), rollout correction (:func:`check_rollout_correction`,
:func:`correction_settings`), the group filter (:func:`check_group_filter`,
:func:`filter_settings`) and the step size (:func:`check_step_size`); and the values derived
from the section (the staleness bound in force, the proximal method's name), never written back
into it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Literal

from a3po.algorithms.advantages import ADVANTAGE_ESTIMATORS
from a3po.algorithms.guard import GUARD_POLICIES
from a3po.algorithms.minibatches import MINIBATCH_SPLITS
from a3po.algorithms.proximal import PROXIMAL_METHODS
from a3po.algorithms.rollout_correction import ROLLOUT_CORRECTIONS, CorrectionSettings
from a3po.algorithms.staleness import STALENESS_CONTROLS, StalenessSettings
from a3po.algorithms.step_size import STEP_SIZE_RULES
from a3po.config.errors import MAX_LR, MAX_SEED, seed_ok


class Variant(str, Enum):
    """The three compared variants. They differ only in how the proximal log-probs are
    obtained and in the staleness bound; the loss never asks which one ran."""

    SYNC = "sync"
    RECOMPUTE = "recompute"
    LOGLINEAR = "loglinear"

    @property
    def proximal_method(self) -> str:
        """Default name in :data:`a3po.algorithms.proximal.PROXIMAL_METHODS`."""
        return {"sync": "behaviour", "recompute": "recompute", "loglinear": "loglinear"}[self.value]

    @property
    def is_async(self) -> bool:
        return self is not Variant.SYNC


@dataclass(frozen=True)
class RLConfig:
    variant: Variant = Variant.LOGLINEAR
    steps: int = 150
    batch_prompts: int = 16
    """Prompts per training batch; each is sampled ``group_size`` times (GRPO groups)."""
    group_size: int = 8
    max_staleness: int = 2
    """Bound on how many versions the producer may run ahead (async variants; sync uses 0)."""
    lr: float = 1e-4
    lr_warmup_steps: int = 20
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    """After the warm-up: 'constant', or 'cosine' decay to ``lr_min_ratio * lr`` at ``steps``.
    The decay settles the policy for the final checkpoint: at a constant rate the tiny model's
    held-out accuracy swings by up to 0.2 between checkpoints 25 steps apart."""
    lr_min_ratio: float = 0.1
    minibatches: int = 4
    """Optimizer steps per training batch; the trust region acts across them."""
    minibatch_split: str = "rows"
    """How the batch is cut into minibatches (``a3po.algorithms.minibatches``): 'rows' (rows shuffled, as
    TRL's GRPOTrainer does) or 'groups' (whole GRPO groups per minibatch, as verl splits: cheaper
    with ``shared_prompt_forward``, but on the tiny preset it learned less, docs/variants.md)."""
    shared_prompt_forward: bool = True
    """Training forwards (and recompute's proximal one) run each distinct prompt of a minibatch
    once and the responses on top of its KV cache (``a3po.models.logprobs.response_logits``): the same
    log-probs and gradients up to float rounding, at the cost of ``k * prompt + rows * response``
    token positions instead of ``rows * (prompt + response)``. False: one plain forward per row."""
    eps_clip: float = 0.2
    """The trust region's lower side: ratios below ``1 - eps_clip`` are clipped; in (0, 1)."""
    eps_clip_high: float | None = None
    """The upper side, ``1 + eps_clip_high`` (DAPO's clip-higher); null: ``eps_clip``."""
    behav_weight_cap: float | None = 5.0
    advantage: str = "grpo"
    """Advantage estimator (``a3po.algorithms.advantages``); the group-relative ones (grpo,
    dr_grpo) need ``group_size >= 2``."""
    proximal: str | None = None
    """Override the variant's proximal method (``a3po.algorithms.proximal``): e.g. 'metrics' to log
    loglinear's error, or 'reuse', recompute's exact anchor without its forward (needs ``minibatches: 1``)."""
    guard_every: int = 0
    """Steps between two exact checks of an approximate proximal anchor (loglinear; ``a3po.algorithms.guard``):
    every ``guard_every``-th step recomputes the proximal log-probs of one minibatch's rows (one no-grad
    forward of ``1 / minibatches`` of the batch) and logs the approximation's error (``guard/*``). 0: off."""
    guard_max_err: float = 1.0
    """The guard fires when the p99 over the checked tokens of |approximate - exact| proximal log-prob
    (nats) exceeds this (a healthy ``tiny`` run at bound 4 stays at 0.0-0.3 with rare steps near 0.9, a
    drifting one passes 3.7; docs/variants.md)..."""
    guard_max_iw: float = 5.0
    """... or the p99 of the exact behaviour weight pi_prox / pi_behav exceeds this."""
    guard_policy: str = "warn"
    """What the run does when the guard fires (``a3po.algorithms.guard.GUARD_POLICIES``): 'warn' (log the
    reason), 'tighten' (lower the staleness bound in force by one, not below 1, for the batches not yet
    admitted; needs rollouts in process and ``schedule: threaded``), 'recompute' (train that step on the
    recomputed anchor: one full-batch forward on that step)."""
    staleness_control: str = "fixed"
    """How the staleness bound in force is chosen (``a3po.algorithms.staleness.STALENESS_CONTROLS``): 'fixed'
    (``max_staleness`` for the whole run; only the guard's 'tighten' lowers it) or 'adaptive' (starts at 1 and
    moves by one within [1, ``max_staleness``] after each step: up while the trainer waits for its batches and
    the behaviour weights have room, down when their p99 or the guard's error crosses its bound; needs
    rollouts in process and ``schedule: threaded``; the rule: docs/variants.md)."""
    staleness_idle_frac: float | None = None
    """adaptive: the trainer's idle fraction (its wait for the batch over its step period) above which a step
    asks for a higher bound, in (0, 1). null: 0.1."""
    staleness_max_iw: float | None = None
    """adaptive: the p99 of the behaviour weight pi_prox / pi_behav (``stability/behav_iw_p99``) above which a
    step asks for a lower bound, > 1. null: 2 (1% of the tokens weigh more than double)."""
    staleness_raise_iw: float | None = None
    """adaptive: the p99 of that weight at or below which an idle step may ask for a higher bound, in
    [1, ``staleness_max_iw``]; between the two nothing moves. null: 1.5."""
    staleness_patience: int | None = None
    """adaptive: steps in a row a signal must hold, counted from the bound's last change, before the bound
    moves, >= 1. null: 2."""
    max_new_tokens: int = 24
    temperature: float = 0.7
    top_p: float = 1.0
    schedule: Literal["deterministic", "threaded"] = "deterministic"
    """'deterministic': producer and trainer overlap in threads but meet at fixed points, so a
    run (and a resumed run) is reproducible bit for bit. 'threaded': free-running overlap."""
    grad_clip: float = 1.0
    """Largest global gradient norm of an update (> 0). Not optional: to train unclipped, set a
    norm no update reaches (e.g. 1e6)."""
    rollout_correction: str = "none"
    """Correction of the engine-vs-trainer mismatch of the behaviour log-probs
    (``a3po.algorithms.rollout_correction``, docs/variants.md): 'none' (the loss as it is), 'tis'
    (token-level truncated IS), 'mis' (sequence-level masked IS), 'icepop' (token masking outside a
    band). On, the trainer's log-probs of each token's behaviour version are computed (sync: one
    forward at the start of the step, free with recompute; async: by the producer, one forward per
    version) and the mismatch ratio's weight replaces it in the loss."""
    rollout_correction_cap: float | None = None
    """Upper threshold (> 1): tis's C (default 2), mis's upper bound (sequence 2, geometric 1.001)
    or truncation cap, icepop's beta (5). null: the method's default; must be null with 'none'."""
    rollout_correction_lower: float | None = None
    """Lower threshold in (0, 1): mis mask's (default 1 / cap), icepop's alpha (0.5). tis and mis
    truncate have none. null: the method's default."""
    rollout_correction_level: Literal["sequence", "geometric"] | None = None
    """mis only: the sequence ratio, 'sequence' (product of the token ratios, default) or 'geometric'
    (their geometric mean; rejection only)."""
    rollout_correction_mode: Literal["mask", "truncate"] | None = None
    """mis only: 'mask' (drop a sequence outside [lower, cap], default) or 'truncate' (cap its weight)."""
    step_size: str = "fixed"
    """The learning rate of each optimizer step (``a3po.algorithms.step_size.STEP_SIZE_RULES``): 'fixed' (the
    schedule's) or 'ess_sqrt' (VCPO's: the schedule's times ``sqrt(ESS / N)``, the effective sample size of
    the minibatch's per-sequence behaviour importance weights over its sequences; ``step_size/*`` per step).
    'ess_sqrt' needs importance weights: an asynchronous variant with a staleness-aware proximal policy."""
    filter_groups: bool = False
    """Drop the GRPO groups whose rewards are all equal (zero advantage: no signal) before the update and
    refill the batch from further prompts (DAPO's dynamic sampling; ``a3po.producer.group_filter``):
    ``filter/*`` per step. Needs a group-relative advantage and no per-token reward (KL penalty)."""
    filter_max_prompts: int | None = None
    """filter_groups: prompts a step may draw in all (its batch's included), >= ``batch_prompts``; then it
    trains on what it has, filling up with groups without signal (``filter/short_groups``). null: 4 x
    ``batch_prompts``."""
    filter_patience: int | None = None
    """filter_groups: steps in a row with no group with signal after which the run stops (a broken grader, a
    task too hard or too easy), >= 1. null: 5."""
    eval_samples: int = 4
    """Held-out accuracy is the mean over this many samples per problem at ``temperature``."""
    eval_every: int = 50
    eval_mode: Literal["inline", "background"] = "inline"
    """Where the held-out evaluation of every ``eval_every``-th version runs (``a3po.training.evaluations``):
    'inline' (the trainer's thread: the next update, and rollouts waiting for a new version, wait for it)
    or 'background' (a thread evaluates a snapshot of the version while training goes on: the same
    figures, logged at the version's step; a checkpoint waits for those of earlier versions and
    records its own step's as pending, which a resume from it evaluates first; the last step
    evaluates its version in the trainer's thread).
    Background needs one trainer process (no ``distributed.deepspeed_config``). The warm start's
    evaluation is inline either way."""
    log_completions: int = 16
    """Rows of the completion table written at each held-out evaluation (half from the batch just
    trained on, with rewards, staleness and versions; half greedy held-out answers:
    ``a3po.training.completions``); 0: no tables."""
    checkpoint_every: int = 25
    keep_checkpoints: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "variant", Variant(self.variant))
        if self.steps < 1 or self.batch_prompts < 1 or self.group_size < 1:
            raise ValueError("rl.steps, rl.batch_prompts and rl.group_size must be >= 1")
        if self.max_staleness < 0:
            raise ValueError(f"rl.max_staleness must be >= 0, got {self.max_staleness}")
        if self.minibatches < 1 or (self.batch_prompts * self.group_size) % self.minibatches:
            raise ValueError("rl.minibatches must divide batch_prompts * group_size")
        if not 0 < self.eps_clip < 1:
            # 1 - eps_clip <= 0 is below every ratio: the lower clip would never act.
            raise ValueError(f"rl.eps_clip must be in (0, 1), got {self.eps_clip}")
        if self.eps_clip_high is not None and not 0 < self.eps_clip_high <= 10:
            raise ValueError("rl.eps_clip_high must be in (0, 10] (a ratio of 11 is no trust region), "
                             f"got {self.eps_clip_high}")
        if not self.grad_clip > 0:
            # Clipping scales the gradient by grad_clip / norm: 0 zeroes every update, < 0 reverses it.
            raise ValueError("rl.grad_clip must be > 0 (0 would zero every update and a negative one reverse "
                             f"it), got {self.grad_clip}")
        if self.max_new_tokens < 1:
            raise ValueError(f"rl.max_new_tokens must be >= 1 (a response needs a token), got {self.max_new_tokens}")
        if self.behav_weight_cap is not None and self.behav_weight_cap <= 1:
            raise ValueError("rl.behav_weight_cap must be > 1 (or null for no cap)")
        if self.top_p != 1.0:
            # The trainer cannot score a stale token sampled outside the current nucleus (log 0),
            # and on-policy ratios would be the nucleus mass instead of 1.
            raise ValueError("rl.top_p must be 1.0 for training (use rl.temperature); top-p is for evaluation")
        if not 0 < self.lr <= MAX_LR or self.lr_warmup_steps < 0:
            raise ValueError(f"rl.lr must be in (0, {MAX_LR}] and rl.lr_warmup_steps >= 0, got "
                             f"{self.lr}, {self.lr_warmup_steps}")
        if not 0.0 <= self.lr_min_ratio <= 1.0:
            raise ValueError(f"rl.lr_min_ratio must be in [0, 1], got {self.lr_min_ratio}")
        if not 0.01 <= self.temperature <= 100:
            # RL samples (greedy has no behaviour distribution); near 0 the logits / T overflow,
            # and far above 1 the samples are uniform noise.
            raise ValueError(f"rl.temperature must be in [0.01, 100], got {self.temperature}")
        if self.eval_samples < 1:
            raise ValueError("rl.eval_samples must be >= 1")
        if self.eval_every < 1 or self.checkpoint_every < 1 or self.keep_checkpoints < 1:
            raise ValueError("rl.eval_every, rl.checkpoint_every and rl.keep_checkpoints must be >= 1")
        if self.eval_mode not in ("inline", "background"):
            raise ValueError(f"rl.eval_mode must be 'inline' or 'background', got {self.eval_mode!r}")
        if not 0 <= self.log_completions <= 1000:
            raise ValueError("rl.log_completions must be in [0, 1000] (rows per completion table; 0: none), "
                             f"got {self.log_completions}")
        if not seed_ok(self.seed):
            raise ValueError(f"rl.seed must be in [0, {MAX_SEED}], got {self.seed}")
        for name, registry, value in (("advantage", ADVANTAGE_ESTIMATORS, self.advantage),
                                      ("proximal", PROXIMAL_METHODS, self.proximal or self.variant.proximal_method),
                                      ("minibatch_split", MINIBATCH_SPLITS, self.minibatch_split),
                                      ("step_size", STEP_SIZE_RULES, self.step_size)):
            try:
                registry.get(value)
            except KeyError as e:  # the registry lists the valid names; say which field held it
                raise KeyError(f"rl.{name}: {e.args[0]}") from None
        check_guard(self)
        check_staleness_control(self)
        if PROXIMAL_METHODS.get(self.proximal or self.variant.proximal_method).single_update and self.minibatches > 1:
            # After the first update the training forward no longer runs on the step-start weights.
            raise ValueError(f"rl.proximal {proximal_method_name(self)!r} reads the training forward's log-probs, "
                             "the proximal policy only in a step's single update: it needs rl.minibatches 1, got "
                             f"{self.minibatches} (use loglinear or recompute with several minibatches)")
        check_rollout_correction(self)
        check_group_filter(self)
        check_step_size(self)
        if ADVANTAGE_ESTIMATORS.get(self.advantage).group_relative and self.group_size < 2:
            # A group of one is its own mean: every advantage would be 0 and nothing would learn.
            raise ValueError(f"rl.group_size {self.group_size} with rl.advantage {self.advantage!r}: a group-relative "
                             "estimator needs rl.group_size >= 2 (each sample is compared with its group's others)")


# Derived from the section, never written back into it.

def effective_max_staleness(rl: RLConfig) -> int:
    """Sync is on-policy: the producer never runs ahead of the trainer."""
    return rl.max_staleness if rl.variant.is_async else 0


def proximal_method_name(rl: RLConfig) -> str:
    return rl.proximal or rl.variant.proximal_method


# The guard (rl.guard_*): an exact check, every rl.guard_every-th step, of an approximate proximal
# anchor. What its 'tighten' policy needs is checked with the rules across sections
# (TrainConfig._check_tighten).

def check_guard(rl: RLConfig) -> None:
    try:
        GUARD_POLICIES.get(rl.guard_policy)
    except KeyError as e:
        raise KeyError(f"rl.guard_policy: {e.args[0]}") from None
    if rl.guard_every < 0:
        raise ValueError(f"rl.guard_every must be >= 0 (0: no guard), got {rl.guard_every}")
    if not rl.guard_max_err > 0 or not rl.guard_max_iw > 1:
        # The behaviour weight of on-policy tokens is 1: a bound at or below it always fires.
        raise ValueError(f"rl.guard_max_err must be > 0 and rl.guard_max_iw > 1, got {rl.guard_max_err}, "
                         f"{rl.guard_max_iw}")
    if not rl.guard_every:
        return
    name = rl.proximal or rl.variant.proximal_method
    method = PROXIMAL_METHODS.get(name)
    if method.needs_forward or method.single_update:
        raise ValueError(f"rl.guard_every is set but rl.proximal {name!r} is exact already: the guard checks an "
                         "approximate anchor (loglinear)")
    if effective_max_staleness(rl) == 0:
        raise ValueError(f"rl.guard_every is set but rl.variant {rl.variant.value!r} trains on-policy "
                         "(staleness bound 0): there is no approximation to check")


# Staleness control (rl.staleness_*): how the staleness bound in force moves within
# [1, rl.max_staleness].

def staleness_settings(rl: RLConfig) -> StalenessSettings:
    """The adaptive bound's thresholds as configured, the defaults where null; the guard's error
    bound is ``rl.guard_max_err``."""
    given = {"idle_frac": rl.staleness_idle_frac, "max_iw": rl.staleness_max_iw, "raise_iw": rl.staleness_raise_iw,
             "patience": rl.staleness_patience}
    return replace(StalenessSettings(max_err=rl.guard_max_err), **{k: v for k, v in given.items() if v is not None})


def check_staleness_control(rl: RLConfig) -> None:
    try:
        control = STALENESS_CONTROLS.get(rl.staleness_control)
    except KeyError as e:
        raise KeyError(f"rl.staleness_control: {e.args[0]}") from None
    knobs = {"idle_frac": rl.staleness_idle_frac, "max_iw": rl.staleness_max_iw,
             "raise_iw": rl.staleness_raise_iw, "patience": rl.staleness_patience}
    given = [f"rl.staleness_{k}" for k, v in knobs.items() if v is not None]
    if given and not control.adapts:
        raise ValueError(f"rl.staleness_control {rl.staleness_control!r} does not read {', '.join(given)} (the "
                         "bound stays rl.max_staleness): set rl.staleness_control adaptive, or leave it null")
    s = staleness_settings(rl)
    if not 0 < s.idle_frac < 1:
        raise ValueError(f"rl.staleness_idle_frac must be in (0, 1), got {s.idle_frac}")
    if not s.max_iw > 1:
        # The weight of every on-policy token is 1: a bound at or below it lowers on every step.
        raise ValueError(f"rl.staleness_max_iw must be > 1, got {s.max_iw}")
    if not 1 <= s.raise_iw <= s.max_iw:
        raise ValueError(f"rl.staleness_raise_iw must be in [1, rl.staleness_max_iw {s.max_iw:g}], "
                         f"got {s.raise_iw}")
    if s.patience < 1:
        raise ValueError(f"rl.staleness_patience must be >= 1, got {s.patience}")
    if not control.adapts:
        return
    if effective_max_staleness(rl) == 0:
        raise ValueError(f"rl.staleness_control 'adaptive' with rl.variant {rl.variant.value!r} and "
                         f"rl.max_staleness {rl.max_staleness}: the bound is 0 (on-policy), there is nothing "
                         "to adapt; use an asynchronous variant with rl.max_staleness >= 2")
    if rl.max_staleness == 1:
        raise ValueError("rl.staleness_control 'adaptive' with rl.max_staleness 1: the bound moves within "
                         "[1, rl.max_staleness], here nowhere; set rl.max_staleness >= 2 (the ceiling)")
    if rl.schedule == "deterministic":
        # The schedule derives each batch's versions, and the store the versions it keeps, from the bound.
        raise ValueError("rl.staleness_control 'adaptive' with rl.schedule 'deterministic': the schedule fixes "
                         "each batch's weight versions, and the versions the store keeps, from rl.max_staleness "
                         "for the whole run; use rl.schedule 'threaded'")


# Rollout correction (rl.rollout_correction*): correcting the engine-vs-trainer mismatch of the behaviour
# log-probs.

def correction_settings(rl: RLConfig) -> CorrectionSettings:
    """The rollout correction's thresholds as configured (the method fills in its defaults)."""
    return CorrectionSettings(rl.rollout_correction_cap, rl.rollout_correction_lower, rl.rollout_correction_level,
                              rl.rollout_correction_mode)


def check_rollout_correction(rl: RLConfig) -> None:
    try:
        method = ROLLOUT_CORRECTIONS.get(rl.rollout_correction)
    except KeyError as e:
        raise KeyError(f"rl.rollout_correction: {e.args[0]}") from None
    s = correction_settings(rl)
    for option in ("cap", "lower", "level", "mode"):
        if getattr(s, option) is not None and option not in method.options:
            used = ", ".join(f"rl.rollout_correction_{o}" for o in sorted(method.options)) or "none"
            raise ValueError(f"rl.rollout_correction_{option} is set but rl.rollout_correction "
                             f"{rl.rollout_correction!r} does not read it (it reads: {used})")
    if s.cap is not None and not 1 < s.cap <= 1e6:
        # A cap <= 1 would cut (or drop) the ratio of tokens the two numerics agree on.
        raise ValueError(f"rl.rollout_correction_cap must be in (1, 1e6], got {s.cap}")
    if s.lower is not None and not 0 < s.lower < 1:
        raise ValueError(f"rl.rollout_correction_lower must be in (0, 1), got {s.lower}")
    try:
        method.resolve(s)
    except ValueError as e:
        raise ValueError(f"rl.rollout_correction {rl.rollout_correction!r} with rl.rollout_correction_level "
                         f"{s.level!r}, rl.rollout_correction_mode {s.mode!r}: {e}") from None


# The group filter (rl.filter_*): groups without signal dropped and refilled before the update. What it
# cannot refill (batches scored while decoding, per-token rewards) is checked with the rules across
# sections (TrainConfig._check_group_filter).

def filter_settings(rl: RLConfig) -> tuple[int, int]:
    """``(max_prompts, patience)`` as configured, the defaults where null."""
    return (4 * rl.batch_prompts if rl.filter_max_prompts is None else rl.filter_max_prompts,
            5 if rl.filter_patience is None else rl.filter_patience)


def check_group_filter(rl: RLConfig) -> None:
    given = [f"rl.{k}" for k in ("filter_max_prompts", "filter_patience") if getattr(rl, k) is not None]
    if not rl.filter_groups:
        if given:
            raise ValueError(f"{', '.join(given)} set but rl.filter_groups is false: set rl.filter_groups true, "
                             "or leave them null")
        return
    max_prompts, patience = filter_settings(rl)
    if max_prompts < rl.batch_prompts:
        raise ValueError(f"rl.filter_max_prompts must be >= rl.batch_prompts {rl.batch_prompts} (a step draws its "
                         f"batch's prompts at least), got {max_prompts}")
    if patience < 1:
        raise ValueError(f"rl.filter_patience must be >= 1, got {patience}")
    if not ADVANTAGE_ESTIMATORS.get(rl.advantage).group_relative:
        raise ValueError(f"rl.filter_groups with rl.advantage {rl.advantage!r}: a group with equal rewards carries no "
                         "signal only under a group-relative estimator (grpo, dr_grpo); here its advantages "
                         "come from the critic")


# The step size (rl.step_size): the learning rate of each optimizer step, from the behaviour weights.

def check_step_size(rl: RLConfig) -> None:
    if STEP_SIZE_RULES.get(rl.step_size).needs_weights and (
            proximal_method_name(rl) == "behaviour" or effective_max_staleness(rl) == 0):
        # pi_prox = pi_behav on every token: every weight is 1, ESS = N, the rule would do nothing.
        raise ValueError(f"rl.step_size {rl.step_size!r} with rl.variant {rl.variant.value!r} (rl.proximal "
                         f"{proximal_method_name(rl)!r}, staleness bound {effective_max_staleness(rl)}): the "
                         "rule reads the behaviour importance weights, which this variant does not have (every "
                         "token's weight is 1); use recompute or loglinear with rl.max_staleness >= 1")
