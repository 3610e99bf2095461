"""The model section: which model trains (:class:`ModelConfig`) and the LoRA adapters RL may train
on it instead of every weight (:class:`LoraConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from a3po.config.errors import MAX_SEED, seed_ok


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
        if not seed_ok(self.init_seed):
            raise ValueError(f"model.init_seed must be in [0, {MAX_SEED}], got {self.init_seed}")
