"""Comparison arms: a variant (``sync`` / ``recompute`` / ``loglinear``) with an OPPO mode, a
staleness bound and a placement, as one value (:class:`Arm`).

OPPO is an option of any run (docs/oppo.md), so the flows compare it like the variant; where
generation runs is an axis too: ``colocated`` (generation in a thread of the trainer process,
sharing its cores) or ``disaggregated`` (generation in a rollout worker process that owns its
cores, the trainer on the rest: :mod:`a3po.placement.cores`). The names of the modes and
placements are the library's (:mod:`a3po.config.axes`); what a placement sets in a comparison's
config is :data:`PLACEMENT_SETTINGS`. A mode or placement the config does not support (intra or
both on the GRPO path, which has no scoring model) is refused when the config is built, naming
the field. Baselines are taken within a placement: ``loglinear@disaggregated`` is compared with
``sync@disaggregated``.

The staleness bound of an asynchronous variant is an axis too (docs/variants.md): ``+s<N>``, a fixed
bound ``rl.max_staleness: N``; ``+adaptive``, ``rl.staleness_control: adaptive`` moving the bound
within ``[1, rl.max_staleness]`` (``+adaptive-s<N>``: within ``[1, N]``). The bound moves only under
the threaded schedule, so an adaptive arm sets ``rl.schedule: threaded``; compare it with fixed bounds
under the same schedule (``--set rl.schedule=threaded``). A name leaves out the default, a fixed
bound of :data:`DEFAULT_BOUND` (``loglinear`` is ``loglinear+s2``); sync has no bound to vary.

An arm has one name, :attr:`Arm.name`: ``<variant>`` with OPPO off, ``<variant>+oppo-<mode>``
otherwise, then ``+s<N>`` or ``+adaptive[-s<N>]`` off the default bound, plus ``@disaggregated`` off
the default placement (``loglinear+oppo-inter+s4@disaggregated``).
It is the MLflow child run's name and the run folder's, the table's row and the plot's line; it is
written by :attr:`Arm.name` and read by :meth:`Arm.parse` (the command line's ``--candidate`` and
``--variants``, a record read back), and nowhere else. ``+`` and ``@`` are not allowed in MLflow metric keys:
:func:`metric_key_part` writes a name inside one (``loglinear_oppo-inter``, ``loglinear_on_disaggregated``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from a3po.algorithms.staleness import STALENESS_CONTROLS
from a3po.config import DistributedConfig, RLConfig, TrainConfig, Variant, with_overrides
from a3po.config.axes import OPPO_MODES, PLACEMENTS, OppoMode, Placement, oppo_mode, placement_of
from a3po.placement.cores import usable_cores
from a3po.registry import Registry
from tasks.verdicts import NothingToJudge

SEPARATOR = "+oppo-"
PLACED = "@"
# The bound a name leaves out: RLConfig's default, the one the presets run.
DEFAULT_BOUND: int = next(f.default for f in dataclasses.fields(RLConfig) if f.name == "max_staleness")
_FIXED = re.compile(r"s(0|[1-9][0-9]*)")
_ADAPTIVE = re.compile(r"adaptive(?:-s(0|[1-9][0-9]*))?")
GRAMMAR = f"<variant>[{SEPARATOR}<mode>][+s<N>|+adaptive[-s<N>]][{PLACED}<placement>]"

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
    """One arm of a comparison. ``oppo`` / ``staleness_control`` / ``max_staleness`` / ``placement``
    None: as the base config has them (the arm a bare variant name gives); :meth:`of` gives the arm a
    config runs, with all of them filled in. Built from its fields or from its name (a string is
    parsed: ``"loglinear+oppo-inter"``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    variant: Variant
    oppo: OppoMode | None = None  # OPPO mode (a3po.config.axes.OPPO_MODES); None: the base config's
    # rl.staleness_control (a3po.algorithms.staleness.STALENESS_CONTROLS); None: the base config's
    staleness_control: str | None = None
    max_staleness: int | None = Field(default=None, ge=0)  # rl.max_staleness; None: the base config's
    placement: Placement | None = None  # where generation runs (a3po.config.axes.PLACEMENTS); None: the base config's

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, value: Any) -> Any:
        return _fields_of(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _a_bound_to_vary(self) -> Arm:
        if self.staleness_control is not None and self.staleness_control not in STALENESS_CONTROLS:
            raise ValueError(f"unknown staleness control {self.staleness_control!r}; valid: "
                             f"{', '.join(STALENESS_CONTROLS.names())}")
        if not self.variant.is_async and (self.staleness_control, self.max_staleness) != (None, None):
            raise ValueError(f"arm {self.variant.value!r} with a staleness bound: {self.variant.value} trains on-policy "
                             "(bound 0); the staleness axis is the asynchronous variants' (recompute, loglinear)")
        return self

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: Any, handler: Any) -> dict[str, Any]:
        # A deployment names an arm by its name (infra/prefect.yaml: `candidate: loglinear`), and a
        # Prefect server checks deployment parameters against this schema: a name is valid too.
        name = {"type": "string", "title": "Arm name",
                "description": "e.g. loglinear, loglinear+oppo-inter@disaggregated, loglinear+s4, loglinear+adaptive"}
        return {"anyOf": [name, handler(core_schema)]}

    @classmethod
    def parse(cls, name: str) -> Arm:
        """The arm of a name; raises ValueError naming the valid variants, modes, bounds or placements."""
        return cls(**_fields_of(name))

    @classmethod
    def of(cls, cfg: TrainConfig) -> Arm:
        """The arm ``cfg`` runs (every field filled in; sync has no staleness bound to vary)."""
        rl = cfg.rl
        control, bound = (rl.staleness_control, rl.max_staleness) if rl.variant.is_async else (None, None)
        return cls(variant=rl.variant, oppo=oppo_mode(cfg.oppo), staleness_control=control, max_staleness=bound,
                   placement=placement_of(cfg.distributed))

    @property
    def adaptive(self) -> bool:
        return self.staleness_control is not None and STALENESS_CONTROLS.get(self.staleness_control).adapts

    @property
    def name(self) -> str:
        """``<variant>[+oppo-<mode>][+s<N>|+adaptive[-s<N>]][@<placement>]``: OPPO off, a fixed bound
        of :data:`DEFAULT_BOUND` and colocated are left out."""
        oppo = "" if self.oppo in (None, "off") else f"{SEPARATOR}{self.oppo}"
        bound = "" if self.max_staleness in (None, DEFAULT_BOUND) else f"s{self.max_staleness}"
        staleness = f"+adaptive{'-' if bound else ''}{bound}" if self.adaptive else f"+{bound}" if bound else ""
        placed = "" if self.placement in (None, "colocated") else f"{PLACED}{self.placement}"
        return f"{self.variant.value}{oppo}{staleness}{placed}"

    def __str__(self) -> str:
        return self.name

    def config(self, base: TrainConfig, seed: int, rl_overrides: dict[str, Any] | None = None) -> TrainConfig:
        """``base`` with the arm's variant, seed, ``rl_overrides``, and its OPPO switches, staleness
        bound and control, and placement where the arm sets them (an adaptive arm runs the threaded
        schedule, the one its bound can move under). An unsupported combination raises
        :class:`~a3po.config.ConfigError` here."""
        rl: dict[str, Any] = {**(rl_overrides or {}), "variant": self.variant.value, "seed": seed}
        if self.max_staleness is not None:
            rl["max_staleness"] = self.max_staleness
        if self.staleness_control is not None:
            rl["staleness_control"] = self.staleness_control
        if self.adaptive:
            rl["schedule"] = "threaded"
        sections: dict[str, Any] = {"rl": rl}
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
    """The fields an arm's name gives, checked against the valid variants, modes, bounds and placements."""
    rest, placed, placement = name.partition(PLACED)
    if placed and placement not in PLACEMENTS:
        raise ValueError(f"arm {name!r}: unknown placement {placement!r}; valid: {', '.join(PLACEMENTS)}")
    variant, *parts = rest.split("+")
    if variant not in {v.value for v in Variant}:
        valid = ", ".join(repr(v.value) for v in Variant)
        raise ValueError(f"arm {name!r}: rl.variant: expected one of {valid}, got {variant!r} (an arm is {GRAMMAR})")
    fields: dict[str, Any] = {"variant": variant, "oppo": None, "placement": placement if placed else None}
    axes: list[str] = []
    for part in parts:
        fixed, adaptive = _FIXED.fullmatch(part), _ADAPTIVE.fullmatch(part)
        if part.startswith(SEPARATOR[1:]):
            axis, mode = "OPPO mode", part[len(SEPARATOR) - 1:]
            if mode not in OPPO_MODES:
                raise ValueError(f"arm {name!r}: unknown OPPO mode {mode!r}; valid: {', '.join(OPPO_MODES.names())}")
            fields["oppo"] = mode
        elif fixed or adaptive:
            axis = "staleness bound"
            fields["max_staleness"] = int(fixed.group(1)) if fixed else (int(adaptive.group(1)) if adaptive.group(1) else None)
            if adaptive:
                fields["staleness_control"] = "adaptive"
        else:
            raise ValueError(f"arm {name!r}: {part!r} is neither an OPPO mode ({SEPARATOR[1:]}<mode>) nor a staleness "
                             f"bound (s<N>, adaptive, adaptive-s<N>); an arm is {GRAMMAR}")
        if axis in axes:
            raise ValueError(f"arm {name!r}: two parts name its {axis}; an arm is {GRAMMAR}")
        axes.append(axis)
    return fields


