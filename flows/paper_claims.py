"""Check the A-3PO paper's claims on this testbed: one comparison, one verdict per claim.

    python -m flows.paper_claims                          # tiny preset, 3 seeds
    python -m flows.paper_claims --seeds 0 --steps 40     # a short run
    python -m flows.paper_claims --preset micro --seeds 0 --steps 4   # plumbing only
    python -m flows.paper_claims --seeds 0,1,2 --replicate-seeds 3,4,5   # each verdict judged twice

Runs the comparison of sync, recompute and loglinear (``flows.common.run_comparison``,
then its summary), then judges each claim of :data:`tasks.claims.CLAIMS` (proximal log-prob time,
wall time to target vs recompute and vs sync, final reward parity, behaviour-IW extremes,
clipped tokens): the paper's figure, this testbed's with its spread over seeds, and a verdict
(reproduced / not reproduced / not measurable here) with a one-line reason, by the rules in
:mod:`tasks.claims`. With ``--replicate-seeds`` every arm also runs on a second, disjoint seed
set, each claim is judged on each set alone, side by side, and the two verdicts are combined:
the same twice stands, different ones are "not settled". The table is ``claims.md`` on the
MLflow parent run (with the comparison's artifacts), ``claims/<claim>/...`` metrics and a
``claim.<claim>`` tag each (the combined verdict); it is printed, with one JSON line of key
figures last. A Prefect flow, so it can be deployed on a schedule like
``nightly-parity`` (``infra/``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, ClassVar

from prefect import flow
from pydantic import Field, ValidationInfo, field_validator

import flows  # noqa: F401  (offline defaults before Prefect is imported)
from a3po.config import TrainConfig, Variant
from a3po.config.axes import PLACEMENTS, Placement
from a3po.redact import mask_uri
from flows.cli import add_comparison_args, comparison_kwargs, int_csv, run_flow
from flows.common import (
    ComparisonSpec,
    calibration_setting,
    compare_and_summarise,
    launch_params,
    parent_params,
    parent_run,
    publish_artifacts,
    variant_config,
)
from tasks.arms import Arm, expand_arms
from tasks.claims import SET_NAMES, report_claims, seed_set
from tasks.description import describe_parent_run
from tasks.launched import launch_for_config
from tasks.links import RunLinks
from tasks.pairs import calibrated_shortfall, summarise_replicated_pairs
from tasks.tracking import log_to_parent

VARIANTS = [v.value for v in Variant]  # every claim compares loglinear with recompute and/or sync


class ClaimsSpec(ComparisonSpec):
    """The claims run: the shared fields (:class:`flows.common.ComparisonSpec`) with this flow's
    defaults (3 seeds, no benchmarks) and where generation runs."""

    default_output_dir: ClassVar[str] = "runs/claims-{preset}"
    # Descriptions as Field(description=...), not attribute docstrings: Prefect reads a deployment's
    # parameters from this file without importing it, where the docstrings cannot be found.
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1, description=(
        "RL seeds, paired across arms (each arm runs once per seed)."))
    replicate_seeds: list[int] | None = Field(default=None, min_length=1, description=(
        "A second seed set, disjoint from seeds: every arm runs on it too and each claim is judged on each set alone; "
        "two different verdicts are 'not settled'. None: one seed set, its verdicts not replicated."))
    experiment: str = Field(default="a3po-claims", description="MLflow experiment of the parent and child runs.")
    placements: list[Placement] | None = Field(default=None, description=(
        "Where generation runs: the variants run in each and the claims are judged per placement; None: as the "
        "config says."))

    @field_validator("replicate_seeds")
    @classmethod
    def _replicate_is_another_set(cls, value: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if value is None:
            return value
        repeated = sorted({s for s in value if value.count(s) > 1})
        if repeated:
            raise ValueError(f"replicate_seeds repeat {repeated}: each seed is one paired run per arm; give each once")
        seeds = info.data.get("seeds", [])  # absent when seeds itself was refused
        shared = sorted(set(value) & set(seeds))
        if shared:  # the same runs again: a replication on them proves nothing
            raise ValueError(f"replicate_seeds {value} share seed(s) {shared} with seeds {seeds}: a replication needs seeds of its own")
        return value

    def seed_sets(self) -> dict[str, list[int]]:
        """The seed sets the claims are judged on, by name: A the seeds, B the replicate seeds if any."""
        return dict(zip(SET_NAMES, [self.seeds, *([self.replicate_seeds] if self.replicate_seeds else [])], strict=False))


def claim_arms(spec: ClaimsSpec, base: TrainConfig) -> list[Arm]:
    """Every variant in every placement, as the configs they build."""
    return list(dict.fromkeys(Arm.of(variant_config(base, a, spec.seeds[0], spec.variant_overrides))
                              for a in expand_arms(VARIANTS, None, spec.placements)))


def check_spec(spec: ClaimsSpec) -> None:
    """Every variant's config in every placement and the launch, before anything starts; raises
    naming the field (the command line and a deployment's registration call it)."""
    base = spec.train_config()
    claim_arms(spec, base)
    launch_for_config(spec.launch_spec(), base)


@flow(name="paper-claims", log_prints=True)
def paper_claims(spec: ClaimsSpec = ClaimsSpec()) -> dict[str, Any]:  # noqa: B008  (a frozen value)
    """Run sync, recompute and loglinear over ``spec.seeds`` and judge the paper's claims.

    ``spec``: :class:`ClaimsSpec` (checked before anything runs, naming the field); output_dir:
    default runs/claims-<preset> (re-running resumes).
    """
    t0 = time.perf_counter()
    base = spec.train_config()
    launched = launch_for_config(spec.launch_spec(), base)
    out = spec.output_folder()
    preset = spec.preset
    sets = spec.seed_sets()
    flow_values = dict(preset=preset, seeds=spec.seeds, replicate_seeds=spec.replicate_seeds, placements=spec.placements,
                       target_fraction=spec.target_fraction, smooth_frac=spec.smooth_frac, variant_overrides=spec.variant_overrides)
    launch_tags, launch_param = launch_params(launched)
    tags = {"a3po.kind": "claims", "a3po.preset": preset, "a3po.seeds": ",".join(map(str, spec.seeds)), **launch_tags}
    if spec.replicate_seeds:
        tags["a3po.replicate_seeds"] = ",".join(map(str, spec.replicate_seeds))
    # One comparison over every seed (one warm start; the runs are per seed), judged per set below.
    every_seed = spec.model_copy(update={"seeds": [s for seeds in sets.values() for s in seeds]})
    with parent_run(spec, out, f"claims-{preset}", tags, {**parent_params(base, **flow_values), **launch_param}) as ref:
        records, links, summary = compare_and_summarise(every_seed, base, ref, out, claim_arms(spec, base), launch=launched)
        seeds_line = ("; ".join(f"seed set {name}: {', '.join(map(str, seeds))}" for name, seeds in sets.items()) if len(sets) > 1
                      else f"seeds {', '.join(map(str, spec.seeds))} (one seed set: not replicated)")
        header = (f"# A-3PO claims on this testbed\n\nPreset {preset}, {base.rl.steps} RL steps; {seeds_line}; "
                  f"max staleness {base.rl.max_staleness}; comparison table (every seed) in comparison.md.")
        setting = calibration_setting(every_seed, base)
        # Reward parity by the calibrated rule where a calibration covers the runs (tasks.claims).
        judged = [seed_set(name, records, seeds, spec.target_fraction, spec.smooth_frac,
                           calibrated_shortfall([r for r in records if r["seed"] in seeds], setting)[0]) for name, seeds in sets.items()]
        claims = report_claims(judged, str(out / "summary"), header)
        # Two sets: the pairs (speed ratios and reward with intervals) of each set alone, side by side.
        by_set = (summarise_replicated_pairs([(s.name, s.seeds, s.rows) for s in judged], records, setting,
                                             str(out / "summary")) if len(judged) > 1 else None)
        replicated = by_set or {"markdown": "", "metrics": {}, "artifacts": []}
        log_to_parent(ref, {**summary["metrics"], **claims["metrics"], **replicated["metrics"]},
                      [*summary["artifacts"], *claims["artifacts"], *replicated["artifacts"]],
                      tags={f"claim.{r['claim']}": r["verdict"] for r in claims["results"]})
        pairs_md = f"## Pairs on each seed set\n\n{by_set['markdown']}" if by_set else ""
        verdict_md = "\n\n".join(filter(None, [header, claims["markdown"], pairs_md]))
        describe_parent_run(ref, summary, records, links, verdict_md=verdict_md)
        publish_artifacts(spec, f"claims-{preset}", ref, summary, records, links, verdict_md)
    return {
        "claims": claims["results"],
        "claims_md": claims["markdown"],
        "table_md": summary["table_md"],
        # The pairs with intervals: each seed set's side by side where there are two, else the comparison's.
        "pairs_md": by_set["markdown"] if by_set else summary["pairs_md"],
        "runs": records,
        "parent_run_id": ref.parent_run_id,
        "links": links,
        "tracking_uri": mask_uri(ref.tracking_uri),  # printed and returned: never a password
        "output_dir": str(out),
        "steps": base.rl.steps,
        "wall_s": time.perf_counter() - t0,
    }


def build_parser(prog: str = "python -m flows.paper_claims") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--placements", default=None, metavar="PLACEMENTS",
                    help=f"comma-separated placements ({','.join(PLACEMENTS)}): the variants run in each, the claims "
                         "are judged per placement (default: as the config says)")
    ap.add_argument("--replicate-seeds", default=None, metavar="SEEDS",
                    help="comma-separated seeds of a second set, disjoint from --seeds: each claim is judged on each set "
                         "alone and two different verdicts are 'not settled' (default: one set, not replicated)")
    add_comparison_args(ap, ClaimsSpec)
    return ap


def main(argv: list[str] | None = None, prog: str = "python -m flows.paper_claims") -> int:
    args = build_parser(prog).parse_args(argv)

    placements = [p.strip() for p in args.placements.split(",") if p.strip()] if args.placements is not None else None
    replicate = int_csv(args.replicate_seeds, "--replicate-seeds") if args.replicate_seeds is not None else None

    status, res, api = run_flow("paper_claims", paper_claims, ClaimsSpec, comparison_kwargs(args),
                                {"placements": placements, "replicate_seeds": replicate}, check_spec)
    if res is None:
        return status
    print("\n" + res["table_md"] + "\n\n" + res["pairs_md"] + "\n" + res["claims_md"])
    print(f"MLflow parent run {res['parent_run_id']} (claims.md)")
    print("\n".join(RunLinks(**res["links"]).lines()))
    figs = {f"claim/{r['claim']}": r["verdict"] for r in res["claims"]}
    figs.update({"steps": res["steps"], "parent_run_id": res["parent_run_id"], "wall_s": round(res["wall_s"], 1),
                 "prefect_server_startup_s": round(api["startup_s"], 1)})
    print(json.dumps(figs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
