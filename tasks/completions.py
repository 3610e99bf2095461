"""The run folder's completion tables (:mod:`a3po.training.completions`) as MLflow tables.

Each ``<run_dir>/completions/step_<N>.jsonl`` becomes the artifact ``completions/step_<N>.json``
of the child run, logged with ``MlflowClient.log_table`` (pandas' "split" JSON), which also
lists it in the run's ``mlflow.loggedArtifacts`` tag: the run page's Artifacts tab shows it as a
table, and the experiment's artifact view (``mlflow.load_table`` likewise) lines up one step's
table across runs.

When: once training has ended, from the task that trained the run (the files are in the run
folder meanwhile). An upload is a few round trips per table; the metrics' shipper keeps
training from ever waiting on the tracking server, and the tables keep that promise by not
being uploaded during it.

Idempotent: ``log_table`` appends to an artifact that exists, so a table already in the run is
left as it is (a retried task reuses its child run, and its files are those the first attempt
logged: the library rewrites only the tables of steps after its checkpoint, which the first
attempt, having failed, did not log). A new child run (a new flow run) gets every table of the
folder, those of the steps before a resume included.
"""

from __future__ import annotations

import posixpath
from pathlib import Path

from a3po.training.completions import COLUMNS, read_table, table_path, table_steps

ARTIFACT_DIR = "completions"


def artifact_file(step: int) -> str:
    """The table's path in the run's artifacts, e.g. ``completions/step_000050.json``."""
    return posixpath.join(ARTIFACT_DIR, table_path("", step).with_suffix(".json").name)


def log_completion_tables(client, run_id: str, folder: str | Path) -> list[int]:
    """Log the tables of ``folder`` (``<run_dir>/completions``) that run ``run_id`` does not
    have yet; returns the steps logged."""
    import pandas as pd

    steps = table_steps(folder)
    if not steps:
        return []
    have = {f.path for f in client.list_artifacts(run_id, ARTIFACT_DIR)}
    logged = []
    for step in steps:
        name = artifact_file(step)
        if name in have:
            continue
        rows = read_table(table_path(folder, step))
        client.log_table(run_id, data=pd.DataFrame(rows, columns=list(COLUMNS)), artifact_file=name)
        logged.append(step)
    return logged
