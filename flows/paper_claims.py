"""Check the A-3PO paper's claims on this testbed: one comparison, one verdict per claim.

    python -m flows.paper_claims                          # tiny preset, 3 seeds
    python -m flows.paper_claims --seeds 0 --steps 40     # a short run
    python -m flows.paper_claims --preset micro --seeds 0 --steps 4   # plumbing only

Runs the comparison of sync, recompute and loglinear (``flows.common.run_comparison``,
then its summary), then judges each claim of :data:`tasks.claims.CLAIMS` (proximal log-prob time,
wall time to target vs recompute and vs sync, final reward parity, behaviour-IW extremes,
clipped tokens): the paper's figure, this testbed's with its spread over seeds, and a verdict
(reproduced / not reproduced / not measurable here) with a one-line reason, by the rules in
:mod:`tasks.claims`. The table is ``claims.md`` on the MLflow parent run (with the comparison's
artifacts), ``claims/<claim>/...`` metrics and a ``claim.<claim>`` tag each; it is printed, with
one JSON line of key figures last. A Prefect flow, so it can be deployed on a schedule like
``nightly-parity`` (``infra/``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, ClassVar

from prefect import flow
from pydantic import Field

import flows  # noqa: F401  (offline defaults before Prefect is imported)
from a3po.config import Variant
from a3po.redact import mask_uri
from flows.cli import add_comparison_args, comparison_kwargs, run_flow
from flows.common import ComparisonSpec, compare_and_summarise, launch_params, parent_params, parent_run, variant_config
from tasks.arms import PLACEMENTS, arm_name, expand_arms
from tasks.claims import report_claims
from tasks.links import RunLinks
from tasks.summary import SMOOTH_FRAC, TARGET_FRACTION
from tasks.tracking import log_to_parent
from tasks.training import launch_for_config

VARIANTS = [v.value for v in Variant]  # every claim compares loglinear with recompute and/or sync


class ClaimsSpec(ComparisonSpec):
    """The claims run's shared parameters, with this flow's defaults: 3 seeds, no benchmarks."""

    default_output_dir: ClassVar[str] = "runs/claims-{preset}"
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1)
    experiment: str = "a3po-claims"


def claim_arms(spec: ComparisonSpec, base, placements: list[str] | None) -> list[str]:
    """Every variant in every placement, by the name of the config each builds."""
    return list(dict.fromkeys(arm_name(variant_config(base, a, spec.seeds[0], spec.variant_overrides))
                              for a in expand_arms(VARIANTS, None, placements)))


@flow(name="paper-claims", log_prints=True)
def paper_claims(
    preset: str = "tiny",
    seeds: tuple[int, ...] | list[int] = (0, 1, 2),
    steps: int | None = None,
    max_staleness: int | None = None,
    overrides: dict[str, Any] | None = None,
    variant_overrides: dict[str, dict[str, Any]] | None = None,
    tracking_uri: str | None = None,
    experiment: str = "a3po-claims",
    output_dir: str | None = None,
    cache_dir: str | None = None,
    target_fraction: float = TARGET_FRACTION,
    smooth_frac: float = SMOOTH_FRAC,
    torch_threads: int | None = None,
    system_metrics_interval_s: float = 10.0,
    config: str | None = None,
    model: str | None = None,
    dataset: str | None = None,
    task: str | None = None,
    checkpoint_every: int | None = None,
    benchmarks: tuple[str, ...] | list[str] = (),
    bench_limit: int | None = 50,
    bench_max_new_tokens: int = 64,
    data_dir: str | None = None,
    launch: str | dict[str, Any] = "local",
    placements: list[str] | None = None,
) -> dict[str, Any]:
    """Run sync, recompute and loglinear over ``seeds`` and judge the paper's claims.

    The parameters are those of :class:`flows.common.ComparisonSpec`; output_dir: default
    runs/claims-<preset> (re-running resumes). placements: where generation runs
    (tasks.arms.PLACEMENTS); the variants run in each and the claims are judged per placement.
    """
    spec = ClaimsSpec.of_flow(locals())  # first: raises naming the field, before anything runs
    t0 = time.perf_counter()
    base = spec.train_config()
    launched = launch_for_config(spec.launch_spec(), base)
    out = spec.output_folder()
    flow_values = dict(preset=preset, seeds=spec.seeds, placements=placements, target_fraction=target_fraction, smooth_frac=smooth_frac,
                       variant_overrides=variant_overrides)
    launch_tags, launch_param = launch_params(launched)
    tags = {"a3po.kind": "claims", "a3po.preset": preset, "a3po.seeds": ",".join(map(str, spec.seeds)), **launch_tags}
    with parent_run(spec, out, f"claims-{preset}", tags, {**parent_params(base, **flow_values), **launch_param}) as ref:
        records, links, summary = compare_and_summarise(spec, base, ref, out, claim_arms(spec, base, placements), launch=launched)
        header = (f"# A-3PO claims on this testbed\n\nPreset {preset}, {base.rl.steps} RL steps, seeds {', '.join(map(str, spec.seeds))}, "
                  f"max staleness {base.rl.max_staleness}; comparison table in comparison.md.")
        claims = report_claims(summary, str(out / "summary"), header)
        log_to_parent(ref, {**summary["metrics"], **claims["metrics"]}, [*summary["artifacts"], *claims["artifacts"]],
                      tags={f"claim.{r['claim']}": r["verdict"] for r in claims["results"]})
    return {
        "claims": claims["results"],
        "claims_md": claims["markdown"],
        "table_md": summary["table_md"],
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
                    help=f"comma-separated placements ({','.join(PLACEMENTS.names())}): the variants run in each, the claims "
                         "are judged per placement (default: as the config says)")
    add_comparison_args(ap, ClaimsSpec)
    return ap


def main(argv: list[str] | None = None, prog: str = "python -m flows.paper_claims") -> int:
    args = build_parser(prog).parse_args(argv)

    placements = [p.strip() for p in args.placements.split(",") if p.strip()] if args.placements is not None else None

    def check(spec: ComparisonSpec) -> None:
        base = spec.train_config()
        claim_arms(spec, base, placements)  # an unknown placement or a refused combination, before anything starts
        launch_for_config(spec.launch_spec(), base)

    status, res, api = run_flow("paper_claims", paper_claims, ClaimsSpec, comparison_kwargs(args), {"placements": placements}, check)
    if res is None:
        return status
    print("\n" + res["table_md"] + "\n\n" + res["claims_md"])
    print(f"MLflow parent run {res['parent_run_id']} (claims.md)")
    print("\n".join(RunLinks(**res["links"]).lines()))
    figs = {f"claim/{r['claim']}": r["verdict"] for r in res["claims"]}
    figs.update({"steps": res["steps"], "parent_run_id": res["parent_run_id"], "wall_s": round(res["wall_s"], 1),
                 "prefect_server_startup_s": round(api["startup_s"], 1)})
    print(json.dumps(figs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
