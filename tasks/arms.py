"""Comparison arms: a variant (``sync`` / ``recompute`` / ``loglinear``) with an OPPO mode.

OPPO is an option of any run (docs/oppo.md), so the flows compare it like the variant: an arm is
named ``<variant>`` when OPPO is off and ``<variant>+oppo-<mode>`` otherwise, e.g.
``loglinear+oppo-inter``. The name is a function of the config (:func:`arm_name`), so a run's
folder, MLflow child run, table row and plot line all carry it, and :func:`arm_config` builds the
config of a name. The modes are a registry (name -> ``oppo`` section values); a mode the config
does not support (intra or both on the GRPO path, which has no scoring model) is refused when the
config is built, naming the field.

``+`` is not allowed in MLflow metric keys: :func:`metric_key_part` writes an arm inside one
(``loglinear_oppo-inter``).
"""

from __future__ import annotations

from typing import Any

from a3po.config import OppoConfig, TrainConfig, Variant, with_overrides
from a3po.registry import Registry

OPPO_MODES: Registry[dict[str, bool]] = Registry("OPPO mode")
for _name, _intra, _inter in (("off", False, False), ("intra", True, False), ("inter", False, True), ("both", True, True)):
    OPPO_MODES.register(_name)({"intra": _intra, "inter": _inter})

SEPARATOR = "+oppo-"


def oppo_mode(oppo: OppoConfig) -> str:
    """The registered mode whose switches ``oppo`` has."""
    for name in OPPO_MODES:
        if OPPO_MODES.get(name) == {"intra": oppo.intra, "inter": oppo.inter}:
            return name
    raise AssertionError(f"no OPPO mode for intra={oppo.intra}, inter={oppo.inter}")  # the four cover every pair


def arm_name(cfg: TrainConfig) -> str:
    mode = oppo_mode(cfg.oppo)
    return cfg.rl.variant.value if mode == "off" else f"{cfg.rl.variant.value}{SEPARATOR}{mode}"


def parse_arm(name: str) -> tuple[str, str | None]:
    """``(variant, mode)``; mode None for a bare variant name (OPPO as the config has it).
    Raises ValueError naming the valid variants or modes."""
    variant, sep, mode = name.partition(SEPARATOR)
    try:
        Variant(variant)
    except ValueError:
        valid = ", ".join(repr(v.value) for v in Variant)
        raise ValueError(f"arm {name!r}: rl.variant: expected one of {valid}, got {variant!r} "
                         f"(an arm is <variant> or <variant>{SEPARATOR}<mode>)") from None
    if not sep:
        return variant, None
    if mode not in OPPO_MODES:
        raise ValueError(f"arm {name!r}: unknown OPPO mode {mode!r}; valid: {', '.join(OPPO_MODES.names())}")
    return variant, mode


def expand_arms(variants: list[str], modes: list[str] | None) -> list[str]:
    """Every variant with every OPPO mode (``modes`` None: the variants as given), in order."""
    if modes is None:
        return list(dict.fromkeys(variants))
    for m in modes:
        if m not in OPPO_MODES:
            raise ValueError(f"unknown OPPO mode {m!r}; valid: {', '.join(OPPO_MODES.names())}")
    return list(dict.fromkeys(v if m == "off" else f"{v}{SEPARATOR}{m}" for v in variants for m in modes))


def arm_config(base: TrainConfig, arm: str, seed: int, rl_overrides: dict[str, Any] | None = None) -> TrainConfig:
    """``base`` with the arm's variant, seed, ``rl_overrides`` and, when the name has a mode,
    its ``oppo`` switches (a bare variant keeps the base config's). An unsupported combination
    raises :class:`~a3po.config.ConfigError` here."""
    variant, mode = parse_arm(arm)
    sections: dict[str, Any] = {"rl": {**(rl_overrides or {}), "variant": variant, "seed": seed}}
    if mode is not None:
        sections["oppo"] = OPPO_MODES.get(mode)
    return with_overrides(base, **sections)


def metric_key_part(arm: str) -> str:
    """The arm as it appears inside an MLflow metric key (no ``+``)."""
    return arm.replace("+", "_")
