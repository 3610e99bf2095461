"""Compare the variants (sync, recompute, loglinear) end to end, tracked in MLflow.

    python -m flows.compare_variants                      # tiny preset, all three variants
    python -m flows.compare_variants --preset micro       # seconds: plumbing only, nothing learns
    python -m flows.compare_variants --variants loglinear,recompute --seeds 0,1 --steps 60
    python -m flows.compare_variants --variants loglinear --oppo off,inter --set data.long_tail_frac=0.25 --set rl.max_new_tokens=64

The pipeline, one line per task:

    prepare dataset (cached) -> warm start (cached) -> for each variant x seed:
    train (atomic checkpoints every N steps; resumes when re-run) -> evaluate the final
    checkpoint (in-domain held-out; GSM8K / MATH500 / AIME24 when their files exist)
    -> summary (table, speedups, plots) on the MLflow parent run

A variant killed mid-training resumes from its last checkpoint when the flow is run again with
the same output dir. Variants run one after another (the machine this targets has 2 cores).

Embedded default: Prefect's temporary local server (state under ./.prefect) and an MLflow
SQLite store ./mlflow.db (override with MLFLOW_TRACKING_URI or --tracking-uri); team mode:
set PREFECT_API_URL and MLFLOW_TRACKING_URI to the servers started by infra/. Prints the
comparison table, how to open the MLflow UI, and, as its last line, one JSON object of key
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
from a3po.redact import mask_uri
from flows.cli import add_comparison_args, comparison_kwargs, csv, run_flow
from flows.common import ComparisonSpec, compare_and_summarise, launch_params, parent_params, parent_run, variant_config
from infra.launch import launch_spec
from tasks.arms import OPPO_MODES, PLACEMENTS, arm_name, expand_arms
from tasks.evaluation import BENCHMARKS
from tasks.links import RunLinks
from tasks.summary import SMOOTH_FRAC, TARGET_FRACTION
from tasks.tracking import TrackingRef, log_to_parent
from tasks.training import launch_for_config

DEFAULT_VARIANTS = tuple(v.value for v in Variant)  # sync, recompute, loglinear


class CompareSpec(ComparisonSpec):
    """A comparison's shared parameters, with this flow's defaults."""

    default_output_dir: ClassVar[str] = "runs/compare-{preset}"
    benchmarks: list[str] = Field(default_factory=lambda: list(BENCHMARKS))


def check_arms(spec: ComparisonSpec, base: TrainConfig, variants: list[str], oppo: list[str] | None,
               placements: list[str] | None = None) -> list[str]:
    """The arms by the name of the config each builds; an unknown name or an unsupported
    combination (e.g. OPPO intra on the GRPO path) raises here, naming the field."""
    arms = expand_arms(variants, oppo, placements)
    return list(dict.fromkeys(arm_name(variant_config(base, a, spec.seeds[0], spec.variant_overrides)) for a in arms))


@flow(name="compare-variants", log_prints=True)
def compare_variants(
    preset: str = "tiny",
    variants: tuple[str, ...] | list[str] = DEFAULT_VARIANTS,
    oppo: list[str] | None = None,
    placements: list[str] | None = None,
    seeds: tuple[int, ...] | list[int] = (0,),
    steps: int | None = None,
    max_staleness: int | None = None,
    checkpoint_every: int | None = None,
    model: str | None = None,
    dataset: str | None = None,
    task: str | None = None,
    config: str | None = None,
    overrides: dict[str, Any] | None = None,
    variant_overrides: dict[str, dict[str, Any]] | None = None,
    benchmarks: tuple[str, ...] | list[str] = tuple(BENCHMARKS),
    bench_limit: int | None = 50,
    bench_max_new_tokens: int = 64,
    data_dir: str | None = None,
    tracking_uri: str | None = None,
    experiment: str = "a3po-compare",
    output_dir: str | None = None,
    cache_dir: str | None = None,
    target_fraction: float = TARGET_FRACTION,
    smooth_frac: float = SMOOTH_FRAC,
    torch_threads: int | None = None,
    system_metrics_interval_s: float = 10.0,
    launch: str | dict[str, Any] = "local",
    fanout_deployment: str | None = None,
) -> dict[str, Any]:
    """Train and evaluate ``variants`` x ``seeds`` from one warm start; compare them.

    The shared parameters are those of :class:`flows.common.ComparisonSpec` (checked when the
    flow starts, naming the field); this flow's own:

    variants: any of sync, recompute, loglinear. oppo: OPPO modes (off, intra, inter, both;
    tasks.arms) compared like the variants: each variant runs once per mode, as the arm
    ``<variant>`` (off) or ``<variant>+oppo-<mode>``; None (default): as the config says.
    A mode the config cannot run (intra on the GRPO path, both) fails here, naming the field.
    placements: where generation runs (tasks.arms.PLACEMENTS: colocated, disaggregated), compared
    like the variants: each arm once per placement, baselines taken within a placement (a
    disaggregated arm runs as a trainer process and a rollout worker process, each on its own
    cores); None (default): as the config says.
    variant_overrides: ``{variant: {rl_field: value}}`` (e.g. ``{"loglinear": {"proximal":
    "metrics"}}`` logs loglinear's approximation error). output_dir: default
    runs/compare-<preset>; re-running resumes; ``{date}`` in it becomes the UTC date.
    launch: "local" (in-process, the default) or a LaunchSpec as a dict, e.g. ``{"mode":
    "torchrun", "nproc_per_node": 2}``: each training then runs ``python -m a3po.cli train`` as
    launched ranks (infra.launch; docs/distributed.md); the topology is recorded on the runs.
    fanout_deployment: e.g. "train-one/train-one" (infra/prefect.yaml): each variant x seed runs
    as a run of that deployment on its pool's workers, in parallel (flows.train_one; needs a real
    Prefect server, an output dir every worker sees, and an MLflow store each can reach); the
    data and the warm start are prepared here once. None (default): in this process, in turn.
    """
    spec = CompareSpec.of_flow(locals())  # first: raises naming the field, before anything runs
    t0 = time.perf_counter()
    base = spec.train_config()
    launched = launch_for_config(spec.launch_spec(), base)  # the ZeRO stage the ranks will run, for the record
    arms = check_arms(spec, base, list(variants), oppo, placements)
    out = spec.output_folder()
    flow_values = dict(preset=preset, variants=list(variants), oppo=oppo, placements=placements, seeds=spec.seeds, benchmarks=spec.benchmarks,
                       bench_limit=bench_limit,
                       data_dir=data_dir, target_fraction=target_fraction, smooth_frac=smooth_frac, variant_overrides=variant_overrides)
    launch_tags, launch_param = launch_params(launched)
    tags = {"a3po.kind": "compare", "a3po.preset": preset, "a3po.variants": ",".join(arms), "a3po.seeds": ",".join(map(str, spec.seeds)),
            "a3po.fanout": fanout_deployment or "none", **launch_tags}
    with parent_run(spec, out, f"compare-{preset}", tags, {**parent_params(base, **flow_values), **launch_param}) as ref:
        records, links, summary = compare_and_summarise(spec, base, ref, out, arms, launch=launched, fanout_deployment=fanout_deployment)
        log_to_parent(ref, summary["metrics"], summary["artifacts"])
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


# --- command line -------------------------------------------------------------------------


def build_parser(prog: str = "python -m flows.compare_variants") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="comma-separated subset of sync,recompute,loglinear")
    ap.add_argument("--oppo", default=None, metavar="MODES",
                    help=f"comma-separated OPPO modes ({','.join(OPPO_MODES.names())}) compared like the variants: one arm per "
                         "variant and mode, e.g. off,inter runs loglinear and loglinear+oppo-inter (default: as the config says)")
    ap.add_argument("--placements", default=None, metavar="PLACEMENTS",
                    help=f"comma-separated placements ({','.join(PLACEMENTS.names())}) compared like the variants: each arm "
                         "in each placement, baselines within a placement (default: as the config says)")
    add_comparison_args(ap, CompareSpec)
    ap.add_argument("--fanout-deployment", default=None, metavar="FLOW/DEPLOYMENT",
                    help="e.g. train-one/train-one: run each variant x seed as a run of this deployment on its work pool's "
                         "workers, in parallel (needs PREFECT_API_URL; docs/distributed.md); default: in this process")
    return ap


def main(argv: list[str] | None = None, prog: str = "python -m flows.compare_variants") -> int:
    args = build_parser(prog).parse_args(argv)
    kwargs = comparison_kwargs(args)  # output_dir is set by run_flow
    variants, oppo = csv(args.variants), (csv(args.oppo) if args.oppo is not None else None)
    placements = csv(args.placements) if args.placements is not None else None

    def check(spec: ComparisonSpec) -> None:
        """Every arm's config now, so a bad value (file, --set, option) fails in one line before
        any server starts (the flow builds them again, as its parameters say)."""
        base = spec.train_config()
        check_arms(spec, base, variants, oppo, placements)
        if not args.fanout_deployment:  # deployed workers check their own machine (train_variant)
            for arm in expand_arms(variants, oppo, placements):
                preflight(variant_config(base, arm, spec.seeds[0], spec.variant_overrides))
        launch_for_config(launch_spec(spec.launch), base)  # e.g. 2 ranks without a DeepSpeed config
        if args.fanout_deployment and not os.environ.get("PREFECT_API_URL"):
            raise ValueError("--fanout-deployment needs a Prefect server with workers: set PREFECT_API_URL (infra/start_prefect_server.sh)")

    own = {"variants": variants, "oppo": oppo, "placements": placements, "fanout_deployment": args.fanout_deployment}
    status, result, api = run_flow("compare_variants", compare_variants, CompareSpec, kwargs, own, check)
    if result is None:
        return status
    print("\n" + result["summary"]["table_md"])
    for note in result["summary"]["notes"]:
        print(f"note: {note}")
    print(f"\nartifacts: {result['output_dir']}/summary   run dirs: {result['output_dir']}")
    print(f"MLflow parent run {result['parent_run_id']} in {result['tracking_uri']}")
    print("\n".join(RunLinks(**result["links"]).lines()))
    figs = key_figures(result)
    figs["prefect_server_startup_s"] = round(api["startup_s"], 1)
    print(json.dumps(figs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
