"""Typed configs for training, loadable from YAML. Invalid values raise when the config is
built; derived values (e.g. the effective staleness bound of a variant) are functions, never
written back into the config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

from a3po.arithmetic import ArithmeticDifficulty


class Variant(str, Enum):
    """The three compared variants. They differ only in how the proximal log-probs are
    obtained and in the staleness bound; the loss never asks which one ran."""

    SYNC = "sync"
    RECOMPUTE = "recompute"
    LOGLINEAR = "loglinear"

    @property
    def proximal_method(self) -> str:
        """Default name in :data:`a3po.proximal.PROXIMAL_METHODS`."""
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
    """Reward/grader task name (see ``eval.grading``): arith, gsm8k, math500, aime24."""
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
    :class:`a3po.arithmetic.ArithmeticDifficulty`)."""
    max_prompt_tokens: int = 96
    on_bad_row: str = "error"
    """'error' raises naming the row; 'skip' drops it and counts it in the dataset report."""

    def __post_init__(self) -> None:
        if self.on_bad_row not in ("error", "skip"):
            raise ValueError(f"data.on_bad_row must be 'error' or 'skip', got {self.on_bad_row!r}")
        if self.n_train < 1 or self.n_heldout < 1:
            raise ValueError("data.n_train and data.n_heldout must be >= 1")
        if not 0.0 <= self.teacher_slip_rate < 1.0:
            raise ValueError(f"data.teacher_slip_rate must be in [0, 1), got {self.teacher_slip_rate}")


@dataclass(frozen=True)
class WarmStartConfig:
    """Supervised warm start so RL begins from partial competence."""

    steps: int = 400
    batch_size: int = 64
    lr: float = 3e-3
    seed: int = 0


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
        from a3po.advantages import ADVANTAGE_ESTIMATORS
        from a3po.proximal import PROXIMAL_METHODS

        ADVANTAGE_ESTIMATORS.get(self.advantage)  # raises listing the valid names
        PROXIMAL_METHODS.get(self.proximal or self.variant.proximal_method)


def effective_max_staleness(rl: RLConfig) -> int:
    """Sync is on-policy: the producer never runs ahead of the trainer."""
    return rl.max_staleness if rl.variant.is_async else 0


def proximal_method_name(rl: RLConfig) -> str:
    return rl.proximal or rl.variant.proximal_method


@dataclass(frozen=True)
class DistributedConfig:
    """Data-parallel trainer ranks under DeepSpeed (see ``a3po.distributed``), launched by
    ``torchrun ... -m a3po.cli train`` or the deepspeed launcher."""

    deepspeed_config: str | None = None
    """DeepSpeed JSON holding the ZeRO stage (1 or 2) and precision, e.g.
    ``infra/deepspeed_zero2.json``; null trains in one plain torch process. Batch sizes and
    clipping come from ``rl.*``. Needs the ``distributed`` extra (``pip install -e '.[distributed]'``)."""

    def __post_init__(self) -> None:
        from a3po.distributed import INSTALL_HINT, deepspeed_available

        if self.deepspeed_config is not None and not deepspeed_available():
            raise ValueError(f"distributed.deepspeed_config is set but DeepSpeed is not installed: {INSTALL_HINT}")


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    output_dir: str = "runs/default"
    torch_threads: int = 1
    """Intra-op threads of each Python thread. The rollout producer and the trainer are two
    threads; one intra-op thread each maps them onto two cores without oversubscription."""

    def __post_init__(self) -> None:
        if self.distributed.deepspeed_config is not None:
            from a3po.distributed import read_deepspeed_json

            read_deepspeed_json(self.distributed.deepspeed_config, self.rl.grad_clip)  # raises naming the file and key


def _build(cls: type, values: dict[str, Any], where: str) -> Any:
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(values) - set(names)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; valid: {sorted(names)}")
    kwargs = {}
    for k, v in values.items():
        sub = {ModelConfig: "model", DataConfig: "data", WarmStartConfig: "warm_start", RLConfig: "rl", DistributedConfig: "distributed"}
        target = next((c for c, n in sub.items() if n == k and cls is TrainConfig), None)
        kwargs[k] = _build(target, v or {}, f"{where}.{k}") if target else v
    return cls(**kwargs)


def config_from_dict(values: dict[str, Any], where: str = "config") -> TrainConfig:
    return _build(TrainConfig, values, where)


def load_config(path: str | Path) -> TrainConfig:
    """Load a TrainConfig from YAML; errors name the file and the field."""
    with open(path) as f:
        values = yaml.safe_load(f) or {}
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return config_from_dict(values, where=str(path))


def merge_yaml(cfg: TrainConfig, path: str | Path) -> TrainConfig:
    """``cfg`` with the sections of a YAML file laid over it field by field."""
    with open(path) as f:
        values = yaml.safe_load(f) or {}
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    base = config_to_dict(cfg)
    for section, sub in values.items():
        if isinstance(sub, dict) and isinstance(base.get(section), dict):
            base[section].update(sub)
        else:
            base[section] = sub
    return config_from_dict(base, where=str(path))


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    d = dataclasses.asdict(cfg)
    d["rl"]["variant"] = cfg.rl.variant.value
    return d


def with_overrides(cfg: TrainConfig, **sections: dict[str, Any]) -> TrainConfig:
    """Copy ``cfg`` replacing fields per section, e.g. ``with_overrides(cfg, rl={"steps": 5})``."""
    d = config_to_dict(cfg)
    for section, values in sections.items():
        if isinstance(d.get(section), dict):
            d[section].update(values)
        else:
            d[section] = values
    return config_from_dict(d)


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
}


def preset(name: str) -> TrainConfig:
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; valid: {sorted(PRESETS)}")
    return config_from_dict(PRESETS[name])
