"""Rollout engines behind one interface, chosen by name (``rollout.engine``).

An engine samples a batch of prompts and returns a :class:`~a3po.rollout.torch_engine.RolloutBatch` with, per
generated token, the behaviour log-prob of the distribution it was actually sampled from
(temperature applied) and the policy version of the weights that produced it; it loads new
weights tagged with a version. The controller talks to nothing else.

* ``torch`` (:class:`a3po.rollout.torch_engine.RolloutEngine`): plain torch + transformers in the trainer's
  process, with the incremental decoder ``rollout.decoder`` names (:mod:`a3po.models.decoders`). Can
  swap weights between decode steps (``mid_batch_updates``), which the deterministic schedule uses.
* ``vllm`` (:class:`a3po.rollout.vllm_engine.VllmEngine`): ``vllm.LLM`` in-process; weights are
  reloaded between batches only, from a safetensors file the trainer writes.

Each engine is registered as an :class:`EngineSpec` under a name declared, with its capabilities,
in :data:`a3po.catalog.ROLLOUT_ENGINE_NAMES` (below config, which checks names and capabilities
against it): a config asking for what the engine cannot do fails when the config is built, and
why the engine cannot run here (e.g. vLLM not installed) is known without building it.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import torch

from a3po.catalog import ROLLOUT_ENGINE_NAMES
from a3po.config import TrainConfig
from a3po.registry import Registry

if TYPE_CHECKING:
    from a3po.rollout.torch_engine import BetweenSteps, OnToken, RolloutBatch, SamplingParams


class Engine(Protocol):
    version: int
    """Policy version of the weights now loaded."""
    mid_batch_updates: bool
    """Whether ``generate_batch``'s ``between_steps`` hook may swap weights between decode steps."""

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seed: int,
        between_steps: BetweenSteps | None = None,
        meta: list[dict] | None = None,
    ) -> RolloutBatch: ...

    def generate_until(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seed: int,
        row_budget: torch.Tensor,
        stop_early: Callable[[torch.Tensor], bool],
        between_steps: BetweenSteps | None = None,
        on_token: OnToken | None = None,
    ) -> RolloutBatch:
        """OPPO's over-committed decoding: row ``i`` stops at ``row_budget[i]`` new tokens, and the
        whole batch as soon as ``stop_early(done)`` (the ``(n,)`` mask of rows done) is true after
        a decode step; unfinished rows come back with their tokens so far (``finished`` False).
        ``on_token(t, tokens, alive)``: each decode step's column, for OPPO's streamed scoring."""
        ...

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None: ...

    @property
    def device(self) -> torch.device:
        """Where the batches it returns live (the trainer's device)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class EngineSpec:
    name: str
    mid_batch_updates: bool
    missing: Callable[[], str | None]
    """None when the engine can run here, else why not (with the install hint)."""
    build: Callable[..., Engine]
    """``build(policy, tokenizer, state, version, cfg)``: an engine holding ``state`` as ``version``."""


ROLLOUT_ENGINES: Registry[EngineSpec] = Registry("rollout engine")


def _build_torch(policy: torch.nn.Module, tokenizer, state: dict[str, torch.Tensor], version: int, cfg: TrainConfig) -> Engine:
    from a3po.devices import model_device, model_dtype
    from a3po.rollout.torch_engine import RolloutEngine

    # The producer samples from its own copy of the policy, on the policy's device and in its dtype.
    with torch.device(model_device(policy)):  # built in place: no CPU initialisation of a large model
        engine_model = type(policy)(policy.config)
    # rollout.dtype (e.g. bf16 beside an fp32 trainer): each version loads into the engine's dtype.
    engine_model.to(dtype=cfg.rollout.dtype.torch if cfg.rollout.dtype is not None else model_dtype(policy))
    engine_model.load_state_dict(state)
    return RolloutEngine(engine_model.eval(), tokenizer.eos_token_id, tokenizer.pad_token_id, version=version,
                         decoder=cfg.rollout.decoder)


def _build_vllm(policy: torch.nn.Module, tokenizer, state: dict[str, torch.Tensor], version: int, cfg: TrainConfig) -> Engine:
    from a3po.rollout.vllm_engine import VllmEngine

    return VllmEngine.from_policy(
        policy, tokenizer, state, version,
        max_model_len=cfg.data.max_prompt_tokens + cfg.rl.max_new_tokens,
        dtype=cfg.dtype.value,
        seed=cfg.rl.seed,
        gpu_memory_utilization=cfg.rollout.vllm_gpu_memory_utilization,
        max_batch=cfg.rl.batch_prompts * cfg.rl.group_size,
        work_dir=tempfile.mkdtemp(prefix="a3po-vllm-"),
    )


def _vllm_missing() -> str | None:
    from a3po.rollout.vllm_support import vllm_missing

    return vllm_missing()


def _bind(name: str, missing: Callable[[], str | None], build: Callable[..., Engine]) -> None:
    declared = ROLLOUT_ENGINE_NAMES.get(name)  # an engine config cannot name would be unreachable
    ROLLOUT_ENGINES.register(name)(EngineSpec(name, declared.mid_batch_updates, missing, build))


_bind("torch", missing=lambda: None, build=_build_torch)
_bind("vllm", missing=_vllm_missing, build=_build_vllm)


def build_engine(policy: torch.nn.Module, tokenizer, state: dict[str, torch.Tensor], version: int, cfg: TrainConfig) -> Engine:
    """The engine ``cfg.rollout.engine`` names, holding ``state`` as policy ``version``."""
    spec = ROLLOUT_ENGINES.get(cfg.rollout.engine)
    why = spec.missing()
    if why is not None:
        raise RuntimeError(f"rollout.engine {spec.name!r} cannot run here: {why}")
    return spec.build(policy, tokenizer, state, version, cfg)
