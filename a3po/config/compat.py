"""What identifies a run's inputs across versions: the cache keys of the warm start and the
datasets, and which config changes a checkpoint may be resumed with. Fields added later are
keyed or compared so that caches and checkpoints made before them keep working."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from a3po.config.data import ArithmeticDifficulty, DataConfig
from a3po.config.loading import config_to_dict
from a3po.config.plan import decoding_dtype
from a3po.config.train import RENAMED_FIELDS, TrainConfig
from a3po.devices import machine_precision, resolve_device

# Data fields added after cache keys were first published, with their defaults: left out of the
# keys while at the default, so warm-start and dataset caches made before them keep their names.
_DATA_FIELDS_KEYED_WHEN_SET = {"prompt_format": "auto", "instruction": "", "prompt_field": "prompt",
                               "gold_field": "gold",
                               "long_tail_frac": ArithmeticDifficulty.long_tail_frac,
                               "long_tail_steps": ArithmeticDifficulty.long_tail_steps}


def data_identity(data: DataConfig) -> dict[str, Any]:
    """The data config as cache keys hash it (see :data:`_DATA_FIELDS_KEYED_WHEN_SET`)."""
    return {k: v for k, v in dataclasses.asdict(data).items() if _DATA_FIELDS_KEYED_WHEN_SET.get(k, object()) != v}


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
RESUME_NEUTRAL_FIELDS = ("output_dir", "torch_threads", "update_threads", "generate_threads",
                         "distributed.rollout_workers",
                         "distributed.rollout_cores", "rl.log_completions", "rl.eval_mode")


# Fields added with a default that computes differently from the code before them: a saved
# config that lacks one was run the old way, so it counts as this value (resuming it under the
# new default is then refused, naming the field, rather than silently changing the run).
FIELDS_BEFORE_THEY_EXISTED = {"rl": {"shared_prompt_forward": False}}


def _with_new_names(saved: dict[str, Any]) -> dict[str, Any]:
    """``saved`` with the fields of :data:`RENAMED_FIELDS` under their new names."""
    out = dict(saved)
    for old, new in RENAMED_FIELDS.items():
        section, old_key = old.split(".")
        if isinstance(out.get(section), dict) and old_key in out[section]:
            out[section] = {(new.split(".")[1] if k == old_key else k): v for k, v in out[section].items()}
    return out


def config_differences(saved: dict[str, Any], current: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted names of the fields whose values differ between two :func:`config_to_dict`
    results (fields in :data:`RESUME_NEUTRAL_FIELDS` aside), e.g. ``["rl.lr", "rl.steps"]``.
    A field the saved config lacks (added in a later version) counts as its default, or as its
    value in :data:`FIELDS_BEFORE_THEY_EXISTED`."""
    if not prefix:
        saved = _with_defaults(_with_defaults(_with_new_names(saved), FIELDS_BEFORE_THEY_EXISTED),
                               config_to_dict(TrainConfig()))
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


def warmstart_key(cfg: TrainConfig, inputs: dict[str, str]) -> str:
    """The warm start's cache key: a hash of what determines its weights and its held-out
    figure, so every variant and seed of a comparison shares one warm start. ``inputs`` are the
    content hashes of the files the config names (:func:`a3po.training.inputs.input_hashes`):
    a model folder replaced or a dataset edited under the same path is another warm start."""
    # The held-out measure depends on the RL sampling settings, so they are part of the key.
    measure = {k: getattr(cfg.rl, k) for k in ("temperature", "eval_samples", "max_new_tokens")}
    # LoRA applies after the warm start (full fine-tuning either way): runs with and without it share one.
    model = {k: v for k, v in dataclasses.asdict(cfg.model).items() if k != "lora"}
    parts = {"model": model, "data": data_identity(cfg.data),
             "warm_start": dataclasses.asdict(cfg.warm_start), "measure": measure}
    if inputs:  # none for a built-in model on the embedded task: those keys stay as they were
        parts["inputs"] = inputs
    # Another device or precision trains other weights, and the held-out figure decodes from weights
    # in the run's decoding dtype. CPU fp32 is left out of the key, so caches made before devices were
    # configurable keep their names; dtype auto counts as what it resolves to here (fp32 where bf16 is
    # emulated: the same weights as float32, the same cache).
    device = resolve_device(cfg.device)
    precision = machine_precision(cfg.dtype, device)
    runtime = {"device": device.type, "dtype": precision.name, "decoding": decoding_dtype(cfg, precision).value}
    if runtime != {"device": "cpu", "dtype": "float32", "decoding": "float32"}:
        parts["runtime"] = runtime
    blob = json.dumps(parts, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
