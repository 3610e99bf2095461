"""The run folder's actions (:mod:`a3po.training.actions`: what the guard and the staleness bound
in force did, and why) on the child MLflow run, where a reader of the run finds them without the
worker's log:

* the artifact ``actions.json``, one row per action (the columns of
  :data:`a3po.training.actions.COLUMNS`; ``figures`` as text, ``name=value`` with 4 significant
  digits, as the reason writes them; the file keeps them whole), logged with
  ``MlflowClient.log_table``, so the run page's Artifacts tab shows it as a table;
* the tags ``a3po.actions`` (how many, by source) and ``a3po.last_action`` (the last one in a
  line, cut to :data:`TAG_CHARS`), seen in the run's overview and in the runs list's columns.

When: once training has ended, from the task that trained the run, as the completion tables
(:mod:`tasks.completions`). Idempotent: ``log_table`` appends to an artifact that exists, so a
table already in the run is left as it is. A retried task reuses its child run, and the folder's
rows are those it logged: an attempt logs them after its last step, whose checkpoint a retry
resumes from, and the library drops only the rows of steps after the checkpoint it resumes. A new
child run (a new flow run) gets every row of the folder.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from a3po.training.actions import COLUMNS, Action, read_actions

ARTIFACT = "actions.json"
TAG_CHARS = 500  # a line a reader takes in at a glance; the table holds the rest


def figures_text(figures: dict[str, float]) -> str:
    """``guard/abs_err_p99=2.31, rl.guard_max_err=1``: a cell the MLflow table view shows (a nested
    object is not one)."""
    return ", ".join(f"{k}={v:.4g}" for k, v in figures.items())


def action_rows(actions: list[Action]) -> list[list]:
    """The table's rows, in :data:`COLUMNS` order."""
    return [[a.step, a.source, a.setting, a.action, a.reason, figures_text(a.figures)] for a in actions]


def last_action_tag(actions: list[Action]) -> str:
    line = actions[-1].line()
    return line if len(line) <= TAG_CHARS else line[: TAG_CHARS - 5] + " [..]"


def log_action_table(client, run_id: str, path: str | Path) -> int:
    """Put the actions of ``path`` (``<run_dir>/actions.jsonl``) on run ``run_id``: the table when
    the run does not have it yet, and the tags. Returns how many rows were logged (0: none
    recorded, or the run had them already)."""
    import pandas as pd

    actions = read_actions(path)
    if not actions:
        return 0
    logged = 0
    if ARTIFACT not in {f.path for f in client.list_artifacts(run_id)}:
        client.log_table(run_id, data=pd.DataFrame(action_rows(actions), columns=list(COLUMNS)), artifact_file=ARTIFACT)
        logged = len(actions)
    by_source = Counter(a.source for a in actions)
    client.set_tag(run_id, "a3po.actions", f"{len(actions)}: " + ", ".join(f"{s} {n}" for s, n in sorted(by_source.items())))
    client.set_tag(run_id, "a3po.last_action", last_action_tag(actions))
    return logged
