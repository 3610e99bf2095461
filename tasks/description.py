"""The parent run's Description: what a reader of the MLflow UI sees first on a comparison.

MLflow renders a run's Description (the tag ``mlflow.note.content``) as Markdown above its
metrics. A comparison's holds, in order: the flow's verdict when it has one (nightly parity, the
paper's claims), the comparison table (:func:`tasks.summary.to_markdown`), the pairs (each arm
against its baselines: speed ratios and reward difference with 95% intervals over the paired
seeds and the verdicts those intervals allow, :mod:`tasks.pairs`), the charts of the
comparison, and a link to every child run. :func:`comparison_description` builds it (pure:
strings in, string out); :func:`describe_parent_run` is the task that writes it, through
:func:`tasks.tracking.set_description`, the one place the tag is set.
"""

from __future__ import annotations

from typing import Any, Sequence

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.links import run_page, ui_address
from tasks.tracking import MAX_DESCRIPTION_CHARS, TrackingRef, client_for, set_description

# Charts of the comparison on the parent run (tasks.summary.plot), shown in the Description.
CHARTS = (("reward_curves.png", "reward and held-out accuracy against wall time"),
          ("stability.png", "importance weights and trust region"))


def comparison_description(summary: dict[str, Any], children: Sequence[dict[str, Any]],
                           links: dict[str, Any] | None = None, verdict_md: str | None = None,
                           charts: Sequence[tuple[str, str]] = (), limit: int = MAX_DESCRIPTION_CHARS) -> str:
    """The Markdown of a comparison's parent run.

    ``summary``: :func:`tasks.summary.summarise`'s (``table_md``, ``target``, ``notes``) with
    :func:`tasks.pairs.summarise_pairs`'s ``pairs_md``.
    ``children``: ``{"arm", "seed", "url"}`` per child run. ``links``: :class:`tasks.links.RunLinks`
    as a dict (its compare-runs page is linked). ``verdict_md``: the flow's verdict, put first.
    ``charts``: ``(image URL, caption)`` shown as images. Sections that do not fit ``limit``
    characters (MLflow's largest tag value) are left out from the end, saying so, the verdict
    and the table last."""
    if not summary.get("table_md"):
        raise ValueError("the summary has no comparison table (table_md): nothing to describe")
    target = summary.get("target")
    head = [verdict_md.strip()] if verdict_md else []
    no_target = "No reward target (no arm improved on the first step)"
    table = ["## Comparison", summary["table_md"],
             (f"Target reward {target:.3f}" if target is not None else no_target)
             + "; definitions in docs/pipeline.md (the summary)."
             + "".join(f"\n\nNote: {n}" for n in summary.get("notes", []))]
    if not summary.get("pairs_md"):
        raise ValueError("the summary has no pairs (pairs_md, tasks.pairs.summarise_pairs): the speed and reward "
                         "figures would be shown without their intervals")
    speed = ["## Pairs over seeds", summary["pairs_md"].strip()]
    pictures = ["## Charts", *(f"![{caption}]({url})" for url, caption in charts)] if charts else []
    compare = [f"[Compare the child runs]({links['compare_runs']})"] if links and links.get("compare_runs") else []
    runs = ["## Child runs", *compare, "\n".join(f"- [{c['arm']} seed {c['seed']}]({c['url']})" for c in children)]
    sections = [s for s in (head, table, speed, pictures, runs) if s]
    dropped: list[str] = []
    while True:
        text = "\n\n".join("\n\n".join(s) for s in sections)
        more = f"\n\n_Left out here for length: {', '.join(dropped)}; see the run's artifacts._" if dropped else ""
        if len(text) + len(more) <= limit or len(sections) <= 1:
            return (text + more)[:limit]
        dropped.insert(0, sections.pop()[0].lstrip("# ").lower())


@task(cache_policy=NO_CACHE)
def describe_parent_run(ref: TrackingRef, summary: dict[str, Any], records: Sequence[dict[str, Any]],
                        links: dict[str, Any] | None = None, verdict_md: str | None = None) -> str:
    """Write the comparison's Description on the parent run (its charts are the parent run's
    artifacts of the same names, logged by the flow); return the Markdown."""
    ui = ui_address(ref.tracking_uri)
    children = [{"arm": r.get("arm") or r["variant"], "seed": r["seed"],
                 "url": run_page(ui, ref.experiment_id, r["mlflow_run_id"])} for r in records if r.get("mlflow_run_id")]
    logged = {p.rsplit("/", 1)[-1] for p in summary.get("artifacts", [])}
    # Relative to the UI's own address, so it resolves on whatever host and port serves it.
    charts = [(f"get-artifact?path={name}&run_uuid={ref.parent_run_id}", caption)
              for name, caption in CHARTS if name in logged]
    md = comparison_description(summary, children, links, verdict_md, charts)
    set_description(client_for(ref.tracking_uri), ref.parent_run_id, md)
    return md
