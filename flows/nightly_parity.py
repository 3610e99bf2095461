"""Nightly convergence parity: does loglinear (A-3PO) still converge like recompute and sync?

    python -m flows.nightly_parity                         # tiny preset, 6 seeds x 75 steps, exit 1 on failure
    python -m flows.nightly_parity --preset micro --seeds 0,1 --steps 4   # plumbing smoke run
    python -m flows.nightly_parity --candidate loglinear+oppo-inter --references loglinear \
        --set data.long_tail_frac=0.25 --set rl.max_new_tokens=64      # OPPO on vs off (docs/oppo.md)

Runs the comparison (``flows.common.run_comparison``) over K seeds, then decides parity from the
per-seed differences (candidate - reference) of the final smoothed training reward (or the final
held-out accuracy), by one of the rules of :mod:`tasks.parity`. ``auto`` (the default) takes the
shortfall rule where the setting has a recorded calibration (the tiny preset at its nightly
budget: K = 6 seeds at 75 RL steps): the mean difference to the references' mean must not fall
below the healthy candidate's by more than ``t sigma sqrt(1/K + 1/N)``, sigma the seed noise
measured on N seeds by ``bench.nightly_power``. Elsewhere it takes the noninferiority rule: per reference, the paired
bootstrap CI of the mean difference must have its lower bound above ``-tolerance``. The MLflow
parent run is tagged ``parity=pass|fail`` and carries ``parity/...`` metrics and a report (its
first line names the rule and calibration); the report also lists earlier nightly runs found in
MLflow (``search_runs`` on the tags) and says whether tonight's bounds are better or worse than
their median. The command exits non-zero on failure.

Scheduled by a Prefect deployment (cron ``0 2 * * *``): ``infra/prefect.yaml`` or
``python infra/deploy_nightly.py``; schedules need a real Prefect server and a worker
(``infra/start_prefect_server.sh``, ``infra/start_worker.sh``), not the temporary one.
Each night gets its own output dir (``runs/nightly/<date>``), so it trains afresh; re-running
the same day resumes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

from prefect import flow, get_run_logger
from pydantic import Field, model_validator

import flows  # noqa: F401  (offline defaults before Prefect is imported)
from a3po.redact import mask_uri
from flows.cli import add_comparison_args, comparison_kwargs, csv, run_flow
from flows.common import ComparisonSpec, compare_and_summarise, launch_params, parent_params, parent_run
from tasks.arms import arm_config, arm_name
from tasks.links import RunLinks
from tasks.parity import (
    METRICS,
    NIGHTLY_SEEDS,
    NIGHTLY_STEPS,
    RULES,
    ParityResult,
    calibration_for,
    decide_parity,
    earlier_nights,
    parity_metrics,
    report_markdown,
    trend_verdict,
)
from tasks.summary import SMOOTH_FRAC, TARGET_FRACTION
from tasks.tracking import log_to_parent
from tasks.training import launch_for_config


class NightlySpec(ComparisonSpec):
    """A nightly parity run's shared parameters, with this flow's defaults: K = 6 seeds, the
    preset's nightly budget of RL steps (tasks.parity.NIGHTLY_STEPS) where neither the steps nor
    a config are given, no benchmarks, a folder per UTC date."""

    default_output_dir: ClassVar[str] = "runs/nightly/{date}"
    seeds: list[int] = Field(default_factory=lambda: list(NIGHTLY_SEEDS), min_length=1)
    experiment: str = "a3po-nightly"

    @model_validator(mode="before")
    @classmethod
    def _nightly_budget(cls, values: dict[str, Any]) -> dict[str, Any]:
        sets_steps = values.get("config") or "steps" in ((values.get("overrides") or {}).get("rl") or {})
        if values.get("steps") is None and not sets_steps and values.get("preset", "tiny") in NIGHTLY_STEPS:
            return {**values, "steps": NIGHTLY_STEPS[values.get("preset", "tiny")]}
        return values


class ParityRegression(RuntimeError):
    """The candidate fell short of a reference by more than the tolerance."""


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def check_arms(spec: ComparisonSpec, candidate: str, references: list[str]) -> tuple[str, list[str]]:
    """Candidate and references by the name of the config each builds (a bare variant keeps the
    config's OPPO section); an unknown name or an unsupported combination raises here."""
    base = spec.train_config()
    label = lambda arm: arm_name(arm_config(base, arm, spec.seeds[0]))  # noqa: E731
    return label(candidate), [label(r) for r in references]


def resolve_rule(spec: ComparisonSpec, steps: int, candidate: str, references: list[str], metric: str, rule: str,
                 noise_sd: float | None, healthy_mean: float | None,
                 calibration_seeds: int | None = None) -> tuple[str, float | None, float | None, int | None, str]:
    """``(rule, noise_sd, healthy_mean, calibration_seeds, note)``: the rule the night decides
    with, its calibration (given, or recorded for this setting), and a line saying which and why."""
    if rule not in (*RULES, "auto"):
        raise ValueError(f"rule must be one of {[*RULES, 'auto']}, got {rule!r}")
    if rule == "noninferiority":
        return rule, None, None, None, "noninferiority (paired bootstrap per reference, tolerance)"
    if noise_sd is not None:
        if not noise_sd > 0:
            raise ValueError(f"noise_sd must be > 0, got {noise_sd}")
        mu = healthy_mean or 0.0
        on = f", {calibration_seeds} seeds" if calibration_seeds else ""
        return "shortfall", noise_sd, mu, calibration_seeds, f"shortfall with the given calibration (healthy mean {mu:+.4f}, sd {noise_sd:.4f}{on})"
    shipped = not any((spec.config, spec.overrides, spec.model, spec.dataset, spec.task))
    try:
        if not shipped:
            raise ValueError(f"the recorded calibrations are for the presets as shipped, and this night sets "
                             f"{[k for k in ('config', 'overrides', 'model', 'dataset', 'task') if getattr(spec, k)]}: measure this setting with "
                             "python -m bench.nightly_power, then pass noise_sd and healthy_mean")
        cal = calibration_for(spec.preset, steps, candidate, references, metric)
    except ValueError as e:
        if rule == "shortfall":
            raise
        note = f"noninferiority (paired bootstrap per reference, tolerance): no calibration for this setting ({e})"
        return "noninferiority", None, None, None, note
    note = f"shortfall, calibrated on {cal.seeds} seeds (healthy mean {cal.healthy_mean:+.4f}, sd {cal.noise_sd:.4f}; {cal.command})"
    return "shortfall", cal.noise_sd, cal.healthy_mean, cal.seeds, note


@flow(name="nightly-parity", log_prints=True)
def nightly_parity(
    preset: str = "tiny",
    seeds: tuple[int, ...] | list[int] = NIGHTLY_SEEDS,
    steps: int | None = None,
    candidate: str = "loglinear",
    references: tuple[str, ...] | list[str] = ("recompute", "sync"),
    metric: str = "final_reward",
    tolerance: float = 0.1,
    confidence: float = 0.95,
    n_boot: int = 10_000,
    smooth_frac: float = SMOOTH_FRAC,
    max_staleness: int | None = None,
    overrides: dict[str, Any] | None = None,
    variant_overrides: dict[str, dict[str, Any]] | None = None,
    benchmarks: tuple[str, ...] | list[str] = (),
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
    model: str | None = None,
    dataset: str | None = None,
    task: str | None = None,
    checkpoint_every: int | None = None,
    bench_max_new_tokens: int = 64,
    target_fraction: float = TARGET_FRACTION,
    rule: str = "auto",
    noise_sd: float | None = None,
    healthy_mean: float | None = None,
    calibration_seeds: int | None = None,
) -> dict[str, Any]:
    """Compare ``candidate`` with ``references`` over ``seeds``; decide parity (see tasks.parity).

    The shared parameters are those of :class:`flows.common.ComparisonSpec`; this flow's own:

    candidate / references: arms (tasks.arms): a variant, or ``<variant>+oppo-<mode>`` to compare
    OPPO on with off (e.g. candidate ``loglinear+oppo-inter``, references ``["loglinear"]``).
    seeds / steps: default the nightly budget: seeds 0-5 and, where neither steps nor a config are
    given, the preset's tasks.parity.NIGHTLY_STEPS (tiny: 75), the setting the calibration was measured at.
    metric: final_reward (mean training reward over the last smooth_frac of steps) or final_acc.
    tolerance: largest acceptable shortfall of the candidate, in the metric's units (rule noninferiority).
    rule: ``shortfall`` (a one-sided z-test of the candidate's per-seed difference to the
    references' mean against the healthy candidate's, ``healthy_mean`` and ``noise_sd`` measured on
    ``calibration_seeds`` seeds
    by bench.nightly_power; false alarms at ``1 - confidence``; see tasks.parity),
    ``noninferiority`` (the paired bootstrap per reference with ``tolerance``), or ``auto``:
    shortfall with the recorded calibration where the setting has one (tasks.parity.CALIBRATIONS:
    the preset as shipped, no config, overrides, model, dataset or task), else noninferiority.
    confidence / n_boot: of the paired bootstrap. history: earlier nights in the trend.
    overrides / variant_overrides: as in compare_variants (e.g. a planted regression:
    ``{"loglinear": {"advantage": "planted_negated"}}``). output_dir: default
    runs/nightly/<UTC date>. fail_on_regression: raise :class:`ParityRegression` on a fail
    verdict so the Prefect flow run ends Failed (the deployments set it; the command line exits 1
    instead).
    """
    spec = NightlySpec.of_flow(locals())  # first: raises naming the field, before anything runs
    t0 = time.perf_counter()
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    base = spec.train_config()
    candidate, references = check_arms(spec, candidate, list(references))
    rule, noise_sd, healthy_mean, calibration_seeds, rule_note = resolve_rule(spec, base.rl.steps, candidate, references, metric, rule,
                                                                              noise_sd, healthy_mean, calibration_seeds)
    arms = list(dict.fromkeys([candidate, *references]))
    launched = launch_for_config(spec.launch_spec(), base)  # the ZeRO stage the ranks will run, for the record
    out = spec.output_folder()
    commit = git_commit()
    flow_values = dict(preset=preset, seeds=spec.seeds, candidate=candidate, references=references, metric=metric, tolerance=tolerance,
                       confidence=confidence, n_boot=n_boot, smooth_frac=smooth_frac, variant_overrides=variant_overrides,
                       rule=rule, noise_sd=noise_sd, healthy_mean=healthy_mean, calibration_seeds=calibration_seeds)
    launch_tags, launch_param = launch_params(launched)
    tags = {"a3po.kind": "nightly", "a3po.preset": preset, "a3po.git_commit": commit, "a3po.candidate": candidate, **launch_tags}
    with parent_run(spec, out, f"nightly-{preset}", tags, {**parent_params(base, **flow_values), **launch_param}) as ref:
        records, links, summary = compare_and_summarise(spec, base, ref, out, arms, launch=launched)
        results = [ParityResult(**r) for r in decide_parity(records, candidate, references, metric, tolerance, confidence, n_boot, smooth_frac,
                                                             rule, noise_sd, healthy_mean or 0.0, calibration_seeds)]
        trend = earlier_nights(ref.tracking_uri, ref.experiment_id, ref.parent_run_id, candidate, [r.reference for r in results], history)
        verdict = "pass" if all(r.passed for r in results) else "fail"
        report = f"Rule: {rule_note}\n\n" + report_markdown(results, trend)
        trend_line = trend_verdict(results, trend)
        (out / "summary" / "parity.md").write_text(f"# Nightly parity: {verdict}\n\n{report}\nTrend: {trend_line}\n")
        (out / "summary" / "parity.json").write_text(json.dumps({"verdict": verdict, "results": [r.__dict__ for r in results], "trend": trend},
                                                                indent=1))
        log_to_parent(ref, {**summary["metrics"], **parity_metrics(results)},
                      [*summary["artifacts"], str(out / "summary" / "parity.md"), str(out / "summary" / "parity.json")],
                      tags={"parity": verdict})
        get_run_logger().info(f"parity {verdict}; trend: {trend_line}")
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
        "tracking_uri": mask_uri(ref.tracking_uri),  # printed and returned: never a password
        "output_dir": str(out),
        "git_commit": commit,
        "wall_s": time.perf_counter() - t0,
    }


