"""The run's actions with their reasons: what the guard (:mod:`a3po.training.guard`) and the staleness
bound in force (:mod:`a3po.training.staleness`) did, one row each, in the run folder's ``actions.jsonl``.

Their metrics (``guard/fired``, ``guard/over_max_*``, ``staleness/bound_changed``) say that something
happened at a step; a row says what and why, as the warning on the ``a3po.guard`` log and the line on the
``a3po.staleness`` log do, for a reader who has the run folder or its MLflow run (``tasks.actions`` puts
the rows there as a table) rather than the worker's log. One JSON object a line, the keys of
:data:`COLUMNS`:

* ``step``: the step (1-based, as the metrics) whose check or move it is;
* ``source``: ``guard`` or ``staleness``;
* ``setting``: the setting that acted, e.g. ``rl.guard_policy tighten``, ``rl.staleness_control adaptive``;
* ``action``: what was done, e.g. ``staleness bound lowered to 3 for the batches not yet admitted``;
* ``reason``: the bounds crossed, e.g. ``guard/abs_err_p99 2.31 > rl.guard_max_err 1``;
* ``figures``: the numbers behind it, by metric or setting name: the guard's figures that crossed
  their bounds and those bounds, the controller's measures; and the bound in force after the action.

Crash and resume, as ``metrics.jsonl``: a step's rows are held until its metrics line is written
(:meth:`ActionLog.flush`), so a step that crashes leaves neither (it is trained, and checked, again
on resume); each row is one append (a killed process leaves at most a torn last line, cut before the
next row); a run resumed from the checkpoint of step ``k`` first drops the rows of steps after ``k``,
which it trains again, so no step's actions are there twice.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from a3po.storage.atomic import atomic_write_bytes
from a3po.training.metrics import append_line, cut_torn_line, read_metrics_jsonl

COLUMNS = ("step", "source", "setting", "action", "reason", "figures")
FILE = "actions.jsonl"


@dataclass(frozen=True)
class Action:
    """One action of the run (the keys of :data:`COLUMNS`)."""

    step: int
    source: str
    setting: str
    action: str
    reason: str
    figures: dict[str, float] = field(default_factory=dict)

    def line(self) -> str:
        """The row in one line, for a tag or a log: ``step 3, guard (rl.guard_policy warn): no change; <reason>``."""
        return f"step {self.step}, {self.source} ({self.setting}): {self.action}; {self.reason}"


# Where an actor hands its actions (the loop's ActionLog.record on the main rank; None: nowhere).
OnAction = Callable[[Action], None]


class ActionLog:
    """The rows of ``path`` (``<run_dir>/actions.jsonl``): :meth:`record` takes one during a step,
    :meth:`flush` appends the step's rows once its metrics are written, :meth:`rewind` drops those
    after a step (a resumed run)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._repaired = False
        self._pending: list[Action] = []

    def record(self, action: Action) -> None:
        """Hold ``action`` until its step is done (:meth:`flush`)."""
        self._pending.append(action)

    def flush(self) -> None:
        """Append the held rows, one append each (the step's metrics line is written: the step happened)."""
        if self._pending and not self._repaired:
            cut_torn_line(self.path)
            self._repaired = True
        while self._pending:
            append_line(self.path, (json.dumps(asdict(self._pending.pop(0))) + "\n").encode())

    def rewind(self, step: int) -> None:
        """Keep the rows of steps 1..``step`` (a run resumed from the checkpoint of ``step``; 0: a
        fresh start, nothing kept), rewritten whole or not at all; a torn last line goes too."""
        if not self.path.exists():
            return
        kept = [r for r in read_metrics_jsonl(self.path) if r["step"] <= step]
        atomic_write_bytes(self.path, lambda f: f.write(b"".join((json.dumps(r) + "\n").encode() for r in kept)))
        self._repaired = True


def read_actions(path: str | Path) -> list[Action]:
    """The actions of ``path``, in the order recorded; none when the file does not exist (a run
    whose guard and controller never acted). A torn last line is dropped."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for r in read_metrics_jsonl(path):
        missing = [k for k in COLUMNS if k not in r]
        if missing:
            raise ValueError(f"{path}: the row of step {r['step']} has no {', '.join(missing)}")
        out.append(Action(**{k: r[k] for k in COLUMNS}))
    return out
