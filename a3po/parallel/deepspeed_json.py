"""The DeepSpeed JSON the trainer accepts: ZeRO stage and precision only. Batch sizes and
clipping are derived from ``rl.*`` (:class:`a3po.parallel.updaters.DeepSpeedUpdater`), not
duplicated, so a JSON that sets them is refused with the file and the key named."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, Mapping

INSTALL_HINT = "pip install -e '.[distributed]'"
SUPPORTED_ZERO_STAGES = (1, 2, 3)
# Keys the trainer derives (from rl.*) or owns (optimizer, lr schedule): a JSON setting them would
# silently disagree with the config, so it is refused.
_DERIVED_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_OWNED_KEYS = ("optimizer", "scheduler")


def deepspeed_available() -> bool:
    """Whether ``import deepspeed`` can succeed, without paying for the import (seconds)."""
    try:
        return importlib.util.find_spec("deepspeed") is not None
    except (ImportError, ValueError):
        return False


def read_deepspeed_json(path: str | Path, grad_clip: float) -> dict[str, Any]:
    """Load and check a DeepSpeed JSON for the trainer; errors name the file and the key."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"distributed.deepspeed_config: {p} does not exist")
    try:
        ds = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(ds, dict):
        raise ValueError(f"{p}: expected a JSON object at the top level")
    for key in _DERIVED_KEYS:
        if key in ds:
            raise ValueError(f"{p}: '{key}' is derived from rl.batch_prompts x rl.group_size / rl.minibatches and the world size; remove it")
    for key in _OWNED_KEYS:
        if key in ds:
            raise ValueError(f"{p}: '{key}' is set by the trainer (torch AdamW from rl.lr, schedule a3po.training.loop.learning_rate); remove it")
    if "gradient_clipping" in ds and float(ds["gradient_clipping"]) != float(grad_clip):
        raise ValueError(f"{p}: gradient_clipping {ds['gradient_clipping']} disagrees with rl.grad_clip {grad_clip}; remove it or make them equal")
    stage = zero_stage(ds)
    if stage not in SUPPORTED_ZERO_STAGES:
        raise ValueError(f"{p}: zero_optimization.stage must be one of {SUPPORTED_ZERO_STAGES}, got {stage!r}")
    if ds.get("fp16", {}).get("enabled"):
        raise ValueError(f"{p}: fp16 is not supported (dynamic loss scaling skips steps); use bf16 or fp32")
    return ds


def zero_stage(ds: Mapping[str, Any]) -> int:
    return ds.get("zero_optimization", {}).get("stage", 0)