def expand_arms(variants: list[str | Arm], modes: list[str] | None, placements: list[str] | None = None) -> list[Arm]:
    """Every variant (or arm, by name: ``loglinear+s4``) with every OPPO mode (``modes`` None: as the
    config says), each in every placement (``placements`` None: as the config says), in order, without
    repeats; a name that gives its own mode or placement keeps it. An empty list of any of them
    raises: it would leave nothing to compare, and a comparison of nothing passes."""
    for option, names in (("variants", variants), ("OPPO modes", modes), ("placements", placements)):
        if names is not None and not names:
            raise NothingToJudge(f"no {option} given (an empty list): a comparison needs at least one arm")
    for p in placements or []:
        if p not in PLACEMENTS:
            raise ValueError(f"unknown placement {p!r}; valid: {', '.join(PLACEMENTS)}")
    for m in modes or []:
        if m not in OPPO_MODES:
            raise ValueError(f"unknown OPPO mode {m!r}; valid: {', '.join(OPPO_MODES.names())}")
    # A name that says its mode or placement (loglinear+oppo-inter) keeps it; the lists apply to the others.
    parsed = [v if isinstance(v, Arm) else Arm.parse(v) for v in variants]
    arms = [a if a.oppo is not None else a.model_copy(update={"oppo": m}) for a in parsed for m in (modes or [None])]
    placed = [a if a.placement is not None else a.model_copy(update={"placement": p}) for p in (placements or [None])
              for a in arms]
    return list(dict.fromkeys(placed))


def metric_key_part(name: str) -> str:
    """An arm's name as it appears inside an MLflow metric key (no ``+`` or ``@``)."""
    return name.replace("+", "_").replace(PLACED, "_on_")
