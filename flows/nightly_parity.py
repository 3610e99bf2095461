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
parent run is tagged ``parity=pass|fail|not measurable`` (the last where the references' reward
did not move: :func:`tasks.parity.references_moved`; parity between arms that did not learn is no
evidence) and carries ``parity/...`` metrics and a report (its first line names the rule and
calibration); the report also lists earlier nightly runs found in
MLflow (``search_runs`` on the tags) and says whether tonight's bounds are better or worse than
their median. The command exits non-zero on a fail and on a night that could not be judged.

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
from typing import Any, ClassVar, Literal

from prefect import flow, get_run_logger
from pydantic import Field, ValidationInfo, field_validator, model_validator

import flows  # noqa: F401  (offline defaults before Prefect is imported)
from a3po.config import Variant
from a3po.redact import mask_uri
from flows.cli import add_comparison_args, comparison_kwargs, csv, run_flow
from flows.common import ComparisonSpec, compare_and_summarise, launch_params, parent_params, parent_run, publish_artifacts
from tasks.arms import Arm
from tasks.description import describe_parent_run
from tasks.launched import launch_for_config
from tasks.links import RunLinks
from tasks.models import register_nightly_candidate, registry_line
from tasks.parity import (
    METRICS,
    NIGHTLY_SEEDS,
    NIGHTLY_STEPS,
    RULES,
    ParityResult,
    calibration_for,
    check_references,
    decide_parity,
    earlier_nights,
    parity_metrics,
    references_moved,
    report_markdown,
    trend_verdict,
)
from tasks.tracking import log_to_parent
from tasks.verdicts import all_pass

NOT_MEASURABLE = "not measurable"  # the references' reward did not move: tasks.parity.references_moved


class NightlySpec(ComparisonSpec):
    """A nightly parity run: the shared fields (:class:`flows.common.ComparisonSpec`) with this
    flow's defaults (K = 6 seeds, the preset's nightly budget of RL steps, tasks.parity.NIGHTLY_STEPS,
    where neither the steps nor a config are given, no benchmarks, a folder per UTC date) and the
    parity decision's own fields (see tasks.parity)."""

    default_output_dir: ClassVar[str] = "runs/nightly/{date}"
    # Descriptions as Field(description=...), not attribute docstrings: Prefect reads a deployment's
    # parameters from this file without importing it, where the docstrings cannot be found.
    seeds: list[int] = Field(default_factory=lambda: list(NIGHTLY_SEEDS), min_length=1, description=(
        "RL seeds, paired across arms (the nightly budget: K = 6)."))
    experiment: str = Field(default="a3po-nightly", description="MLflow experiment of the parent and child runs.")
    candidate: Arm = Field(default=Arm(variant=Variant.LOGLINEAR), description=(
        "The arm judged (tasks.arms): a variant, or `VARIANT+oppo-MODE` to compare OPPO on with off (candidate "
        "`loglinear+oppo-inter`, references `[loglinear]`); a name is read as its arm."))
    references: list[Arm] = Field(default_factory=lambda: [Arm(variant=Variant.RECOMPUTE), Arm(variant=Variant.SYNC)],
                                  description="The arms the candidate must not fall short of.")
    metric: Literal[METRICS] = Field(default="final_reward", description=(
        "final_reward (mean training reward over the last smooth_frac of steps) or final_acc."))
    tolerance: float = Field(default=0.1, ge=0, allow_inf_nan=False, description=(
        "Largest acceptable shortfall of the candidate, in the metric's units (rule noninferiority)."))
    rule: Literal[(*RULES, "auto")] = Field(default="auto", description=(
        "shortfall: a one-sided z-test of the candidate's per-seed difference to the references' mean against the "
        "healthy candidate's (healthy_mean and noise_sd measured on calibration_seeds seeds by bench.nightly_power; "
        "false alarms at 1 - confidence); noninferiority: the paired bootstrap per reference with tolerance; auto: "
        "shortfall with the recorded calibration where the setting has one (the preset as shipped), else noninferiority."))
    # Every bound is checked when the spec is built, before anything trains (a bad value found
    # after training would exit 1, the status of a real parity failure).
    noise_sd: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    healthy_mean: float | None = Field(default=None, allow_inf_nan=False)
    calibration_seeds: int | None = Field(default=None, ge=2)  # the t quantile needs N - 1 >= 1 degrees of freedom
    # Of the paired bootstrap, and the shortfall rule's false-alarm rate 1 - confidence (a one-sided
    # test below 0.5 would fail a healthy candidate more often than not).
    confidence: float = Field(default=0.95, gt=0.5, lt=1)
    n_boot: int = Field(default=10_000, ge=100, le=1_000_000)  # bootstrap resamples (memory: n_boot x seeds)
    history: int = Field(default=14, ge=0, le=1000)  # earlier nights in the trend
    fail_on_regression: bool = Field(default=False, description=(
        "Raise ParityRegression on a fail or not-measurable verdict so the Prefect flow run ends Failed (the "
        "deployments set it; the "
        "command line exits 1 instead)."))

    @field_validator("references")
    @classmethod
    def _something_to_compare(cls, value: list[Arm], info: ValidationInfo) -> list[Arm]:
        candidate = info.data.get("candidate")
        check_references(candidate.name if candidate else "?", [r.name for r in value])  # none, itself, or repeated
        return value

    @model_validator(mode="before")
    @classmethod
    def _nightly_budget(cls, values: Any) -> Any:
        if not isinstance(values, dict):
            return values
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


