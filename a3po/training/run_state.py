"""What a run's checkpoint holds besides the policy's weights and the optimizer's state, and
:func:`resume`, which finds the newest intact checkpoint and checks it belongs to this run.

On disk (:func:`a3po.storage.checkpoint.save_checkpoint`) a checkpoint is one flat mapping:
``step``, ``policy``, ``optimizer``, ``weights_history``, ``history``, ``eval_curve``,
``train_wall_s``, ``warmstart_acc``, ``config``, ``inputs`` (the sha256 of the model and data files
the config names, :mod:`a3po.training.inputs`), ``pending_evaluation`` when the held-out evaluation
of the checkpoint's own step was still running beside training (:class:`PendingEvaluation`), and
the entries of the run's extensions (:mod:`a3po.training.extensions`: ``critic`` /
``critic_optimizer``, ``oppo_state``, ``intra_critic_history`` / ``intra_state``) under their own
keys. With ``model.lora``, ``policy``, ``weights_history`` and ``optimizer`` hold the adapters
alone (and their AdamW state): the frozen base is the warm start, which the run loads again.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from a3po.config import TrainConfig, config_differences, config_to_dict
from a3po.storage.checkpoint import CheckpointError, load_latest_checkpoint
from a3po.training.inputs import input_changes

log = logging.getLogger(__name__)

# The keys RunState owns on disk; every other key of a checkpoint belongs to an extension.
_RUN_KEYS = ("step", "weights_history", "history", "eval_curve", "train_wall_s", "warmstart_acc", "config")
# Run keys added later: a checkpoint written before them lacks them (see resume).
_LATER_RUN_KEYS = ("inputs", "precision", "pending_evaluation")
# Written beside the run's keys by every rank's save (a3po.training.loop.save_rank_checkpoint).
_WEIGHT_KEYS = ("policy", "optimizer")


@dataclass(frozen=True)
class PendingEvaluation:
    """The held-out evaluation of version ``version`` still running beside training
    (``rl.eval_mode: background``, :mod:`a3po.training.evaluations`) when the checkpoint of step
    ``version`` was written: that checkpoint holds version ``version``'s weights but not its
    figures, so a run resumed from it evaluates the restored weights first. ``train_rows``: the
    ``source: "train"`` rows of that step's completion table
    (:meth:`a3po.training.completions.CompletionTables.training_rows`; None: the run wrote no
    tables), which only exist at the step."""

    version: int
    train_rows: list[dict[str, Any]] | None = None


@dataclass
class RunState:
    """A run after ``step`` updates: its record so far and what its extensions keep. The policy's
    weights and the optimizer's state go through the updater (every rank's optimizer partition):
    ``policy`` and ``optimizer`` are set only on a state read from a checkpoint."""

    step: int
    warmstart_acc: float | None  # None until the run measures it (its first held-out evaluation)
    config: dict
    # {dotted field: sha256} of the files the config names (a3po.training.inputs.input_hashes);
    # None: read from a checkpoint written before they were recorded.
    inputs: dict[str, str] | None = None
    # What the run computed in (a3po.devices.Precision.name): dtype auto resolves by machine, so a
    # checkpoint may move between precisions under one config. None: written before it was recorded.
    precision: str | None = None
    history: list[dict[str, float]] = field(default_factory=list)  # per-step metrics, steps 1..step
    eval_curve: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out acc)
    train_wall_s: float = 0.0  # wait + update seconds of the steps so far (setup and evaluation aside)
    # Policy versions the producer still needs to regenerate the batches in flight at ``step``.
    weights_history: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict, repr=False)
    # the extensions' entries, by their keys on disk
    extensions: dict[str, Any] = field(default_factory=dict, repr=False)
    # The evaluation of version ``step`` when it was still running as the checkpoint was written (None: its
    # figures are in ``history`` and ``eval_curve``, or ``step`` is no evaluation step; and a checkpoint
    # written before the field existed).
    pending_evaluation: PendingEvaluation | None = None
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
            "inputs": self.inputs or {},
            **({"precision": self.precision} if self.precision is not None else {}),
            **({"pending_evaluation": asdict(self.pending_evaluation)} if self.pending_evaluation else {}),
            **self.extensions,
        }

    @classmethod
    def from_checkpoint(cls, state: dict[str, Any], path: str | Path) -> RunState:
        """The state a checkpoint of ``path`` holds; a missing entry is a :class:`CheckpointError` naming it."""
        missing = [k for k in (*_RUN_KEYS, *_WEIGHT_KEYS) if k not in state]
        if missing:
            raise CheckpointError(f"{path} has no {', '.join(missing)}: not a checkpoint of a3po.training (or of "
                                  "an incompatible version)")
        return cls(
            step=state["step"],
            warmstart_acc=state["warmstart_acc"],
            config=state["config"],
            inputs=state.get("inputs"),
            precision=state.get("precision"),
            history=state["history"],
            eval_curve=[tuple(p) for p in state["eval_curve"]],  # JSON keeps lists
            train_wall_s=state["train_wall_s"],
            weights_history=state["weights_history"],
            pending_evaluation=_pending_evaluation(state, path),
            extensions={k: v for k, v in state.items() if k not in (*_RUN_KEYS, *_LATER_RUN_KEYS, *_WEIGHT_KEYS)},
            policy=state["policy"],
            optimizer=state["optimizer"],
            path=str(path),
        )


def _pending_evaluation(state: dict[str, Any], path: str | Path) -> PendingEvaluation | None:
    """The checkpoint's pending evaluation, checked: it can only be of the step whose weights it holds."""
    saved = state.get("pending_evaluation")
    if saved is None:
        return None
    if not isinstance(saved, dict) or saved.get("version") != state["step"]:
        raise CheckpointError(f"{path}: pending_evaluation {saved!r} is not the evaluation of its step "
                              f"{state['step']} (the only weights it holds)")
    rows = saved.get("train_rows")
    if rows is not None and not (isinstance(rows, list) and all(isinstance(r, dict) for r in rows)):
        raise CheckpointError(f"{path}: pending_evaluation's train_rows is not a list of rows")
    return PendingEvaluation(version=saved["version"], train_rows=rows)


