"""Planted regressions: deliberately broken candidates the nightly verdict must fail.

Each plant is a change a real bug would make, given to the candidate only (``rl`` overrides, as
``flows.nightly_parity``'s ``variant_overrides`` take them):

* ``lr_half``: the learning rate halved (a config or schedule bug: the run still learns, slower);
* ``biased_advantage``: GRPO's group-normalised advantage shifted by ``BIAS`` on every sample, a
  baseline that is off by a constant (e.g. a stale or mis-scaled mean). On-policy the shift's
  expected score-function gradient is zero, but on a finite batch every sampled token is pushed
  down: entropy rises and learning slows.

The biased estimator is registered in :data:`a3po.algorithms.advantages.ADVANTAGE_ESTIMATORS`
when this module is imported (by the nightly's slow tests, by ``bench.nightly_power``, or by
running a command through this module), never by the library itself::

    python -m bench._planted biased_advantage -- train --variant loglinear --preset tiny --seed 0
    python -m bench._planted lr_half -- train --variant loglinear --preset tiny --seed 0
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from a3po.algorithms.advantages import ADVANTAGE_ESTIMATORS, SequenceLevel, grpo_advantages
from a3po.config import TrainConfig

BIAS = -0.3  # in units of the group's reward std (GRPO advantages are ~unit scale)
BIASED = "planted_biased"


def planted_biased(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """A deliberately broken estimator: ``A_i = (r_i - mean_g(r)) / (std_g(r) + eps) + BIAS``."""
    return grpo_advantages(rewards, group_ids) + BIAS


if BIASED not in ADVANTAGE_ESTIMATORS:
    ADVANTAGE_ESTIMATORS.register(BIASED)(SequenceLevel(planted_biased))

PLANTS: dict[str, Callable[[TrainConfig], dict[str, Any]]] = {
    "lr_half": lambda cfg: {"lr": cfg.rl.lr / 2},
    "biased_advantage": lambda cfg: {"advantage": BIASED},
}


def plant_overrides(name: str, cfg: TrainConfig) -> dict[str, Any]:
    """The ``rl`` fields that plant ``name`` into ``cfg`` (the candidate's config)."""
    if name not in PLANTS:
        raise KeyError(f"unknown plant {name!r}; valid: {sorted(PLANTS)}")
    return PLANTS[name](cfg)


def main(argv: list[str] | None = None) -> int:
    """Run an ``a3po`` command (after ``--``) with a plant in the candidate's config."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m bench._planted", description=__doc__.split("\n\n")[0])
    ap.add_argument("plant", choices=sorted(PLANTS))
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- train ... (the a3po command line)")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if command[:1] != ["train"]:
        ap.error("give an a3po train command after --")
    import yaml

    from a3po.config import merge_yaml, preset
    from a3po.training.command import main as train_main

    base = preset(command[command.index("--preset") + 1] if "--preset" in command else "tiny")
    own: dict[str, Any] = {}
    if "--config" in command:  # the plant goes on top of the user's own config
        i = command.index("--config") + 1
        base = merge_yaml(base, command[i])
        own = yaml.safe_load(Path(command[i]).read_text()) or {}
        command = command[:i - 1] + command[i + 1:]
    own.setdefault("rl", {}).update(plant_overrides(args.plant, base))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "planted.yaml"
        path.write_text(yaml.safe_dump(own))
        return train_main([*command[1:], "--config", str(path)])  # `a3po train` without its "train"

if __name__ == "__main__":
    sys.exit(main())