def check_arms(spec: NightlySpec) -> tuple[Arm, list[Arm]]:
    """Candidate and references as the configs they build (a bare variant keeps the config's OPPO
    section); an unknown name or an unsupported combination raises here."""
    base = spec.train_config()
    candidate = Arm.of(spec.candidate.config(base, spec.seeds[0]))
    references = [Arm.of(r.config(base, spec.seeds[0])) for r in spec.references]
    check_references(candidate.name, [r.name for r in references])  # as built: a bare variant may be the candidate's config
    return candidate, references


def check_spec(spec: NightlySpec) -> None:
    """What the night builds before it trains: its arms, its decision rule and its launch; raises
    naming the field (the command line and a deployment's registration call it)."""
    cand, refs = check_arms(spec)
    resolve_rule(spec, spec.train_config().rl.steps, cand.name, [r.name for r in refs])
    launch_for_config(spec.launch_spec(), spec.train_config())


def resolve_rule(spec: NightlySpec, steps: int, candidate: str,
                 references: list[str]) -> tuple[str, float | None, float | None, int | None, str]:
    """``(rule, noise_sd, healthy_mean, calibration_seeds, note)``: the rule the night decides
    with (``spec.rule``), its calibration (given in the spec, or recorded for this setting:
    ``candidate`` and ``references`` by name), and a line saying which and why."""
    rule, noise_sd, healthy_mean, calibration_seeds, metric = spec.rule, spec.noise_sd, spec.healthy_mean, spec.calibration_seeds, spec.metric
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
    shared = cal.shared_with(spec.seeds)
    sample = f"IN SAMPLE: tonight's seeds {shared} are calibration seeds" if shared else "out of sample: no seed of tonight's is a calibration seed"
    note = f"shortfall, calibrated on {cal.seeds} seeds (healthy mean {cal.healthy_mean:+.4f}, sd {cal.noise_sd:.4f}; {cal.command}); {sample}"
    return "shortfall", cal.noise_sd, cal.healthy_mean, cal.seeds, note


