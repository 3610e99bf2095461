"""Comparison arms: a variant (``sync`` / ``recompute`` / ``loglinear``) with an OPPO mode and a
placement, as one value (:class:`Arm`).

OPPO is an option of any run (docs/oppo.md), so the flows compare it like the variant; where
generation runs is an axis too: ``colocated`` (generation in a thread of the trainer process,
sharing its cores) or ``disaggregated`` (generation in a rollout worker process that owns its
cores, the trainer on the rest: :mod:`a3po.placement.cores`). The names of the modes and
placements are the library's (:mod:`a3po.config.axes`); what a placement sets in a comparison's
config is :data:`PLACEMENT_SETTINGS`. A mode or placement the config does not support (intra or
both on the GRPO path, which has no scoring model) is refused when the config is built, naming
the field. Baselines are taken within a placement: ``loglinear@disaggregated`` is compared with
``sync@disaggregated``.

An arm has one name, :attr:`Arm.name`: ``<variant>`` with OPPO off, ``<variant>+oppo-<mode>``
otherwise, plus ``@disaggregated`` off the default placement (``loglinear+oppo-inter@disaggregated``).
It is the MLflow child run's name and the run folder's, the table's row and the plot's line; it is
written by :attr:`Arm.name` and read by :meth:`Arm.parse` (the command line's ``--candidate``, a
record read back), and nowhere else. ``+`` and ``@`` are not allowed in MLflow metric keys:
:func:`metric_key_part` writes a name inside one (``loglinear_oppo-inter``, ``loglinear_on_disaggregated``).
"""

from __future__ import annotations

from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, model_validator

from a3po.config import DistributedConfig, TrainConfig, Variant, with_overrides
from a3po.config.axes import OPPO_MODES, PLACEMENTS, OppoMode, Placement, oppo_mode, placement_of
from a3po.placement.cores import usable_cores
from a3po.registry import Registry
from tasks.verdicts import NothingToJudge

SEPARATOR = "+oppo-"
PLACED = "@"

# What a placement sets in a comparison's config: the ``distributed`` values (from the config's own where set).
PLACEMENT_SETTINGS: Registry[Callable[[DistributedConfig], dict[str, int]]] = Registry("placement")


@PLACEMENT_SETTINGS.register("colocated")
def _colocated(d: DistributedConfig) -> dict[str, int]:
    return {"rollout_workers": 0, "rollout_cores": 0}


