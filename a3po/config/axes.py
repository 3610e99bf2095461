"""The names of the run settings a comparison varies besides the variant, defined once: where
rollouts are generated (the placement) and which halves of OPPO are on (the OPPO mode).

The library (the placement registry, :class:`a3po.config.plan.RunPlan`), the comparison flows
(``tasks.arms``: ``--placements``, ``--oppo``, arm names such as ``loglinear+oppo-inter@disaggregated``,
the MLflow tags ``a3po.placement`` and ``a3po.oppo``) and the compatibility matrix
(``infra.compat_matrix``) all read these names from here.

Placements:

* ``colocated`` (``distributed.rollout_workers: 0``): generation in a thread of each trainer
  process, sharing its cores;
* ``disaggregated`` (``rollout_workers: N``): generation in N rollout worker processes of their own.

These are the words users already type and read (command-line flags, MLflow run names and tags,
the docs), so the library's registry uses them too rather than names of its own.
"""

from __future__ import annotations

from typing import Literal, get_args

from a3po.config.distributed import DistributedConfig
from a3po.config.rollout import OppoConfig
from a3po.registry import Registry

Placement = Literal["colocated", "disaggregated"]
PLACEMENTS: tuple[Placement, ...] = get_args(Placement)


def placement_of(distributed: DistributedConfig) -> Placement:
    """The placement a config's ``distributed`` section asks for."""
    return "disaggregated" if distributed.rollout_workers else "colocated"


# An OPPO mode: the ``oppo`` switches it sets (docs/oppo.md). Tables list them in this order.
OppoMode = Literal["off", "intra", "inter", "both"]
OPPO_MODE_NAMES: tuple[OppoMode, ...] = get_args(OppoMode)
OPPO_MODES: Registry[dict[str, bool]] = Registry("OPPO mode")
for _name, _intra, _inter in zip(OPPO_MODE_NAMES, (False, True, False, True), (False, False, True, True), strict=True):
    OPPO_MODES.register(_name)({"intra": _intra, "inter": _inter})


def oppo_mode(oppo: OppoConfig) -> str:
    """The registered mode whose switches ``oppo`` has."""
    for name in OPPO_MODES:
        if OPPO_MODES.get(name) == {"intra": oppo.intra, "inter": oppo.inter}:
            return name
    raise AssertionError(f"no OPPO mode for intra={oppo.intra}, inter={oppo.inter}")  # the four cover every pair
