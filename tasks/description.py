"""The parent run's Description: what a reader of the MLflow UI sees first on a comparison.

MLflow renders a run's Description (the tag ``mlflow.note.content``) as Markdown above its
metrics, folded behind "Show more" after its first lines. So a comparison's opens with what a
reader came for: the flow's verdict line when it has one (nightly parity, the paper's claims),
then :func:`headline` (per arm, which baseline it is faster than, by what factor with its 95%
interval, and the reward verdict), then a narrow table of the headline columns
(:func:`narrow_table`) with a link to the full table (the parent run's ``comparison.md``), then
the rest of the verdict, the pairs (:mod:`tasks.pairs`), the charts, and a link to every child
run. :func:`comparison_description` builds it (pure:
strings in, string out); :func:`describe_parent_run` is the task that writes it, through
:func:`tasks.tracking.set_description`, the one place the tag is set.
"""

from __future__ import annotations

from typing import Any, Sequence

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.links import artifact_page, run_page, ui_address
from tasks.tracking import MAX_DESCRIPTION_CHARS, TrackingRef, client_for, set_description

# The narrow table's columns: (row key, header). The full table is the comparison.md artifact.
NARROW_COLUMNS = (("variant", "arm"), ("seeds", "seeds"), ("final_reward", "final reward"), ("final_acc", "held-out acc"),
                  ("time_to_target_s", "time to target (s)"), ("mean_step_time_s", "step (s)"))
# Charts of the comparison on the parent run (tasks.summary.plot), shown in the Description.
CHARTS = (("reward_curves.png", "reward and held-out accuracy against wall time"),
          ("stability.png", "importance weights and trust region"))


def _ratio(iv: dict[str, Any]) -> str:
    if iv["low"] is None or iv["high"] is None:
        return f"{iv['point']:.2f}x (1 seed: no interval)"
    return f"{iv['point']:.2f}x [{iv['low']:.2f}, {iv['high']:.2f}]"


def _speed(pair: dict[str, Any]) -> str:
    """One baseline's clause: the time-to-target ratio where a seed of both reached the target,
    else the step-time ratio, with the verdict its interval allows (tasks.pairs.speed_verdict)."""
    from tasks.pairs import Interval, speed_verdict

    figure, iv = ("to the target", pair["ttt"]) if pair["ttt"]["n"] else ("per step", pair["step_time"])
    if not iv["n"]:
        return f"against {pair['baseline']}: no time measured"
    verdict = speed_verdict(Interval(**iv))
    against = f"{verdict} than" if verdict in ("faster", "slower") else f"{verdict} against"
    if iv["low"] is None:  # the ratio says "1 seed: no interval"
        return f"{against} {pair['baseline']} {figure}, {_ratio(iv)}"
    seeds = f"{iv['n']} of {len(pair['seeds'])} seeds" if iv["n"] != len(pair["seeds"]) else f"{iv['n']} seeds"
    return f"{against} {pair['baseline']} {figure}, {_ratio(iv)} ({seeds})"


def headline(pairs: Sequence[dict[str, Any]]) -> list[str]:
    """What a reader wants before any table, one sentence per arm with baselines and one on the
    reward: ``pairs`` are :func:`tasks.pairs.summarise_pairs`'s (``Pair`` as dicts). Ratios are
    baseline / arm with their 95% intervals over the paired seeds; the verdict word is the
    interval's, never the point's."""
    by_arm: dict[str, list[dict[str, Any]]] = {}
    for p in pairs:
        if not p.get("pooled"):
            by_arm.setdefault(p["arm"], []).append(p)
    lines = [f"**{arm}**: " + "; ".join(_speed(p) for p in ps) + "." for arm, ps in by_arm.items()]
    pooled = [p for p in pairs if p.get("pooled")]
    for p in pooled:
        iv, word = p["reward"], "passed" if p["passed"] else "FAILED"
        lines.append(f"**Reward**: {word} the calibrated shortfall test, {p['arm']} - {', '.join(p['pooled'])} pooled "
                     f"{iv['point']:+.3f} [{iv['low']:+.3f}, {iv['high']:+.3f}].")
    if not pooled and by_arm:
        diffs = ", ".join(f"{p['arm']} - {p['baseline']} {p['reward']['point']:+.3f}" + (
            f" [{p['reward']['low']:+.3f}, {p['reward']['high']:+.3f}]" if p["reward"]["low"] is not None else "")
            for ps in by_arm.values() for p in ps if p["reward"]["point"] is not None)
        why = next(iter(by_arm.values()))[0]["reward_verdict"]
        lines.append(f"**Reward**: not judged ({why}); final-reward differences {diffs or 'not measured'}.")
    return lines