@flow(name="nightly-parity", log_prints=True)
def nightly_parity(spec: NightlySpec = NightlySpec()) -> dict[str, Any]:  # noqa: B008  (a frozen value)
    """Compare ``spec.candidate`` with ``spec.references`` over ``spec.seeds``; decide parity
    (see tasks.parity). ``spec``: :class:`NightlySpec` (checked before anything runs, naming the
    field). overrides / variant_overrides: as in compare_variants (e.g. a planted regression:
    ``{"loglinear": {"advantage": "planted_negated"}}``). output_dir: default runs/nightly/<UTC date>.
    """
    t0 = time.perf_counter()
    base = spec.train_config()
    cand, refs = check_arms(spec)
    candidate, references = cand.name, [r.name for r in refs]  # the records' and the tables' labels
    rule, noise_sd, healthy_mean, calibration_seeds, rule_note = resolve_rule(spec, base.rl.steps, candidate, references)
    arms = list(dict.fromkeys([cand, *refs]))
    launched = launch_for_config(spec.launch_spec(), base)  # the ZeRO stage the ranks will run, for the record
    out = spec.output_folder()
    commit = git_commit()
    preset, metric = spec.preset, spec.metric
    flow_values = dict(preset=preset, seeds=spec.seeds, candidate=candidate, references=references, metric=metric, tolerance=spec.tolerance,
                       confidence=spec.confidence, n_boot=spec.n_boot, smooth_frac=spec.smooth_frac, variant_overrides=spec.variant_overrides,
                       rule=rule, noise_sd=noise_sd, healthy_mean=healthy_mean, calibration_seeds=calibration_seeds)
    launch_tags, launch_param = launch_params(launched)
    tags = {"a3po.kind": "nightly", "a3po.preset": preset, "a3po.git_commit": commit, "a3po.candidate": candidate, **launch_tags}
    with parent_run(spec, out, f"nightly-{preset}", tags, {**parent_params(base, **flow_values), **launch_param}) as ref:
        records, links, summary = compare_and_summarise(spec, base, ref, out, arms, launch=launched)
        results = [ParityResult(**r) for r in decide_parity(records, candidate, references, metric, spec.tolerance, spec.confidence,
                                                             spec.n_boot, spec.smooth_frac, rule, noise_sd, healthy_mean or 0.0,
                                                             calibration_seeds)]
        trend = earlier_nights(ref.tracking_uri, ref.experiment_id, ref.parent_run_id, candidate, [r.reference for r in results],
                               spec.history)
        verdict = "pass" if all_pass((r.passed for r in results), "parity results") else "fail"
        unmoved = references_moved(records, references, spec.smooth_frac)
        if unmoved and verdict == "pass":  # a fail stands: the candidate fell below arms that stayed put
            verdict = NOT_MEASURABLE
        report = (f"**Not measurable**: {unmoved}.\n\n" if verdict == NOT_MEASURABLE else "") + \
            f"Rule: {rule_note}\n\n" + report_markdown(results, trend)
        trend_line = trend_verdict(results, trend)
        (out / "summary" / "parity.md").write_text(f"# Nightly parity: {verdict}\n\n{report}\nTrend: {trend_line}\n")
        (out / "summary" / "parity.json").write_text(json.dumps({"verdict": verdict, "results": [r.__dict__ for r in results], "trend": trend},
                                                                indent=1))
        log_to_parent(ref, {**summary["metrics"], **parity_metrics(results), "parity/pass": float(verdict == "pass")},
                      [*summary["artifacts"], str(out / "summary" / "parity.md"), str(out / "summary" / "parity.json")],
                      tags={"parity": verdict})
        registered = register_nightly_candidate(ref, records, preset, candidate, verdict, commit)
        verdict_md = f"# Nightly parity: {verdict.upper()}\n\n{report}\n\nTrend: {trend_line}" + registry_line(registered)
        describe_parent_run(ref, summary, records, links, verdict_md=verdict_md)
        publish_artifacts(spec, f"nightly-{preset}", ref, summary, records, links, verdict_md)
        get_run_logger().info(f"parity {verdict}; trend: {trend_line}")
    if verdict != "pass" and spec.fail_on_regression:
        raise ParityRegression(f"convergence parity {'failed' if verdict == 'fail' else 'could not be judged'}:\n{report}")
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
        "registered": registered,
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

    status, res, api = run_flow("nightly_parity", nightly_parity, NightlySpec, comparison_kwargs(args), own, check_spec)
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
