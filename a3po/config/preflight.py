"""Checks of the environment a config will run in, kept out of the config's value objects: a
config valid for GPU workers must build on the machine that submits it. :func:`preflight` runs
where training starts (``a3po train``, :func:`a3po.training.run.train_variant`) and, for local
runs, where a comparison checks its arms' configs. It looks for packages with
``importlib.util.find_spec`` (no import: importing DeepSpeed or vLLM takes seconds) and reads
the DeepSpeed JSON with :mod:`json`; nothing above config is imported."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, Mapping

from a3po.catalog import MODEL_SOURCE_NAMES, ROLLOUT_ENGINE_NAMES
from a3po.config.errors import ConfigError
from a3po.config.train import TrainConfig

INSTALL_HINT = "pip install -e '.[distributed]'"
SUPPORTED_ZERO_STAGES = (1, 2, 3)
# Keys the trainer derives (from rl.*) or owns (optimizer, lr schedule): a JSON setting them would
# silently disagree with the config, so it is refused.
_DERIVED_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_OWNED_KEYS = ("optimizer", "scheduler")


def module_available(name: str) -> bool:
    """Whether ``import name`` can find the package, without paying for the import."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module hidden (sys.modules[name] = None)
        return False


def deepspeed_available() -> bool:
    return module_available("deepspeed")


def read_deepspeed_json(path: str | Path, grad_clip: float) -> dict[str, Any]:
    """Load and check a DeepSpeed JSON for the trainer; errors name the file and the key."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"distributed.deepspeed_config: {p} does not exist")
    try:
        ds = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(ds, dict):
        raise ConfigError(f"{p}: expected a JSON object at the top level")
    for key in _DERIVED_KEYS:
        if key in ds:
            raise ConfigError(f"{p}: '{key}' is derived from rl.batch_prompts x rl.group_size / rl.minibatches and "
                              "the world size; remove it")
    for key in _OWNED_KEYS:
        if key in ds:
            raise ConfigError(
                f"{p}: '{key}' is set by the trainer (torch AdamW from rl.lr, schedule "
                "a3po.training.lr_schedule.learning_rate); remove it"
            )
    for key in ("zero_optimization", "fp16", "bf16"):
        if not isinstance(ds.get(key, {}), dict):
            raise ConfigError(f"{p}: '{key}' must be a JSON object, got {json.dumps(ds[key])[:80]}")
    clip = ds.get("gradient_clipping", grad_clip)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or float(clip) != float(grad_clip):
        raise ConfigError(f"{p}: gradient_clipping {clip} disagrees with rl.grad_clip {grad_clip}; "
                          "remove it or make them equal")
    stage = zero_stage(ds)
    if stage not in SUPPORTED_ZERO_STAGES:
        raise ConfigError(f"{p}: zero_optimization.stage must be one of {SUPPORTED_ZERO_STAGES}, got {stage!r}")
    if ds.get("fp16", {}).get("enabled"):
        raise ConfigError(f"{p}: fp16 is not supported (dynamic loss scaling skips steps); use bf16 or fp32")
    return ds


def zero_stage(ds: Mapping[str, Any]) -> int:
    return ds.get("zero_optimization", {}).get("stage", 0)


def preflight(cfg: TrainConfig) -> TrainConfig:
    """``cfg``, once what it needs here is present: a named model's package, the rollout engine's
    package, DeepSpeed and a DeepSpeed JSON the trainer accepts; else :class:`ConfigError` saying
    what is missing and how to install it."""
    if cfg.model.name in MODEL_SOURCE_NAMES:
        source = MODEL_SOURCE_NAMES.get(cfg.model.name)
        missing = [m for m in source.needs_modules if not module_available(m)]
        if missing:
            raise ConfigError(f"model.name {source.name!r} needs {', '.join(missing)}, which is not "
                              f"installed: {source.install_hint}")
    engine = ROLLOUT_ENGINE_NAMES.get(cfg.rollout.engine)
    if engine.needs_module is not None and not module_available(engine.needs_module):
        raise ConfigError(f"rollout.engine {engine.name!r}: {engine.label} is not installed; {engine.install_hint}")
    ds = cfg.distributed.deepspeed_config
    if ds is not None:
        if not deepspeed_available():
            raise ConfigError(f"distributed.deepspeed_config is set but DeepSpeed is not installed: {INSTALL_HINT}")
        read_deepspeed_json(ds, cfg.rl.grad_clip)
    return cfg
