"""What a run's checkpoint holds besides the policy's weights and the optimizer's state, and
:func:`resume`, which finds the newest intact checkpoint and checks it belongs to this run.

On disk (:func:`a3po.storage.checkpoint.save_checkpoint`) a checkpoint is one flat mapping:
``step``, ``policy``, ``optimizer``, ``weights_history``, ``history``, ``eval_curve``,
``train_wall_s``, ``warmstart_acc``, ``config``, and the entries of the run's extensions
(:mod:`a3po.training.extensions`: ``critic`` / ``critic_optimizer``, ``oppo_state``,
``intra_critic_history`` / ``intra_state``) under their own keys. With ``model.lora``, ``policy``,
``weights_history`` and ``optimizer`` hold the adapters alone (and their AdamW state): the frozen
base is the warm start, which the run loads again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from a3po.config import TrainConfig, config_differences, config_to_dict
from a3po.storage.checkpoint import CheckpointError, load_latest_checkpoint

# The keys RunState owns on disk; every other key of a checkpoint belongs to an extension.
_RUN_KEYS = ("step", "weights_history", "history", "eval_curve", "train_wall_s", "warmstart_acc", "config")
# Written beside the run's keys by every rank's save (a3po.training.loop.save_rank_checkpoint).
_WEIGHT_KEYS = ("policy", "optimizer")


@dataclass
class RunState:
    """A run after ``step`` updates: its record so far and what its extensions keep. The policy's
    weights and the optimizer's state go through the updater (every rank's optimizer partition):
    ``policy`` and ``optimizer`` are set only on a state read from a checkpoint."""

    step: int
    warmstart_acc: float | None  # None until the run measures it (its first held-out evaluation)
    config: dict
    history: list[dict[str, float]] = field(default_factory=list)  # per-step metrics, steps 1..step
    eval_curve: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out acc)
    train_wall_s: float = 0.0  # wait + update seconds of the steps so far (setup and evaluation aside)
    # Policy versions the producer still needs to regenerate the batches in flight at ``step``.
    weights_history: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict, repr=False)
    extensions: dict[str, Any] = field(default_factory=dict, repr=False)  # the extensions' entries, by their keys on disk
    policy: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    optimizer: Any = field(default=None, repr=False)
    path: str | None = None  # the checkpoint it was read from (not written)

    def to_checkpoint(self) -> dict[str, Any]:
        """The run's entries of a checkpoint (the policy and optimizer are added by the save)."""
        return {
            "step": self.step,
            "weights_history": self.weights_history,
            "history": self.history,
            "eval_curve": self.eval_curve,
            "train_wall_s": self.train_wall_s,
            "warmstart_acc": self.warmstart_acc,
            "config": self.config,
            **self.extensions,
        }

    @classmethod
    def from_checkpoint(cls, state: dict[str, Any], path: str | Path) -> RunState:
        """The state a checkpoint of ``path`` holds; a missing entry is a :class:`CheckpointError` naming it."""
        missing = [k for k in (*_RUN_KEYS, *_WEIGHT_KEYS) if k not in state]
        if missing:
            raise CheckpointError(f"{path} has no {', '.join(missing)}: not a checkpoint of a3po.training (or of an incompatible version)")
        return cls(
            step=state["step"],
            warmstart_acc=state["warmstart_acc"],
            config=state["config"],
            history=state["history"],
            eval_curve=[tuple(p) for p in state["eval_curve"]],  # JSON keeps lists
            train_wall_s=state["train_wall_s"],
            weights_history=state["weights_history"],
            extensions={k: v for k, v in state.items() if k not in _RUN_KEYS and k not in _WEIGHT_KEYS},
            policy=state["policy"],
            optimizer=state["optimizer"],
            path=str(path),
        )


def resume(ckpt_dir: str | None, cfg: TrainConfig, on_skip: Callable[[str], None] | None = None) -> RunState | None:
    """The state of the newest intact checkpoint in ``ckpt_dir`` (None: no directory or no
    checkpoint yet; damaged ones are reported to ``on_skip`` and passed over, and
    :class:`~a3po.storage.checkpoint.NoIntactCheckpoint` is raised when none is intact). A checkpoint
    saved under another config is refused: resuming would splice two different runs into one history."""
    found = load_latest_checkpoint(ckpt_dir, on_skip=on_skip) if ckpt_dir else None
    if found is None:
        return None
    path, state = found
    run = RunState.from_checkpoint(state, path)
    # Compared as the checkpoint stores it: through JSON (a tuple, e.g. model.lora.target_modules, reads back as a list).
    changed = config_differences(run.config, json.loads(json.dumps(config_to_dict(cfg))))
    if changed:
        raise CheckpointError(
            f"{path} was saved by a run with a different config ({', '.join(changed)} differ); "
            f"resume it with the same config, or use another output dir (or delete {ckpt_dir} to start over)"
        )
    return run
