"""Check the A-3PO paper's claims on this testbed: one comparison, one verdict per claim.

    python -m flows.paper_claims                          # tiny preset, 3 seeds
    python -m flows.paper_claims --seeds 0 --steps 40     # a short run
    python -m flows.paper_claims --preset micro --seeds 0 --steps 4   # plumbing only

Runs the comparison of sync, recompute and loglinear (``flows.compare_variants.run_comparison``,
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
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

import flows  # noqa: F401  (offline defaults before Prefect is imported)
from a3po.config import ConfigError, Variant
from a3po.storage.runlock import RunFolderBusy, hold_run_folder
from flows.compare_variants import _csv, build_config, default_data_dir, parent_params, parse_sets, run_comparison
from tasks.claims import report_claims
from tasks.links import RunLinks, tag_run_links
from tasks.runtime import default_tracking_uri, prefect_api
from tasks.summary import SMOOTH_FRAC, TARGET_FRACTION, summarise
from tasks.tracking import close_parent_run, log_to_parent, open_parent_run

VARIANTS = [v.value for v in Variant]  # every claim compares loglinear with recompute and/or sync


def output_folder(preset: str, output_dir: str | None) -> Path:
    return Path(output_dir or f"runs/claims-{preset}").resolve()


@flow(name="paper-claims", log_prints=True)
def paper_claims(
    preset: str = "tiny",
    seeds: list[int] = [0, 1, 2],
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
) -> dict[str, Any]:
    """Run sync, recompute and loglinear over ``seeds`` and judge the paper's claims.

    steps / max_staleness: override ``rl.*``; overrides / variant_overrides: as in
    compare_variants. config: YAML TrainConfig laid over the preset. output_dir: default runs/claims-<preset> (re-running resumes).
    target_fraction / smooth_frac: the comparison's definitions (tasks.summary).
    """
    t0 = time.perf_counter()
    base = build_config(preset, config, steps=steps, max_staleness=max_staleness, overrides=overrides, torch_threads=torch_threads)
    out = output_folder(preset, output_dir)
    cache = Path(cache_dir).resolve() if cache_dir else out / "cache"
    uri = tracking_uri or default_tracking_uri()
    flow_values = dict(preset=preset, seeds=seeds, target_fraction=target_fraction, smooth_frac=smooth_frac, variant_overrides=variant_overrides)
    with hold_run_folder(out, log=get_run_logger().warning):  # one writer per output folder, for the whole flow run
        ref = open_parent_run(uri, experiment, f"claims-{preset}", str(out),
                              {"a3po.kind": "claims", "a3po.preset": preset, "a3po.seeds": ",".join(map(str, seeds))},
                              parent_params(base, **flow_values))
        try:
            records = run_comparison(base, ref, out, cache, VARIANTS, seeds, variant_overrides, [], default_data_dir(), None, 64, system_metrics_interval_s)
            links = tag_run_links(ref, [r["mlflow_run_id"] for r in records])
            summary = summarise(records, str(out / "summary"), target_fraction, smooth_frac)
            header = (f"# A-3PO claims on this testbed\n\nPreset {preset}, {base.rl.steps} RL steps, seeds {', '.join(map(str, seeds))}, "
                      f"max staleness {base.rl.max_staleness}; comparison table in comparison.md.")
            claims = report_claims(summary, str(out / "summary"), header)
            log_to_parent(ref, {**summary["metrics"], **claims["metrics"]}, [*summary["artifacts"], *claims["artifacts"]],
                          tags={f"claim.{r['claim']}": r["verdict"] for r in claims["results"]})
        except BaseException:
            close_parent_run(ref, "FAILED")
            raise
        close_parent_run(ref, "FINISHED")
    return {
        "claims": claims["results"],
        "claims_md": claims["markdown"],
        "table_md": summary["table_md"],
        "runs": records,
        "parent_run_id": ref.parent_run_id,
        "links": links,
        "tracking_uri": uri,
        "output_dir": str(out),
        "steps": base.rl.steps,
        "wall_s": time.perf_counter() - t0,
    }


def build_parser(prog: str = "python -m flows.paper_claims") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--config", help="YAML TrainConfig laid over the preset")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated RL seeds")
    ap.add_argument("--steps", type=int, help="RL steps per run (rl.steps)")
    ap.add_argument("--max-staleness", type=int)
    ap.add_argument("--set", action="append", default=[], metavar="[VARIANT:]SECTION.FIELD=VALUE", help="config override (repeatable)")
    ap.add_argument("--tracking-uri", default=None, help="MLflow store; default $MLFLOW_TRACKING_URI or sqlite:///./mlflow.db")
    ap.add_argument("--experiment", default="a3po-claims")
    ap.add_argument("--output-dir", default=None, help="default runs/claims-<preset>; re-running with the same dir resumes")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--target-fraction", type=float, default=TARGET_FRACTION)
    ap.add_argument("--torch-threads", type=int, default=None)
    return ap


def main(argv: list[str] | None = None, prog: str = "python -m flows.paper_claims") -> int:
    args = build_parser(prog).parse_args(argv)
    overrides, per_variant = parse_sets(args.set)
    kwargs = dict(preset=args.preset, seeds=_csv(args.seeds, int), steps=args.steps, max_staleness=args.max_staleness,
                  overrides=overrides or None, variant_overrides=per_variant or None, tracking_uri=args.tracking_uri or default_tracking_uri(),
                  experiment=args.experiment, output_dir=args.output_dir, cache_dir=args.cache_dir, target_fraction=args.target_fraction,
                  torch_threads=args.torch_threads, config=args.config)
    try:
        build_config(args.preset, args.config, steps=args.steps, max_staleness=args.max_staleness, overrides=kwargs["overrides"], torch_threads=args.torch_threads)
    except (ConfigError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:  # refused here, before the Prefect server starts, when another run writes the folder
        with hold_run_folder(output_folder(args.preset, args.output_dir)), prefect_api() as api:
            res = paper_claims(**kwargs)
    except RunFolderBusy as e:
        print(f"paper_claims: {e}", file=sys.stderr)
        return 1
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
