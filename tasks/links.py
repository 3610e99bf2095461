"""Direct links into the MLflow UI: a flow run's parent run page and the compare-runs page of
its child runs, printed by the flows and tagged on the parent run.

Why: MLflow 3's UI can open an experiment on its GenAI "Overview" tab, two clicks away from
the runs and their comparison; a link lands on them directly.

Routes (MLflow 3.17's UI, a hash router; checked against ``mlflow/server/js/build``:
``getRunPageRoute`` and ``getCompareRunPageRoute``, which writes ``JSON.stringify`` of the
id lists as the query values):

    <ui>/#/experiments/<experiment id>/runs/<run id>?workflowType=machine_learning
    <ui>/#/experiments/<experiment id>/runs/<run id>/artifactPath/<path>?workflowType=machine_learning
    <ui>/#/compare-runs?runs=["<run id>",...]&experiments=["<experiment id>"]&workflowType=machine_learning

Why ``workflowType``: MLflow 3's UI picks its workspace (GenAI: traces, judges, prompts; or
"Model training": runs, models, charts) from that query parameter, else from what the browser
last chose, else GenAI. The UI reads it from the router's query, the part after ``#/...?``: put
before the ``#`` it is ignored (checked in headless Chromium, tests/ui/test_browser.py).

``<ui>`` is the tracking URI itself for an HTTP tracking server. Any other store (the local
SQLite file, a database URI) has no UI of its own: the links assume ``mlflow ui`` on its
default address, and :attr:`RunLinks.ui_command` is the command that starts it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from urllib.parse import quote

from prefect import task
from prefect.cache_policies import NO_CACHE

from a3po.redact import mask_uri
from tasks.runtime import run_logger
from tasks.tracking import TrackingRef, client_for

LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves by default
TAG_PARENT = "a3po.link.parent_run"
TAG_COMPARE = "a3po.link.compare_runs"
TAG_UI_COMMAND = "a3po.link.ui_command"
WORKSPACE = "workflowType=machine_learning"  # the "Model training" workspace (module docstring)


@dataclass(frozen=True)
class RunLinks:
    parent_run: str  # the parent run's page
    compare_runs: str  # the compare-runs page of the child runs
    ui_command: str | None  # how to start a UI for a store that has none (None: HTTP server)

    def as_dict(self) -> dict[str, str | None]:
        return asdict(self)

    def lines(self) -> list[str]:
        """What a person reads: the command to start the UI first, when one is needed."""
        head = [f"start the MLflow UI: {self.ui_command}"] if self.ui_command else []
        return [*head, f"parent run:   {self.parent_run}", f"compare runs: {self.compare_runs}"]


def _ids(ids: list[str]) -> str:
    # The UI's own JSON list, percent-encoded so the URL stays one clickable token in terminals
    # and Markdown (the UI decodes the query before parsing it).
    return quote(json.dumps(ids, separators=(",", ":")), safe="")


def ui_address(tracking_uri: str) -> str:
    """The UI serving ``tracking_uri``: the server itself (masked), or ``mlflow ui``'s default address."""
    is_server = tracking_uri.startswith(("http://", "https://"))
    return mask_uri(tracking_uri).rstrip("/") if is_server else LOCAL_UI


def run_page(ui: str, experiment_id: str, run_id: str) -> str:
    """One run's page, in the Model training workspace."""
    return f"{ui}/#/experiments/{experiment_id}/runs/{run_id}?{WORKSPACE}"


def artifact_page(ui: str, experiment_id: str, run_id: str, path: str) -> str:
    """One artifact of a run, opened in the run's artifact browser (the UI's ``runPageWithArtifact``
    route)."""
    return f"{ui}/#/experiments/{experiment_id}/runs/{run_id}/artifactPath/{quote(path)}?{WORKSPACE}"


def run_links(tracking_uri: str, experiment_id: str, parent_run_id: str, child_run_ids: list[str]) -> RunLinks:
    """The links for one flow run (pure: builds strings, contacts nothing). Secrets in the URI
    (a password, a token in the query) are masked (:func:`tasks.runtime.mask_uri`): the links
    and the command are printed, logged and tagged."""
    is_server = tracking_uri.startswith(("http://", "https://"))
    ui = ui_address(tracking_uri)
    command = None if is_server else f"mlflow ui --backend-store-uri {mask_uri(tracking_uri)}"
    return RunLinks(
        parent_run=run_page(ui, experiment_id, parent_run_id),
        compare_runs=f"{ui}/#/compare-runs?runs={_ids(child_run_ids)}&experiments={_ids([experiment_id])}&{WORKSPACE}",
        ui_command=command,
    )


@task(cache_policy=NO_CACHE)
def tag_run_links(ref: TrackingRef, child_run_ids: list[str]) -> dict[str, str | None]:
    """Tag the parent run with its links (``a3po.link.*``), log them, return them."""
    links = run_links(ref.tracking_uri, ref.experiment_id, ref.parent_run_id, child_run_ids)
    client = client_for(ref.tracking_uri)
    client.set_tag(ref.parent_run_id, TAG_PARENT, links.parent_run)
    client.set_tag(ref.parent_run_id, TAG_COMPARE, links.compare_runs)
    if links.ui_command:
        client.set_tag(ref.parent_run_id, TAG_UI_COMMAND, links.ui_command)
    log = run_logger()
    for line in links.lines():
        log.info(line)
    return links.as_dict()