def build_parser(prog: str = "python -m flows.nightly_parity") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--candidate", default="loglinear")
    ap.add_argument("--references", default="recompute,sync")
    ap.add_argument("--metric", default="final_reward", choices=METRICS)
    ap.add_argument("--tolerance", type=float, default=0.1, help="largest acceptable shortfall (metric units; rule noninferiority)")
    ap.add_argument("--rule", default="auto", choices=[*RULES, "auto"],
                    help="shortfall: z-test against the healthy candidate's recorded calibration; noninferiority: paired bootstrap per "
                         "reference with --tolerance; auto (default): shortfall where the setting has a recorded calibration")
    ap.add_argument("--noise-sd", type=float, default=None, help="the healthy pooled differences' seed-to-seed sd (bench.nightly_power)")
    ap.add_argument("--healthy-mean", type=float, default=None, help="the healthy pooled differences' mean (bench.nightly_power)")
    ap.add_argument("--calibration-seeds", type=int, default=None,
                    help="how many seeds --noise-sd and --healthy-mean were measured on (their error widens the threshold)")
    ap.add_argument("--confidence", type=float, default=0.95)
    ap.add_argument("--n-boot", type=int, default=10_000)
    ap.add_argument("--history", type=int, default=14, help="earlier nights to compare with")
    add_comparison_args(ap, NightlySpec)
    return ap


