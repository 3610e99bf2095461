"""The data sections: the training and held-out rows, embedded task or files (:class:`DataConfig`,
with the embedded task's :class:`ArithmeticDifficulty`), and the supervised warm start on them
(:class:`WarmStartConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from a3po.catalog import PromptFormat, TaskName
from a3po.config.errors import MAX_GENERATED_ROWS, MAX_LR, MAX_SEED, seed_ok


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
        if not seed_ok(self.seed):
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
        if not seed_ok(self.seed):
            raise ValueError(f"warm_start.seed must be in [0, {MAX_SEED}], got {self.seed}")
