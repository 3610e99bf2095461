"""Comparison arms: a variant (``sync`` / ``recompute`` / ``loglinear``) with an OPPO mode.

OPPO is an option of any run (docs/oppo.md), so the flows compare it like the variant: an arm is
named ``<variant>`` when OPPO is off and ``<variant>+oppo-<mode>`` otherwise, e.g.
``loglinear+oppo-inter``. The name is a function of the config (:func:`arm_name`), so a run's
folder, MLflow child run, table row and plot line all carry it, and :func:`arm_config` builds the
config of a name. The modes are a registry (name -> ``oppo`` section values); a mode the config
does not support (intra or both on the GRPO path, which has no scoring model) is refused when the
config is built, naming the field.

Placement is an axis too (:data:`PLACEMENTS`): ``colocated`` (generation in a thread of the
trainer process, sharing its cores) or ``disaggregated`` (generation in a rollout worker process
that owns its cores, the trainer on the rest: :mod:`a3po.placement.cores`). An arm on a
disaggregated config is named ``<arm>@disaggregated``; a bare name is colocated. Baselines are
taken within a placement: ``loglinear@disaggregated`` is compared with ``sync@disaggregated``.

``+`` and ``@`` are not allowed in MLflow metric keys: :func:`metric_key_part` writes an arm
inside one (``loglinear_oppo-inter``, ``loglinear_on_disaggregated``).
"""

from __future__ import annotations

from typing import Any, Callable

from a3po.config import DistributedConfig, OppoConfig, TrainConfig, Variant, with_overrides
from a3po.placement.cores import usable_cores
from a3po.registry import Registry

OPPO_MODES: Registry[dict[str, bool]] = Registry("OPPO mode")
for _name, _intra, _inter in (("off", False, False), ("intra", True, False), ("inter", False, True), ("both", True, True)):
    OPPO_MODES.register(_name)({"intra": _intra, "inter": _inter})

SEPARATOR = "+oppo-"
PLACED = "@"

# A placement: the ``distributed`` values it gives a config (from the config's own where set).
PLACEMENTS: Registry[Callable[[DistributedConfig], dict[str, int]]] = Registry("placement")


@PLACEMENTS.register("colocated")
def _colocated(d: DistributedConfig) -> dict[str, int]:
    return {"rollout_workers": 0, "rollout_cores": 0}


@PLACEMENTS.register("disaggregated")
def _disaggregated(d: DistributedConfig) -> dict[str, int]:
    # One worker owning half the cores of the machine that builds the comparison, unless the config
    # says otherwise. Beside DeepSpeed ranks the number of trainer ranks per node is the launch's,
    # unknown here: no pinning unless the config sets rollout_cores (the launch checks it fits).
    default = 0 if d.deepspeed_config is not None else max(1, usable_cores() // 2)
    return {"rollout_workers": d.rollout_workers or 1, "rollout_cores": d.rollout_cores or default}


def placement_of(cfg: TrainConfig) -> str:
    return "disaggregated" if cfg.distributed.rollout_workers else "colocated"


def oppo_mode(oppo: OppoConfig) -> str:
    """The registered mode whose switches ``oppo`` has."""
    for name in OPPO_MODES:
        if OPPO_MODES.get(name) == {"intra": oppo.intra, "inter": oppo.inter}:
            return name
    raise AssertionError(f"no OPPO mode for intra={oppo.intra}, inter={oppo.inter}")  # the four cover every pair


def arm_name(cfg: TrainConfig) -> str:
    mode = oppo_mode(cfg.oppo)
    name = cfg.rl.variant.value if mode == "off" else f"{cfg.rl.variant.value}{SEPARATOR}{mode}"
    placement = placement_of(cfg)
    return name if placement == "colocated" else f"{name}{PLACED}{placement}"


def split_placement(name: str) -> tuple[str, str | None]:
    """``(arm without its placement, placement or None)``; raises ValueError naming the valid placements."""
    arm, sep, placement = name.partition(PLACED)
    if sep and placement not in PLACEMENTS:
        raise ValueError(f"arm {name!r}: unknown placement {placement!r}; valid: {', '.join(PLACEMENTS.names())}")
    return arm, (placement if sep else None)


def parse_arm(name: str) -> tuple[str, str | None]:
    """``(variant, mode)``; mode None for a bare variant name (OPPO as the config has it). A
    placement suffix is checked (:func:`split_placement`) and left out.
    Raises ValueError naming the valid variants, modes or placements."""
    variant, sep, mode = split_placement(name)[0].partition(SEPARATOR)
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


def expand_arms(variants: list[str], modes: list[str] | None, placements: list[str] | None = None) -> list[str]:
    """Every variant with every OPPO mode (``modes`` None: the variants as given), each in every
    placement (``placements`` None: as the config says), in order."""
    for p in placements or []:
        if p not in PLACEMENTS:
            raise ValueError(f"unknown placement {p!r}; valid: {', '.join(PLACEMENTS.names())}")
    if modes is None:
        arms = list(dict.fromkeys(variants))
    else:
        for m in modes:
            if m not in OPPO_MODES:
                raise ValueError(f"unknown OPPO mode {m!r}; valid: {', '.join(OPPO_MODES.names())}")
        arms = list(dict.fromkeys(v if m == "off" else f"{v}{SEPARATOR}{m}" for v in variants for m in modes))
    if placements is None:
        return arms
    return list(dict.fromkeys(f"{a}{PLACED}{p}" for p in placements for a in arms))


def arm_config(base: TrainConfig, arm: str, seed: int, rl_overrides: dict[str, Any] | None = None) -> TrainConfig:
    """``base`` with the arm's variant, seed, ``rl_overrides`` and, when the name has a mode,
    its ``oppo`` switches (a bare variant keeps the base config's). An unsupported combination
    raises :class:`~a3po.config.ConfigError` here."""
    variant, mode = parse_arm(arm)
    placement = split_placement(arm)[1]
    sections: dict[str, Any] = {"rl": {**(rl_overrides or {}), "variant": variant, "seed": seed}}
    if mode is not None:
        sections["oppo"] = OPPO_MODES.get(mode)
    if placement is not None:
        sections["distributed"] = PLACEMENTS.get(placement)(base.distributed)
    return with_overrides(base, **sections)


def with_placement(arm: str, of: str) -> str:
    """``arm`` in the placement of the arm ``of`` (a baseline within its placement)."""
    placement = split_placement(of)[1]
    return arm if placement is None or placement == "colocated" else f"{arm}{PLACED}{placement}"


def metric_key_part(arm: str) -> str:
    """The arm as it appears inside an MLflow metric key (no ``+`` or ``@``)."""
    return arm.replace("+", "_").replace(PLACED, "_on_")
