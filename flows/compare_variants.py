"""Compare the variants (sync, recompute, loglinear) end to end, tracked in MLflow.

    python -m flows.compare_variants                      # tiny preset, all three variants
    python -m flows.compare_variants --preset micro       # seconds: plumbing only, nothing learns
    python -m flows.compare_variants --variants loglinear,recompute --seeds 0,1 --steps 60
    python -m flows.compare_variants --variants loglinear --oppo off,inter --set data.long_tail_frac=0.25 --set rl.max_new_tokens=64
    python -m flows.compare_variants --variants loglinear+s1,loglinear+s4,loglinear+adaptive-s8 --set rl.schedule=threaded

The pipeline, one line per task:

    prepare dataset (cached) -> warm start (cached) -> for each variant x seed:
    train (atomic checkpoints every N steps; resumes when re-run) -> evaluate the final
    checkpoint (in-domain held-out; GSM8K / MATH500 / AIME24 when their files exist)
    -> summary (table, speedups, plots, pairs with intervals over seeds) on the MLflow parent run

A variant killed mid-training resumes from its last checkpoint when the flow is run again with
the same output dir. Runs go one after another, seed by seed: each seed's arms back to back, so a slow
spell of the host falls on every arm alike (the machine this targets has 2 cores).

Embedded default: Prefect's temporary local server (state under ./.prefect) and an MLflow
SQLite store ./mlflow.db (override with MLFLOW_TRACKING_URI or --tracking-uri); team mode:
set PREFECT_API_URL and MLFLOW_TRACKING_URI to the servers started by infra/. Prints the
comparison table, the pairs table (each arm against its baselines, with 95% intervals over
seeds: tasks.pairs), how to open the MLflow UI, and, as its last line, one JSON object of key
figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

from prefect import flow
from pydantic import Field

import flows  # noqa: F401  (offline defaults before Prefect is imported)
from a3po.config import TrainConfig, Variant, preflight
from a3po.config.axes import OPPO_MODES, PLACEMENTS, OppoMode, Placement
from a3po.redact import mask_uri
from flows.cli import add_comparison_args, comparison_kwargs, csv, run_flow
from flows.common import ComparisonSpec, compare_and_summarise, launch_params, parent_params, parent_run, publish_artifacts, variant_config
from infra.launch import launch_spec
from tasks.arms import Arm, expand_arms
from tasks.evaluation import BENCHMARKS
from tasks.launched import launch_for_config
from tasks.links import RunLinks
from tasks.tracking import TrackingRef, log_to_parent

DEFAULT_VARIANTS = tuple(v.value for v in Variant)  # sync, recompute, loglinear


class CompareSpec(ComparisonSpec):
    """A comparison: the shared fields (:class:`flows.common.ComparisonSpec`) with this flow's
    defaults, and the arms to compare: ``variants`` x ``oppo`` x ``placements``."""

    default_output_dir: ClassVar[str] = "runs/compare-{preset}"
    # Descriptions as Field(description=...), not attribute docstrings: Prefect reads a deployment's
    # parameters from this file without importing it, where the docstrings cannot be found.
    benchmarks: list[str] = Field(default_factory=lambda: list(BENCHMARKS), description=(
        "Benchmarks evaluated on the step-0 and each final checkpoint (gsm8k, math500, aime24)."))
    variants: list[Arm] = Field(default_factory=lambda: [Arm(variant=v) for v in Variant], min_length=1, description=(
        "The variants compared: any of sync, recompute, loglinear, or arms by name (loglinear+s4: fixed staleness bound 4; "
        "loglinear+adaptive: rl.staleness_control adaptive; loglinear+oppo-inter)."))
    oppo: list[OppoMode] | None = Field(default=None, description=(
        "OPPO modes compared like the variants: each variant once per mode, as the arm `VARIANT` (off) or "
        "`VARIANT+oppo-MODE`; None: as the config says. A mode the config cannot run (intra on the GRPO path) "
        "fails when the flow starts, naming the field."))
    placements: list[Placement] | None = Field(default=None, description=(
        "Where generation runs, compared like the variants: each arm once per placement, baselines taken within a "
        "placement (a disaggregated arm runs as a trainer process and a rollout worker process, each on its own "
        "cores); None: as the config says."))
    fanout_deployment: str | None = Field(default=None, description=(
        "E.g. train-one/train-one (infra/prefect.yaml): each arm x seed runs as a run of that deployment on its "
        "pool's workers, in parallel (needs a real Prefect server, an output dir every worker sees and an MLflow "
        "store each can reach); None: in this process, in turn."))


def check_arms(spec: CompareSpec, base: TrainConfig) -> list[Arm]:
    """The arms as the configs they build (:meth:`tasks.arms.Arm.of`); an unknown name or an
    unsupported combination (e.g. OPPO intra on the GRPO path) raises here, naming the field."""
    arms = expand_arms(list(spec.variants), spec.oppo, spec.placements)
    return list(dict.fromkeys(Arm.of(variant_config(base, a, spec.seeds[0], spec.variant_overrides)) for a in arms))


def check_spec(spec: CompareSpec) -> None:
    """Every arm's config now, so a bad value (file, --set, option, deployment parameter) fails in
    one line before any server starts or a deployment is registered (the flow builds them again
    from its spec)."""
    base = spec.train_config()
    arms = check_arms(spec, base)
    if not spec.fanout_deployment:  # deployed workers check their own machine (train_arm)
        for arm in arms:
            preflight(variant_config(base, arm, spec.seeds[0], spec.variant_overrides))
    launch_for_config(launch_spec(spec.launch), base)  # e.g. 2 ranks without a DeepSpeed config
    if spec.fanout_deployment and not os.environ.get("PREFECT_API_URL"):
        raise ValueError("--fanout-deployment needs a Prefect server with workers: set PREFECT_API_URL (infra/start_prefect_server.sh)")


@flow(name="compare-variants", log_prints=True)
def compare_variants(spec: CompareSpec = CompareSpec()) -> dict[str, Any]:  # noqa: B008  (a frozen value)
    """Train and evaluate ``spec.variants`` (x OPPO modes x placements) x ``spec.seeds`` from one
    warm start; compare them. ``spec``: :class:`CompareSpec` (checked before anything runs,
    naming the field). variant_overrides: ``{variant: {rl_field: value}}`` (e.g. ``{"loglinear":
    {"proximal": "metrics"}}`` logs loglinear's approximation error). output_dir: default
    runs/compare-<preset>; re-running resumes; ``{date}`` in it becomes the UTC date. launch:
    "local" (in-process, the default) or a LaunchSpec as a dict, e.g. ``{"mode": "torchrun",
    "nproc_per_node": 2}``: each training then runs ``python -m a3po.training.command`` as launched ranks
    (infra.launch; docs/distributed.md); the topology is recorded on the runs.
    """
    t0 = time.perf_counter()
    base = spec.train_config()
    launched = launch_for_config(spec.launch_spec(), base)  # the ZeRO stage the ranks will run, for the record
    arms = check_arms(spec, base)
    out = spec.output_folder()
    flow_values = dict(preset=spec.preset, variants=[a.name for a in spec.variants], oppo=spec.oppo, placements=spec.placements,
                       seeds=spec.seeds, benchmarks=spec.benchmarks, bench_limit=spec.bench_limit, data_dir=spec.data_dir,
                       target_fraction=spec.target_fraction, smooth_frac=spec.smooth_frac, variant_overrides=spec.variant_overrides)
    launch_tags, launch_param = launch_params(launched)
    tags = {"a3po.kind": "compare", "a3po.preset": spec.preset, "a3po.variants": ",".join(a.name for a in arms),
            "a3po.seeds": ",".join(map(str, spec.seeds)), "a3po.fanout": spec.fanout_deployment or "none", **launch_tags}
    run_name = f"compare-{spec.preset}"
    with parent_run(spec, out, run_name, tags, {**parent_params(base, **flow_values), **launch_param}) as ref:
        records, links, summary = compare_and_summarise(spec, base, ref, out, arms, launch=launched, fanout_deployment=spec.fanout_deployment)
        log_to_parent(ref, summary["metrics"], summary["artifacts"])
        publish_artifacts(spec, run_name, ref, summary, records, links)
    return {**result_of(ref, out, base, records, summary, time.perf_counter() - t0), "links": links}


def result_of(ref: TrackingRef, out: Path, base: TrainConfig, records: list[dict], summary: dict, wall_s: float) -> dict[str, Any]:
    return {
        "parent_run_id": ref.parent_run_id,
        "experiment_id": ref.experiment_id,
        "tracking_uri": mask_uri(ref.tracking_uri),  # printed and returned: never a password
        "output_dir": str(out),
        "steps": base.rl.steps,
        "runs": records,
        "summary": summary,
        "wall_s": wall_s,
    }


def key_figures(result: dict[str, Any]) -> dict[str, Any]:
    """The flat JSON line printed last."""
    rows = result["summary"]["rows"]
    figs: dict[str, Any] = {
        "variants": [r["variant"] for r in rows],
        "seeds": rows[0]["seeds"] if rows else 0,
        "steps": result["steps"],
        "target_reward": result["summary"]["target"],
    }
    for r in rows:
        for k in ("final_acc", "final_reward", "mean_step_time_s", "time_to_target_s"):
            figs[f"{r['variant']}/{k}"] = None if r[k] is None else round(r[k], 4)
    figs.update({k: round(v, 4) for k, v in result["summary"]["metrics"].items() if k.startswith("speedup/")})
    figs.update({"parent_run_id": result["parent_run_id"], "parent_run_url": result["links"]["parent_run"],
                 "tracking_uri": result["tracking_uri"], "wall_s": round(result["wall_s"], 1)})
    return figs


def printed_summary(summary: dict[str, Any]) -> str:
    """What the command line prints of the comparison: its table, then each arm against its
    baselines with intervals over seeds (tasks.pairs), then the comparison's notes."""
    return "\n".join(["", summary["table_md"], "", summary["pairs_md"], *(f"note: {n}" for n in summary["notes"])])


# --- command line -------------------------------------------------------------------------


def build_parser(prog: str = "python -m flows.compare_variants") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help="comma-separated subset of sync,recompute,loglinear, or arms by name: loglinear+s4 (fixed staleness bound 4), "
                         "loglinear+adaptive[-s8] (rl.staleness_control adaptive, within [1, rl.max_staleness or 8]; it runs the "
                         "threaded schedule: compare fixed bounds with --set rl.schedule=threaded)")
    ap.add_argument("--oppo", default=None, metavar="MODES",
                    help=f"comma-separated OPPO modes ({','.join(OPPO_MODES.names())}) compared like the variants: one arm per "
                         "variant and mode, e.g. off,inter runs loglinear and loglinear+oppo-inter (default: as the config says)")
    ap.add_argument("--placements", default=None, metavar="PLACEMENTS",
                    help=f"comma-separated placements ({','.join(PLACEMENTS)}) compared like the variants: each arm "
                         "in each placement, baselines within a placement (default: as the config says)")
    add_comparison_args(ap, CompareSpec)
    ap.add_argument("--fanout-deployment", default=None, metavar="FLOW/DEPLOYMENT",
                    help="e.g. train-one/train-one: run each variant x seed as a run of this deployment on its work pool's "
                         "workers, in parallel (needs PREFECT_API_URL; docs/distributed.md); default: in this process")
    return ap


def main(argv: list[str] | None = None, prog: str = "python -m flows.compare_variants") -> int:
    args = build_parser(prog).parse_args(argv)
    own = {"variants": csv(args.variants), "oppo": csv(args.oppo) if args.oppo is not None else None,
           "placements": csv(args.placements) if args.placements is not None else None, "fanout_deployment": args.fanout_deployment}

    status, result, api = run_flow("compare_variants", compare_variants, CompareSpec, comparison_kwargs(args), own, check_spec)
    if result is None:
        return status
    print(printed_summary(result["summary"]))
    print(f"\nartifacts: {result['output_dir']}/summary   run dirs: {result['output_dir']}")
    print(f"MLflow parent run {result['parent_run_id']} in {result['tracking_uri']}")
    print("\n".join(RunLinks(**result["links"]).lines()))
    figs = key_figures(result)
    figs["prefect_server_startup_s"] = round(api["startup_s"], 1)
    print(json.dumps(figs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