@PLACEMENT_SETTINGS.register("disaggregated")
def _disaggregated(d: DistributedConfig) -> dict[str, int]:
    # One worker owning half the cores of the machine that builds the comparison, unless the config
    # says otherwise. Beside DeepSpeed ranks the number of trainer ranks per node is the launch's,
    # unknown here: no pinning unless the config sets rollout_cores (the launch checks it fits).
    default = 0 if d.deepspeed_config is not None else max(1, usable_cores() // 2)
    return {"rollout_workers": d.rollout_workers or 1, "rollout_cores": d.rollout_cores or default}


assert tuple(PLACEMENT_SETTINGS) == tuple(sorted(PLACEMENTS)), "every placement of a3po.config.axes has its settings"


class Arm(BaseModel):
    """One arm of a comparison. ``oppo`` / ``placement`` None: as the base config has them (the
    arm a bare variant name gives); :meth:`of` gives the arm a config runs, with both filled in.
    Built from its fields or from its name (a string is parsed: ``"loglinear+oppo-inter"``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    variant: Variant
    oppo: OppoMode | None = None  # OPPO mode (a3po.config.axes.OPPO_MODES); None: the base config's
    placement: Placement | None = None  # where generation runs (a3po.config.axes.PLACEMENTS); None: the base config's

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, value: Any) -> Any:
        return _fields_of(value) if isinstance(value, str) else value

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: Any, handler: Any) -> dict[str, Any]:
        # A deployment names an arm by its name (infra/prefect.yaml: `candidate: loglinear`), and a
        # Prefect server checks deployment parameters against this schema: a name is valid too.
        name = {"type": "string", "title": "Arm name", "description": "e.g. loglinear, loglinear+oppo-inter@disaggregated"}
        return {"anyOf": [name, handler(core_schema)]}

    @classmethod
    def parse(cls, name: str) -> Arm:
        """The arm of a name; raises ValueError naming the valid variants, modes or placements."""
        return cls(**_fields_of(name))

    @classmethod
    def of(cls, cfg: TrainConfig) -> Arm:
        """The arm ``cfg`` runs (every field filled in)."""
        return cls(variant=cfg.rl.variant, oppo=oppo_mode(cfg.oppo), placement=placement_of(cfg.distributed))

    @property
    def name(self) -> str:
        """``<variant>[+oppo-<mode>][@<placement>]``: OPPO off and colocated are left out."""
        oppo = "" if self.oppo in (None, "off") else f"{SEPARATOR}{self.oppo}"
        placed = "" if self.placement in (None, "colocated") else f"{PLACED}{self.placement}"
        return f"{self.variant.value}{oppo}{placed}"

    def __str__(self) -> str:
        return self.name

    def config(self, base: TrainConfig, seed: int, rl_overrides: dict[str, Any] | None = None) -> TrainConfig:
        """``base`` with the arm's variant, seed, ``rl_overrides``, and its OPPO switches and
        placement where the arm sets them. An unsupported combination raises
        :class:`~a3po.config.ConfigError` here."""
        sections: dict[str, Any] = {"rl": {**(rl_overrides or {}), "variant": self.variant.value, "seed": seed}}
        if self.oppo is not None:
            sections["oppo"] = OPPO_MODES.get(self.oppo)
        if self.placement is not None:
            sections["distributed"] = PLACEMENT_SETTINGS.get(self.placement)(base.distributed)
        return with_overrides(base, **sections)

    def within(self, other: Arm) -> Arm:
        """This arm in the placement of ``other`` (a baseline within its placement)."""
        return self.model_copy(update={"placement": other.placement})

    @property
    def metric_key(self) -> str:
        return metric_key_part(self.name)


def _fields_of(name: str) -> dict[str, Any]:
    """The fields an arm's name gives, checked against the valid variants, modes and placements."""
    rest, placed, placement = name.partition(PLACED)
    if placed and placement not in PLACEMENTS:
        raise ValueError(f"arm {name!r}: unknown placement {placement!r}; valid: {', '.join(PLACEMENTS)}")
    variant, sep, mode = rest.partition(SEPARATOR)
    if variant not in {v.value for v in Variant}:
        valid = ", ".join(repr(v.value) for v in Variant)
        raise ValueError(f"arm {name!r}: rl.variant: expected one of {valid}, got {variant!r} "
                         f"(an arm is <variant>[{SEPARATOR}<mode>][{PLACED}<placement>])")
    if sep and mode not in OPPO_MODES:
        raise ValueError(f"arm {name!r}: unknown OPPO mode {mode!r}; valid: {', '.join(OPPO_MODES.names())}")
    return {"variant": variant, "oppo": mode if sep else None, "placement": placement if placed else None}


def expand_arms(variants: list[str], modes: list[str] | None, placements: list[str] | None = None) -> list[Arm]:
    """Every variant with every OPPO mode (``modes`` None: as the config says), each in every
    placement (``placements`` None: as the config says), in order, without repeats. An empty list
    of any of them raises: it would leave nothing to compare, and a comparison of nothing passes."""
    for option, names in (("variants", variants), ("OPPO modes", modes), ("placements", placements)):
        if names is not None and not names:
            raise NothingToJudge(f"no {option} given (an empty list): a comparison needs at least one arm")
    for p in placements or []:
        if p not in PLACEMENTS:
            raise ValueError(f"unknown placement {p!r}; valid: {', '.join(PLACEMENTS)}")
    for m in modes or []:
        if m not in OPPO_MODES:
            raise ValueError(f"unknown OPPO mode {m!r}; valid: {', '.join(OPPO_MODES.names())}")
    arms = [Arm.parse(v).model_copy(update={"oppo": m}) for v in variants for m in (modes or [None])]
    placed = [a.model_copy(update={"placement": p}) for p in (placements or [None]) for a in arms]
    return list(dict.fromkeys(placed))


def metric_key_part(name: str) -> str:
    """An arm's name as it appears inside an MLflow metric key (no ``+`` or ``@``)."""
    return name.replace("+", "_").replace(PLACED, "_on_")
