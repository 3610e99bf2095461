"""Rollout engines behind one interface, chosen by name (``rollout.engine``).

An engine (the :class:`~a3po.rollout.types.Engine` protocol) samples a batch of prompts and returns a
:class:`~a3po.rollout.types.RolloutBatch` with, per generated token, the behaviour log-prob of the
distribution it was actually sampled from (temperature applied) and the policy version of the
weights that produced it; it loads new weights tagged with a version. The producer talks to nothing else.

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
from typing import Callable

import torch

from a3po.catalog import ROLLOUT_ENGINE_NAMES
from a3po.config import TrainConfig
from a3po.devices import DType, model_dtype
from a3po.registry import Registry
from a3po.rollout.types import Engine


@dataclass(frozen=True)
class EngineSpec:
    name: str
    mid_batch_updates: bool
    missing: Callable[[], str | None]
    """None when the engine can run here, else why not (with the install hint)."""
    build: Callable[..., Engine]
    """``build(policy, tokenizer, state, version, cfg, dtype)``: an engine holding ``state`` as ``version``,
    its weights in ``dtype`` (the run plan's :attr:`~a3po.config.plan.RunPlan.engine_dtype`)."""


ROLLOUT_ENGINES: Registry[EngineSpec] = Registry("rollout engine")


def _build_torch(policy: torch.nn.Module, tokenizer, state: dict[str, torch.Tensor], version: int, cfg: TrainConfig,
                 dtype: DType) -> Engine:
    from a3po.models.factory import empty_like
    from a3po.rollout.torch_engine import RolloutEngine

    # The producer samples from its own copy of the policy, on the policy's device, in the engine's dtype
    # (e.g. bf16 beside an fp32 trainer): each version loads into it. A copy in an asked dtype computes
    # in that dtype (no autocast: bf16 weights already run bf16 kernels).
    engine_model = empty_like(policy, dtype.torch)
    engine_model.load_state_dict(state)
    return RolloutEngine(engine_model.eval(), tokenizer.eos_token_id, tokenizer.pad_token_id, version=version,
                         decoder=cfg.rollout.decoder, sampler=cfg.rollout.sampler)


def _build_vllm(policy: torch.nn.Module, tokenizer, state: dict[str, torch.Tensor], version: int, cfg: TrainConfig,
                dtype: DType) -> Engine:
    from a3po.rollout.vllm_engine import VllmEngine

    return VllmEngine.from_policy(
        policy, tokenizer, state, version,
        max_model_len=cfg.data.max_prompt_tokens + cfg.rl.max_new_tokens,
        dtype=dtype.value,
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


def build_engine(policy: torch.nn.Module, tokenizer, state: dict[str, torch.Tensor], version: int, cfg: TrainConfig,
                 dtype: DType | None = None) -> Engine:
    """The engine ``cfg.rollout.engine`` names, holding ``state`` as policy ``version``, its weights in
    ``dtype`` (the run plan's :attr:`~a3po.config.plan.RunPlan.engine_dtype`; None: ``rollout.dtype``,
    else the policy's own)."""
    spec = ROLLOUT_ENGINES.get(cfg.rollout.engine)
    why = spec.missing()
    if why is not None:
        raise RuntimeError(f"rollout.engine {spec.name!r} cannot run here: {why}")
    if dtype is None:
        dtype = cfg.rollout.dtype or DType(str(model_dtype(policy)).removeprefix("torch."))
    return spec.build(policy, tokenizer, state, version, cfg, dtype)