def resume(
    ckpt_dir: str | None, cfg: TrainConfig, inputs: dict[str, str], on_skip: Callable[[str], None] | None = None,
    precision: str | None = None,
) -> RunState | None:
    """The state of the newest intact checkpoint in ``ckpt_dir`` (None: no directory or no
    checkpoint yet; damaged ones are reported to ``on_skip`` and passed over, and
    :class:`~a3po.storage.checkpoint.NoIntactCheckpoint` is raised when none is intact). A checkpoint
    saved under another config, or on other contents of its files (``inputs``, the sha256 of the
    files ``cfg`` names now), is refused: resuming would splice two different runs into one history.
    A checkpoint written before inputs were recorded is resumed with a warning naming the files
    it cannot check, and records ``inputs`` from then on.

    ``precision``: what this run computes in (:attr:`a3po.devices.Precision.name`). Another dtype in
    the config is refused with the other config changes, naming both values. The same ``dtype: auto``
    resolved otherwise on this machine (bf16 autocast where the checkpoint was written in fp32, or the
    reverse) resumes with a warning naming both: the weights and AdamW state are fp32 under either,
    only the rounding of the steps from here on differs."""
    found = load_latest_checkpoint(ckpt_dir, on_skip=on_skip) if ckpt_dir else None
    if found is None:
        return None
    path, state = found
    run = RunState.from_checkpoint(state, path)
    # Compared as the checkpoint stores it: through JSON (a tuple, e.g. model.lora.target_modules, reads back as a
    # list).
    changed = config_differences(run.config, json.loads(json.dumps(config_to_dict(cfg))))
    if changed:
        dtypes = ""
        if "dtype" in changed:  # the precision: name both (a saved config without the field was float32)
            dtypes = f" (dtype: saved {run.config.get('dtype', 'float32')}, now {cfg.dtype.value})"
        raise CheckpointError(
            f"{path} was saved by a run with a different config ({', '.join(changed)} differ){dtypes}; "
            f"resume it with the same config, or use another output dir (or delete {ckpt_dir} to start over)"
        )
    if precision is not None and run.precision is not None and run.precision != precision:
        log.warning(f"{path} was written computing in {run.precision}; resuming it in {precision} (dtype "
                    f"{cfg.dtype.value} on this machine): the weights and AdamW state are fp32 in both, so the run "
                    "goes on; only the rounding of its steps from here on differs")
    if precision is not None:
        run.precision = precision  # its next checkpoint records what it computes in now
    if run.inputs is None:
        # Refusing would strand a run that predates the record with no way to continue it; the
        # files are named, so a user who did change one knows. Its next checkpoint records them.
        if inputs:
            log.warning(f"{path} records no content hashes (written by an earlier version): "
                        f"{', '.join(sorted(inputs))} not checked against it; resuming")
        run.inputs = inputs
        return run
    changed = input_changes(run.inputs, inputs, cfg)
    if changed:
        raise CheckpointError(
            f"{path} was saved on other file contents ({'; '.join(changed)}); resume it with the files "
            f"as they were, or use another output dir (or delete {ckpt_dir} to start over)"
        )
    return run