def main(argv: list[str] | None = None, prog: str = "python -m flows.nightly_parity") -> int:
    args = build_parser(prog).parse_args(argv)
    own = dict(candidate=args.candidate, references=csv(args.references), metric=args.metric, tolerance=args.tolerance,
               confidence=args.confidence, n_boot=args.n_boot, history=args.history, rule=args.rule, noise_sd=args.noise_sd,
               healthy_mean=args.healthy_mean, calibration_seeds=args.calibration_seeds)

    def check(spec: ComparisonSpec) -> None:
        cand, refs = check_arms(spec, own["candidate"], own["references"])
        resolve_rule(spec, spec.train_config().rl.steps, cand, refs, own["metric"], own["rule"], own["noise_sd"], own["healthy_mean"],
                     own["calibration_seeds"])
        launch_for_config(spec.launch_spec(), spec.train_config())

    status, res, api = run_flow("nightly_parity", nightly_parity, NightlySpec, comparison_kwargs(args), own, check)
    if res is None:
        return status
    print("\n" + res["table_md"] + "\n\n" + res["report_md"])
    print(f"trend: {res['trend_line']}")
    print(f"parity: {res['verdict'].upper()}   MLflow parent run {res['parent_run_id']} in {res['tracking_uri']}")
    print("\n".join(RunLinks(**res["links"]).lines()))
    figs = {"verdict": res["verdict"], "git_commit": res["git_commit"]}
    for r in res["results"]:
        tag = f"{r['candidate']}_vs_{r['reference']}"
        figs.update({f"{tag}/mean_diff": round(r["mean_diff"], 4), f"{tag}/ci_low": round(r["ci_low"], 4), f"{tag}/pass": r["passed"]})
    figs.update({"earlier_nights": len(res["trend"]), "parent_run_id": res["parent_run_id"], "parent_run_url": res["links"]["parent_run"],
                 "wall_s": round(res["wall_s"], 1), "prefect_server_startup_s": round(api["startup_s"], 1)})
    print(json.dumps(figs), flush=True)
    return 0 if res["verdict"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