def narrow_table(rows: Sequence[dict[str, Any]]) -> str:
    """The headline columns (:data:`NARROW_COLUMNS`) of the comparison's rows, as Markdown
    (:func:`tasks.summary.to_markdown`, the full table's formatter)."""
    import pandas as pd

    from tasks.summary import to_markdown

    return to_markdown(pd.DataFrame([[r.get(k) for k, _ in NARROW_COLUMNS] for r in rows], columns=[h for _, h in NARROW_COLUMNS]))


def comparison_description(summary: dict[str, Any], children: Sequence[dict[str, Any]],
                           links: dict[str, Any] | None = None, verdict_md: str | None = None,
                           charts: Sequence[tuple[str, str]] = (), limit: int = MAX_DESCRIPTION_CHARS,
                           full_table_url: str | None = None) -> str:
    """The Markdown of a comparison's parent run.

    ``summary``: :func:`tasks.summary.summarise`'s (``rows``, ``table_md``, ``target``, ``notes``)
    with :func:`tasks.pairs.summarise_pairs`'s ``pairs`` and ``pairs_md``.
    ``children``: ``{"arm", "seed", "url"}`` per child run. ``links``: :class:`tasks.links.RunLinks`
    as a dict (its compare-runs page is linked). ``verdict_md``: the flow's verdict; its first line
    opens the Description, its body follows the headline and the narrow table. ``charts``: ``(image
    URL, caption)`` shown as images. ``full_table_url``: where the full comparison table is (the
    parent run's comparison.md; None: the full table is shown in place of the narrow one).
    Sections that do not fit ``limit`` characters (MLflow's largest tag value) are left out from the
    end, saying so, the opening last."""
    if not summary.get("table_md"):
        raise ValueError("the summary has no comparison table (table_md): nothing to describe")
    if not summary.get("pairs_md"):
        raise ValueError("the summary has no pairs (pairs_md, tasks.pairs.summarise_pairs): the speed and reward "
                         "figures would be shown without their intervals")
    target = summary.get("target")
    title, _, body = (verdict_md or "").strip().partition("\n")
    no_target = "No reward target (no arm improved on the first step)"
    if full_table_url and summary.get("rows"):
        table_md = narrow_table(summary["rows"]) + f"\n\n[Full comparison table]({full_table_url}) (every column: stability, phases, benchmarks)."
    else:
        table_md = summary["table_md"]
    opening = [*([title] if title else []), *headline(summary.get("pairs", [])), table_md,
               (f"Target reward {target:.3f}" if target is not None else no_target)
               + "; definitions in docs/pipeline.md (the summary)."
               + "".join(f"\n\nNote: {n}" for n in summary.get("notes", []))]
    verdict = ["## Verdict", body.strip()] if body.strip() else []
    speed = ["## Pairs over seeds", summary["pairs_md"].strip()]
    pictures = ["## Charts", *(f"![{caption}]({url})" for url, caption in charts)] if charts else []
    compare = [f"[Compare the child runs]({links['compare_runs']})"] if links and links.get("compare_runs") else []
    runs = ["## Child runs", *compare, "\n".join(f"- [{c['arm']} seed {c['seed']}]({c['url']})" for c in children)]
    sections = [s for s in (opening, verdict, speed, pictures, runs) if s]
    dropped: list[str] = []
    while True:
        text = "\n\n".join("\n\n".join(s) for s in sections)
        more = f"\n\n_Left out here for length: {', '.join(dropped)}; see the run's artifacts._" if dropped else ""
        if len(text) + len(more) <= limit or len(sections) <= 1:
            return (text + more)[:limit]
        dropped.insert(0, sections.pop()[0].lstrip("# ").lower())


def child_links(ui: str, experiment_id: str, records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``{"arm", "seed", "url"}`` of each record's child run page."""
    return [{"arm": r.get("arm") or r["variant"], "seed": r["seed"], "url": run_page(ui, experiment_id, r["mlflow_run_id"])}
            for r in records if r.get("mlflow_run_id")]


@task(cache_policy=NO_CACHE)
def describe_parent_run(ref: TrackingRef, summary: dict[str, Any], records: Sequence[dict[str, Any]],
                        links: dict[str, Any] | None = None, verdict_md: str | None = None) -> str:
    """Write the comparison's Description on the parent run (its charts are the parent run's
    artifacts of the same names, logged by the flow); return the Markdown."""
    ui = ui_address(ref.tracking_uri)
    children = child_links(ui, ref.experiment_id, records)
    logged = {p.rsplit("/", 1)[-1] for p in summary.get("artifacts", [])}
    # Relative to the UI's own address, so it resolves on whatever host and port serves it.
    charts = [(f"get-artifact?path={name}&run_uuid={ref.parent_run_id}", caption)
              for name, caption in CHARTS if name in logged]
    full = artifact_page(ui, ref.experiment_id, ref.parent_run_id, "comparison.md") if "comparison.md" in logged else None
    md = comparison_description(summary, children, links, verdict_md, charts, full_table_url=full)
    set_description(client_for(ref.tracking_uri), ref.parent_run_id, md)
    return md
