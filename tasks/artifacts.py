"""Prefect artifacts of the comparison flows: what a Prefect user finds on a flow run's Artifacts tab.

Every compare-variants, nightly-parity and paper-claims flow run publishes, under keys that start
with :func:`flow_key` (the flow's run name and its MLflow experiment: a deployment's successive
runs write the same keys, so each key is one history in Prefect's Artifacts page):

- ``<key>-verdict`` (markdown): the verdict line, the headline (:func:`tasks.description.headline`),
  the full comparison table, the flow's verdict, the pairs, links to every child run;
- ``<key>-pairs`` (table): one row per pair (:mod:`tasks.pairs`), each figure with its interval and
  the verdict the interval allows;
- ``<key>-mlflow-parent`` and ``<key>-mlflow-compare`` (links): the MLflow parent run and the
  compare page of its child runs.

A flow run that fails publishes ``<key>-verdict`` saying FAIL and why (:func:`publish_failure`),
so the history shows the failed night rather than skipping it. Each training task that runs in
this process publishes ``<progress key>`` (:func:`progress_key`), a progress artifact updated with
the same numbers as its progress line; arms launched as ranks report progress in their own
processes' logs only.

Publishing never fails the flow or the training: an API that refuses an artifact costs one warning
naming it (:func:`_quietly`).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.description import child_links, comparison_description
from tasks.links import RunLinks
from tasks.runtime import run_logger

# Prefect's rule for an artifact key: lowercase letters, digits and dashes.
_NOT_KEY = re.compile(r"[^a-z0-9]+")
MAX_KEY = 120


def slug(text: str) -> str:
    """``text`` as an artifact key: lowercase, every run of other characters one dash."""
    return _NOT_KEY.sub("-", text.lower()).strip("-")[:MAX_KEY].strip("-")


def flow_key(run_name: str, experiment: str) -> str:
    """The keys' stem of a flow run: its run name (``compare-micro``, ``nightly-tiny``) and its
    MLflow experiment, so the same deployment (same preset, same experiment) adds to one history."""
    return slug(f"{run_name}-{experiment}")


def progress_key(arm: str, seed: int, experiment_id: str) -> str:
    """The progress artifact of one arm x seed in one MLflow experiment."""
    return slug(f"progress-{arm}-seed-{seed}-exp-{experiment_id}")


def _quietly(what: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001  (an artifact is a record, never a reason to stop)
        run_logger().warning(f"Prefect artifact {what} not recorded: {type(e).__name__}: {e}")
        return None


def _cell(iv: dict[str, Any], digits: int = 3) -> dict[str, float | None]:
    return {end: None if iv.get(end) is None else round(float(iv[end]), digits) for end in ("point", "low", "high")}


def pairs_table(pairs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pairs (:func:`tasks.pairs.summarise_pairs`'s, as dicts) as table rows: figure, interval
    ends and verdict per column; the pooled reward row has no speed figures."""
    from tasks.pairs import Interval, speed_verdict

    rows = []
    for p in pairs:
        label = f"{p['arm']} vs {p['baseline']}" + (f" ({', '.join(p['pooled'])})" if p.get("pooled") else "")
        row: dict[str, Any] = {"pair": label, "seeds": len(p["seeds"])}
        for name, key in (("step-time ratio", "step_time"), ("time-to-target ratio", "ttt")):
            c = _cell(p[key])
            row.update({name: c["point"], f"{name} lo": c["low"], f"{name} hi": c["high"],
                        f"{name} verdict": speed_verdict(Interval(**p[key]))})
        c = _cell(p["reward"])
        row.update({"reward diff": c["point"], "reward diff lo": c["low"], "reward diff hi": c["high"], "reward verdict": p["reward_verdict"]})
        rows.append(row)
    return rows


@task(cache_policy=NO_CACHE)
def publish_flow_artifacts(key: str, summary: dict[str, Any], records: Sequence[dict[str, Any]], ui: str, experiment_id: str,
                           links: dict[str, Any], verdict_md: str | None = None, title: str | None = None) -> dict[str, Any]:
    """Publish the flow run's artifacts (module docstring); return their ids by key (None: refused).
    ``verdict_md`` as for :func:`tasks.description.comparison_description`; ``title``: the first
    line where the flow has no verdict of its own."""
    from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

    md = comparison_description(summary, child_links(ui, experiment_id, records), links, verdict_md or (f"# {title}" if title else None),
                                limit=10**6)
    ids = {f"{key}-verdict": _quietly(f"{key}-verdict", lambda: create_markdown_artifact(
        markdown=md, key=f"{key}-verdict", description=(verdict_md or title or "comparison").strip().splitlines()[0].lstrip("# ")))}
    table = pairs_table(summary.get("pairs", []))
    if table:
        ids[f"{key}-pairs"] = _quietly(f"{key}-pairs", lambda: create_table_artifact(
            table=table, key=f"{key}-pairs", description="each arm against its baselines over the paired seeds, 95% intervals"))
    run_links = RunLinks(**links)
    for name, link, text in (("mlflow-parent", run_links.parent_run, "MLflow parent run"),
                             ("mlflow-compare", run_links.compare_runs, "MLflow: compare the child runs")):
        ids[f"{key}-{name}"] = _quietly(f"{key}-{name}", lambda link=link, text=text, name=name: create_link_artifact(
            link=link, link_text=text, key=f"{key}-{name}",
            description=text + (f" (start the UI first: {run_links.ui_command})" if run_links.ui_command else "")))
    return ids


def publish_failure(key: str, title: str, error: BaseException, parent_run: str | None = None) -> None:
    """``<key>-verdict`` saying the flow run failed and why (the history keeps the failed run)."""
    from prefect.artifacts import create_markdown_artifact

    why = "interrupted (Ctrl-C or a stop signal)" if isinstance(error, KeyboardInterrupt) else f"{type(error).__name__}: {error}"
    where = f"\n\nThe MLflow parent run ({parent_run}) is marked FAILED." if parent_run else ""
    md = f"# {title}: FAIL\n\nThe flow run did not finish: {why}{where}\n"
    _quietly(f"{key}-verdict", lambda: create_markdown_artifact(markdown=md, key=f"{key}-verdict", description=f"FAIL: {why}"[:500]))


class TrainingProgress:
    """The progress artifact of one training task: created at the first report, then updated
    with the fraction of steps done and the progress line as its description."""

    def __init__(self, key: str, steps: int):
        self.key, self.steps, self.artifact_id = key, steps, None
        self._refused = False

    def report(self, step: int, line: str) -> None:
        if self._refused:  # one warning, not one per step
            return
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        pct = 100.0 * min(step, self.steps) / self.steps
        if self.artifact_id is None:
            self.artifact_id = _quietly(self.key, lambda: create_progress_artifact(progress=pct, key=self.key, description=line))
            self._refused = self.artifact_id is None
        else:
            self._refused = _quietly(self.key, lambda: update_progress_artifact(self.artifact_id, pct, description=line)) is None
