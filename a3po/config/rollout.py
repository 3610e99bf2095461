"""The rollout sections: the engine that samples (:class:`RolloutConfig`, and whether it may swap
weights mid-batch: :func:`mid_batch_updates`) and OPPO's overlaps of generation with scoring and
training (:class:`OppoConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from a3po.catalog import DECODER_NAMES, ROLLOUT_ENGINE_NAMES, SAMPLER_NAMES
from a3po.devices import DType


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
