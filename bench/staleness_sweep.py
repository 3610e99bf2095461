"""The paper's staleness: loglinear against recompute at each staleness bound, claims judged per bound.

A-3PO's anchor is ``log pi_prox = a log pi_behav + (1 - a) log pi_theta`` with ``a = 1/d`` for a
token ``d`` versions old: at d = 1 the anchor *is* the behaviour policy, and only at larger
staleness (the paper's runs allow up to 8) does it sit near the current policy. At a bound of 2
most stale tokens have d = 1, so what the paper measures (fewer clipped tokens, more controlled
importance weights) can only show at larger bounds. Per bound (``--staleness``, default 1,2,4,8)
this runs one comparison of recompute and loglinear (``flows.compare_variants``: same preset,
seeds, warm start and prompt stream) and reports per variant: clipped-token fraction, behaviour
importance weight max and p99, mean staleness, final reward, time to target; then the claims of
:mod:`tasks.claims` that compare loglinear with recompute, judged per bound (the ones that need
sync are not measurable here).

    python -m bench.staleness_sweep --preset smol --steps 10          # the pretrained model (make setup-smol)
    python -m bench.staleness_sweep --preset tiny --steps 60 --seeds 0,1

Each bound's comparison keeps its runs (MLflow in ``<out>/mlflow.db``, one experiment per bound;
metrics, final models, summary) but not their checkpoints once it is done (``--keep-checkpoints``
keeps them: on ``smol`` ~3 GB each, two per run); re-running with the same ``--output-dir`` reuses
the bounds already compared and resumes the others. Prints a table, then as the very last line one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

FIGURES = (("clipped_frac", "clipped"), ("behav_iw_max", "IW max"), ("behav_iw_p99", "IW p99"), ("staleness_mean", "staleness"),
           ("final_reward", "final reward"), ("time_to_target_s", "time to target (s)"), ("mean_step_time_s", "step (s)"))
CLAIMS_HERE = ("ttt_vs_recompute", "reward_parity", "behav_iw_extremes", "clipped_tokens", "prox_time")


def run_bound(bound: int, args: argparse.Namespace, out: Path) -> dict:
    """One bound's comparison, or the one an earlier invocation finished (its summary.json)."""
    from flows.compare_variants import CompareSpec, compare_variants
    from tasks.claims import check_claims

    folder = out / f"staleness-{bound}"
    done = folder / "summary" / "summary.json"
    if done.exists():
        summary, parent = json.loads(done.read_text()), None
    else:
        res = compare_variants(CompareSpec(preset=args.preset, variants=["recompute", "loglinear"], seeds=args.seeds, steps=args.steps,
                               max_staleness=bound, benchmarks=[], tracking_uri=f"sqlite:///{out / 'mlflow.db'}",
                               experiment=f"staleness-{bound}", output_dir=str(folder)))
        summary, parent = res["summary"], res["parent_run_id"]
    if not args.keep_checkpoints:  # a finished comparison needs none; a 135M model's are ~3 GB each
        for ckpt in list(folder.rglob("checkpoints")):
            shutil.rmtree(ckpt, ignore_errors=True)
    rows = summary["rows"]
    claims = [c for c in check_claims(rows, summary["target"]) if c["claim"] in CLAIMS_HERE]
    return {"bound": bound, "rows": {r["variant"]: {k: r.get(k) for k, _ in FIGURES} for r in rows},
            "claims": {c["claim"]: c["verdict"] for c in claims}, "parent_run_id": parent}


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.4g}"


def _verdict(verdict: str, seeds: int) -> str:
    """A claim's verdict as printed: from one seed a rule holding or failing settles nothing, so
    there it reads "1 seed: consistent" or "1 seed: not settled", never "reproduced"."""
    from tasks.claims import NOT_REPRODUCED, REPRODUCED

    if seeds > 1:
        return verdict
    return {REPRODUCED: "1 seed: consistent", NOT_REPRODUCED: "1 seed: not settled"}.get(verdict, verdict)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.staleness_sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="smol")
    ap.add_argument("--staleness", default="1,2,4,8", help="comma-separated staleness bounds (rl.max_staleness)")
    ap.add_argument("--steps", type=int, default=None, help="RL steps (default: the preset's)")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds")
    ap.add_argument("--output-dir", default=None, help="default: a new temporary folder")
    ap.add_argument("--keep-checkpoints", action="store_true",
                    help="keep each finished run's checkpoints (default: removed once its bound's comparison is done)")
    args = ap.parse_args(argv)
    bounds = [int(s) for s in args.staleness.split(",") if s.strip()]
    if not bounds or min(bounds) < 1:
        ap.error("--staleness: give bounds >= 1 (0 is synchronous: every anchor is the behaviour policy)")
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    out = Path(args.output_dir or tempfile.mkdtemp(prefix="a3po-staleness-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = [run_bound(b, args, out) for b in bounds]

    print(f"\nstaleness sweep, preset {args.preset}, seeds {args.seeds}, runs in {out}\n")
    print(f"{'bound':>5} {'variant':<10} " + " ".join(f"{label:>18}" for _, label in FIGURES))
    for r in results:
        for variant, figs in r["rows"].items():
            print(f"{r['bound']:>5} {variant:<10} " + " ".join(f"{_fmt(figs[k]):>18}" for k, _ in FIGURES))
    print(f"\n{'bound':>5} " + " ".join(f"{c:>18}" for c in CLAIMS_HERE))
    for r in results:
        print(f"{r['bound']:>5} " + " ".join(f"{_verdict(r['claims'].get(c, '-'), len(args.seeds)):>18}" for c in CLAIMS_HERE))
    print(json.dumps({"bench": "staleness_sweep", "preset": args.preset, "seeds": args.seeds, "steps": args.steps, "output_dir": str(out),
                      "results": results}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
