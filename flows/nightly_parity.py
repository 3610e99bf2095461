"""Nightly convergence parity: does loglinear (A-3PO) still converge like recompute and sync?

    python -m flows.nightly_parity                         # tiny preset, 3 seeds, exit 1 on failure
    python -m flows.nightly_parity --preset micro --seeds 0,1 --steps 4   # plumbing smoke run
    python -m flows.nightly_parity --candidate loglinear+oppo-inter --references loglinear \
        --set data.long_tail_frac=0.25 --set rl.max_new_tokens=64      # OPPO on vs off (docs/oppo.md)

Runs the comparison (``flows.compare_variants.run_comparison``) over K seeds, then decides
parity with the paired-bootstrap rule of :mod:`tasks.parity`: per reference, the CI of the mean
per-seed difference (candidate - reference) of the final smoothed training reward (or the final
held-out accuracy) must have its lower bound above ``-tolerance``. The MLflow parent run is
tagged ``parity=pass|fail`` and carries ``parity/...`` metrics and a report; the report also
lists earlier nightly runs found in MLflow (``search_runs`` on the tags) and says whether
tonight's bounds are better or worse than their median. The command exits non-zero on failure.

Scheduled by a Prefect deployment (cron ``0 2 * * *``): ``infra/prefect.yaml`` or
``python infra/deploy_nightly.py``; schedules need a real Prefect server and a worker
(``infra/start_prefect_server.sh``, ``infra/start_worker.sh``), not the temporary one.
Each night gets its own output dir (``runs/nightly/<date>``), so it trains afresh; re-running
the same day resumes.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

import flows  # noqa: F401  (offline defaults before Prefect is imported)
from a3po.storage.runlock import RunFolderBusy, hold_run_folder
from flows.compare_variants import (
    _csv,
    add_launch_args,
    build_config,
    default_data_dir,
    launch_from_args,
    launch_params,
    parent_params,
    parse_sets,
    run_comparison,
)
from infra.launch import launch_spec
from tasks.arms import arm_config, arm_name
from tasks.links import RunLinks, tag_run_links
from tasks.parity import METRICS, ParityResult, decide_parity, earlier_nights, parity_metrics, report_markdown, trend_verdict
from tasks.runtime import default_tracking_uri, prefect_api
from tasks.summary import SMOOTH_FRAC, TARGET_FRACTION, summarise
from tasks.tracking import close_parent_run, log_to_parent, open_parent_run
from tasks.training import launch_for_config


class ParityRegression(RuntimeError):
    """The candidate fell short of a reference by more than the tolerance."""


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10, cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def output_folder(output_dir: str | None) -> Path:
    """``output_dir``, default ``runs/nightly/<UTC date>`` (a same-day re-run resumes)."""
    return Path(output_dir or f"runs/nightly/{dt.datetime.now(dt.timezone.utc):%Y-%m-%d}").resolve()


@flow(name="nightly-parity", log_prints=True)
def nightly_parity(
    preset: str = "tiny",
    seeds: list[int] = [0, 1, 2],
    steps: int | None = None,
    candidate: str = "loglinear",
    references: list[str] = ["recompute", "sync"],
    metric: str = "final_reward",
    tolerance: float = 0.1,
    confidence: float = 0.95,
    n_boot: int = 10_000,
    smooth_frac: float = SMOOTH_FRAC,
    max_staleness: int | None = None,
    overrides: dict[str, Any] | None = None,
    variant_overrides: dict[str, dict[str, Any]] | None = None,
    benchmarks: list[str] = [],
    bench_limit: int | None = 50,
    data_dir: str | None = None,
    tracking_uri: str | None = None,
    experiment: str = "a3po-nightly",
    output_dir: str | None = None,
    cache_dir: str | None = None,
    history: int = 14,
    torch_threads: int | None = None,
    system_metrics_interval_s: float = 10.0,
    fail_on_regression: bool = False,
    launch: str | dict[str, Any] = "local",
    config: str | None = None,
) -> dict[str, Any]:
    """Compare ``candidate`` with ``references`` over ``seeds``; decide parity (see tasks.parity).

    candidate / references: arms (tasks.arms): a variant, or ``<variant>+oppo-<mode>`` to compare
    OPPO on with off (e.g. candidate ``loglinear+oppo-inter``, references ``["loglinear"]``).

    metric: final_reward (mean training reward over the last smooth_frac of steps) or final_acc.
    tolerance: largest acceptable shortfall of the candidate, in the metric's units.
    config: YAML TrainConfig laid over the preset. overrides / variant_overrides: as in
    compare_variants (e.g. a planted regression: ``{"loglinear": {"advantage": "planted_negated"}}``).
    history: earlier nights in the trend.
    output_dir: default runs/nightly/<UTC date>. fail_on_regression: raise :class:`ParityRegression`
    on a fail verdict so the Prefect flow run ends Failed (the deployments set it; the command
    line exits 1 instead). launch: "local" (in-process) or a LaunchSpec dict, as in compare_variants.
    """
    t0 = time.perf_counter()
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    spec = launch_spec(launch)
    base = build_config(preset, config, steps=steps, max_staleness=max_staleness, overrides=overrides, torch_threads=torch_threads)
    # Arms (tasks.arms) by the name of the config each builds: a bare variant keeps the config's OPPO section.
    # An unknown name or an unsupported combination raises here, before anything runs.
    label = lambda arm: arm_name(arm_config(base, arm, seeds[0] if seeds else 0))  # noqa: E731
    candidate, references = label(candidate), [label(r) for r in references]
    variants = list(dict.fromkeys([candidate, *references]))
    spec = launch_for_config(spec, base)  # the ZeRO stage the ranks will run, for the record
    out = output_folder(output_dir)
    cache = Path(cache_dir).resolve() if cache_dir else out / "cache"
    uri = tracking_uri or default_tracking_uri()
    data_dir = data_dir if data_dir is not None else default_data_dir()
    commit = git_commit()
    flow_values = dict(preset=preset, seeds=seeds, candidate=candidate, references=references, metric=metric, tolerance=tolerance,
                       confidence=confidence, n_boot=n_boot, smooth_frac=smooth_frac, variant_overrides=variant_overrides)
    with hold_run_folder(out, log=get_run_logger().warning):  # one writer per output folder, for the whole flow run
        launch_tags, launch_param = launch_params(spec)
        ref = open_parent_run(uri, experiment, f"nightly-{preset}", str(out),
                              {"a3po.kind": "nightly", "a3po.preset": preset, "a3po.git_commit": commit, "a3po.candidate": candidate, **launch_tags},
                              {**parent_params(base, **flow_values), **launch_param})
        try:
            records = run_comparison(base, ref, out, cache, variants, seeds, variant_overrides, benchmarks, data_dir,
                                     bench_limit, 64, system_metrics_interval_s, spec)
            links = tag_run_links(ref, [r["mlflow_run_id"] for r in records])
            summary = summarise(records, str(out / "summary"), TARGET_FRACTION, smooth_frac)
            results = [ParityResult(**r) for r in decide_parity(records, candidate, references, metric, tolerance, confidence, n_boot, smooth_frac)]
            trend = earlier_nights(uri, ref.experiment_id, ref.parent_run_id, candidate, references, history)
            verdict = "pass" if all(r.passed for r in results) else "fail"
            report = report_markdown(results, trend)
            trend_line = trend_verdict(results, trend)
            (out / "summary" / "parity.md").write_text(f"# Nightly parity: {verdict}\n\n{report}\nTrend: {trend_line}\n")
            (out / "summary" / "parity.json").write_text(json.dumps({"verdict": verdict, "results": [r.__dict__ for r in results], "trend": trend}, indent=1))
            log_to_parent(ref, {**summary["metrics"], **parity_metrics(results)},
                          [*summary["artifacts"], str(out / "summary" / "parity.md"), str(out / "summary" / "parity.json")],
                          tags={"parity": verdict})
            get_run_logger().info(f"parity {verdict}; trend: {trend_line}")
        except BaseException:
            close_parent_run(ref, "FAILED")
            raise
        close_parent_run(ref, "FINISHED", tags={"parity": verdict})
        if verdict == "fail" and fail_on_regression:
            raise ParityRegression(f"convergence parity failed:\n{report}")
        return {
            "verdict": verdict,
            "results": [r.__dict__ for r in results],
            "trend": trend,
            "trend_line": trend_line,
            "report_md": report,
            "table_md": summary["table_md"],
            "runs": records,
            "parent_run_id": ref.parent_run_id,
            "links": links,
            "experiment_id": ref.experiment_id,
            "tracking_uri": uri,
            "output_dir": str(out),
            "git_commit": commit,
            "wall_s": time.perf_counter() - t0,
        }


def build_parser(prog: str = "python -m flows.nightly_parity") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--config", help="YAML TrainConfig laid over the preset")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated RL seeds (K)")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--candidate", default="loglinear")
    ap.add_argument("--references", default="recompute,sync")
    ap.add_argument("--metric", default="final_reward", choices=METRICS)
    ap.add_argument("--tolerance", type=float, default=0.1, help="largest acceptable shortfall (metric units)")
    ap.add_argument("--confidence", type=float, default=0.95)
    ap.add_argument("--n-boot", type=int, default=10_000)
    ap.add_argument("--smooth-frac", type=float, default=SMOOTH_FRAC)
    ap.add_argument("--max-staleness", type=int)
    ap.add_argument("--set", action="append", default=[], metavar="[VARIANT:]SECTION.FIELD=VALUE")
    ap.add_argument("--benchmarks", default="", help="comma-separated benchmarks to evaluate too (default none)")
    ap.add_argument("--bench-limit", type=int, default=50)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--tracking-uri", default=None)
    ap.add_argument("--experiment", default="a3po-nightly")
    ap.add_argument("--output-dir", default=None, help="default runs/nightly/<UTC date>")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--history", type=int, default=14, help="earlier nights to compare with")
    ap.add_argument("--torch-threads", type=int, default=None, help="config torch_threads (default: the config's, 1)")
    add_launch_args(ap)
    return ap


def main(argv: list[str] | None = None, prog: str = "python -m flows.nightly_parity") -> int:
    args = build_parser(prog).parse_args(argv)
    overrides, per_variant = parse_sets(args.set)
    try:  # refused here, before the Prefect server starts, when another run writes the folder
        out = output_folder(args.output_dir)  # once: the default names today's date
        with hold_run_folder(out), prefect_api() as api:
            res = nightly_parity(
                preset=args.preset, seeds=_csv(args.seeds, int), steps=args.steps, candidate=args.candidate,
                references=_csv(args.references), metric=args.metric, tolerance=args.tolerance, confidence=args.confidence,
                n_boot=args.n_boot, smooth_frac=args.smooth_frac, max_staleness=args.max_staleness,
                overrides=overrides or None, variant_overrides=per_variant or None, benchmarks=_csv(args.benchmarks),
                bench_limit=args.bench_limit or None, data_dir=args.data_dir, tracking_uri=args.tracking_uri or default_tracking_uri(),
                experiment=args.experiment, output_dir=str(out), cache_dir=args.cache_dir, history=args.history,
                torch_threads=args.torch_threads, launch=launch_from_args(args), config=args.config,
            )
    except RunFolderBusy as e:
        print(f"nightly_parity: {e}", file=sys.stderr)
        return 1
    print("\n" + res["table_md"] + "\n\n" + res["report_md"])
    print(f"trend: {res['trend_line']}")
    print(f"parity: {res['verdict'].upper()}   MLflow parent run {res['parent_run_id']} in {res['tracking_uri']}")
    print("\n".join(RunLinks(**res["links"]).lines()))
    figs = {"verdict": res["verdict"], "git_commit": res["git_commit"]}
    for r in res["results"]:
        tag = f"{r['candidate']}_vs_{r['reference']}"
        figs.update({f"{tag}/mean_diff": round(r["mean_diff"], 4), f"{tag}/ci_low": round(r["ci_low"], 4), f"{tag}/pass": r["passed"]})
    figs.update({"earlier_nights": len(res["trend"]), "parent_run_id": res["parent_run_id"], "parent_run_url": res["links"]["parent_run"], "wall_s": round(res["wall_s"], 1),
                 "prefect_server_startup_s": round(api["startup_s"], 1)})
    print(json.dumps(figs), flush=True)
    return 0 if res["verdict"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
