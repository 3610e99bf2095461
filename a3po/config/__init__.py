"""Typed configs for training, loadable from YAML. Invalid values raise when the config is
built; derived values (e.g. the effective staleness bound of a variant) are functions, never
written back into the config.

* the sections, frozen dataclasses that check their ranges and cross-field rules when built, one module each:
  :mod:`~a3po.config.model` (model, LoRA), :mod:`~a3po.config.data` (data, warm start), :mod:`~a3po.config.rl`
  (rl, with the guard's, staleness control's, rollout correction's and the group filter's rules),
  :mod:`~a3po.config.ppo`, :mod:`~a3po.config.rollout` (rollout engine, OPPO), :mod:`~a3po.config.distributed`, and
  :mod:`~a3po.config.train` (:class:`TrainConfig`, the rules across sections, the renamed fields);
  :mod:`~a3po.config.errors` holds :class:`ConfigError` and the bounds they share;
* :mod:`~a3po.config.loading`  YAML files, dicts and overrides -> a checked :class:`TrainConfig`;
* :mod:`~a3po.config.compat`   cache keys and which config changes a checkpoint resumes with;
* :mod:`~a3po.config.presets`  the built-in configs by name;
* :mod:`~a3po.config.axes`     the names of the placements and OPPO modes (the library's, the flags' and the arms');
* :mod:`~a3po.config.plan`     what a config means for a run (the bound in force, the proximal method, the
  placement, ...), resolved once where the run starts (:class:`RunPlan`);
* :mod:`~a3po.config.preflight` what a config needs of the machine it runs on (packages, the DeepSpeed JSON),
  checked where training starts, not when the config is built.
"""

from a3po.config.compat import (
    FIELDS_BEFORE_THEY_EXISTED,
    RESUME_NEUTRAL_FIELDS,
    config_differences,
    data_identity,
    warmstart_key,
)
from a3po.config.data import ArithmeticDifficulty, DataConfig, WarmStartConfig
from a3po.config.distributed import DistributedConfig
from a3po.config.errors import ConfigError
from a3po.config.loading import (
    config_from_dict,
    config_to_dict,
    load_config,
    load_yaml,
    merge_yaml,
    with_overrides,
)
from a3po.config.model import LoraConfig, ModelConfig
from a3po.config.plan import RunPlan
from a3po.config.ppo import PPOConfig
from a3po.config.preflight import preflight
from a3po.config.presets import PRESETS, preset
from a3po.config.rl import (
    RLConfig,
    Variant,
    correction_settings,
    effective_max_staleness,
    filter_settings,
    proximal_method_name,
    staleness_settings,
)
from a3po.config.rollout import OppoConfig, RolloutConfig, mid_batch_updates
from a3po.config.train import TrainConfig

__all__ = [
    "ArithmeticDifficulty", "FIELDS_BEFORE_THEY_EXISTED", "PRESETS", "RESUME_NEUTRAL_FIELDS", "ConfigError",
    "DataConfig", "DistributedConfig", "LoraConfig", "ModelConfig", "OppoConfig", "PPOConfig", "RLConfig",
    "RolloutConfig", "RunPlan", "TrainConfig", "Variant", "WarmStartConfig", "config_differences", "config_from_dict",
    "config_to_dict", "correction_settings", "data_identity", "effective_max_staleness", "filter_settings",
    "load_config", "load_yaml", "merge_yaml", "mid_batch_updates", "preset", "proximal_method_name", "preflight",
    "staleness_settings", "warmstart_key", "with_overrides",
]
