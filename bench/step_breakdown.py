"""The step's phases before and after bf16 compute: the same comparison in float32 and under ``dtype: auto``,
side by side in one run, per arm (variant x placement): step, generate, update and trainer idle seconds.

    python -m bench.step_breakdown                                    # smol (make setup-smol), sync and loglinear, both placements
    python -m bench.step_breakdown --preset micro --steps 2 --placements colocated   # smoke

Per dtype (``--dtypes``, default ``float32,auto``) this runs one comparison (``flows.compare_variants``: the
preset, ``--variants`` x ``--placements``, ``--seeds``, ``--steps``, no benchmarks) with the config's ``dtype``
set to it; the dtypes run one after the other on the same machine, so their figures are comparable. Each
figure is the comparison's own (tasks.summary): the mean over a run's steps of ``perf/wait_time_s +
perf/step_time_s`` (the step: wait for the batch + update), ``perf/generate_s`` (the producer's generation of
the batch), ``perf/train_s`` (the update) and ``perf/idle_s`` (the trainer waiting for a batch), averaged over
seeds. ``float32`` is the run before bf16 compute (everything else in the code as it is now); ``auto``
computes in bf16 where the CPU has native bf16 (AMX or AVX512-BF16) and in float32 elsewhere: the table says
which it resolved to on this machine. The ratio columns are the float32 figure over the auto one (above 1:
auto is faster).

Each dtype's comparison keeps its runs (MLflow in ``<out>/mlflow.db``, metrics, final models, summary) but
not their checkpoints; re-running with the same ``--output-dir`` reuses the dtypes already compared. Prints a
table, then as the very last line one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

FIGURES = (("mean_step_time_s", "step (s)"), ("mean_generate_s", "generate (s/step)"), ("mean_train_s", "update (s/step)"),
           ("mean_idle_s", "idle (s/step)"))
RATIOS = (("mean_step_time_s", "step"), ("mean_train_s", "update"), ("mean_generate_s", "generate"))


def run_dtype(dtype: str, args: argparse.Namespace, out: Path) -> dict:
    """One dtype's comparison, or the one an earlier invocation finished (its summary.json)."""
    from flows.compare_variants import CompareSpec, compare_variants

    folder = out / f"dtype-{dtype}"
    done = folder / "summary" / "summary.json"
    if done.exists():
        summary = json.loads(done.read_text())
    else:
        res = compare_variants(CompareSpec(
            preset=args.preset, variants=args.variants, placements=args.placements, seeds=args.seeds, steps=args.steps,
            benchmarks=[], overrides={"dtype": dtype}, tracking_uri=f"sqlite:///{out / 'mlflow.db'}",
            experiment=f"step-breakdown-{dtype}", output_dir=str(folder), cache_dir=str(out / "cache")))
        summary = res["summary"]
    for ckpt in list(folder.rglob("checkpoints")):  # a finished comparison needs none; a 135M model's are ~2 GB each
        shutil.rmtree(ckpt, ignore_errors=True)
    return {r["variant"]: {k: r.get(k) for k, _ in FIGURES} for r in summary["rows"]}


def resolved(dtype: str, preset: str) -> str:
    """What ``dtype`` computes in on this machine (the name a run logs as ``a3po.precision``)."""
    from a3po.config import preset as preset_config
    from a3po.devices import machine_precision, resolve_device

    return machine_precision(dtype, resolve_device(preset_config(preset).device)).name


def _ratio(before: float | None, after: float | None) -> float | None:
    return before / after if before and after else None


def _fmt(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.step_breakdown", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="smol", help="a built-in config (default smol: make setup-smol)")
    ap.add_argument("--variants", default="sync,loglinear", help="comma-separated arms (default sync,loglinear)")
    ap.add_argument("--placements", default="colocated,disaggregated", help="comma-separated (default both)")
    ap.add_argument("--dtypes", default="float32,auto", help="comma-separated config dtypes, the first the baseline (default float32,auto)")
    ap.add_argument("--steps", type=int, default=4, help="RL steps per run (default 4)")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    ap.add_argument("--output-dir", default=None, help="default: a new temporary folder")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    from a3po.devices import DType

    dtypes = [d for d in args.dtypes.split(",") if d]
    unknown = [d for d in dtypes if d not in {t.value for t in DType}]
    if unknown or len(dtypes) < 2 or len(set(dtypes)) != len(dtypes):
        ap.error(f"--dtypes: give two or more different dtypes of {[t.value for t in DType]} (got {args.dtypes!r})")
    if args.steps < 1:
        ap.error("--steps: give 1 or more")
    args.variants = [v for v in args.variants.split(",") if v]
    args.placements = [p for p in args.placements.split(",") if p]
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    out = Path(args.output_dir or tempfile.mkdtemp(prefix="a3po-step-breakdown-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    precisions = {d: resolved(d, args.preset) for d in dtypes}
    rows = {d: run_dtype(d, args, out) for d in dtypes}

    base = dtypes[0]
    print(f"\nstep breakdown, preset {args.preset}, seeds {args.seeds}, {args.steps} steps a run, runs in {out}; "
          f"on this machine: " + ", ".join(f"{d} -> {p}" for d, p in precisions.items()) + "\n")
    ratio_heads = [f"{label} {base}/dtype" for _, label in RATIOS]
    print("| arm | dtype | computes in | " + " | ".join(label for _, label in FIGURES) + " | " + " | ".join(ratio_heads) + " |")
    print("|---|---|---|" + "---|" * (len(FIGURES) + len(RATIOS)))
    ratios: dict[str, dict[str, dict[str, float | None]]] = {}
    for arm in rows[base]:
        for d in dtypes:
            figs = rows[d].get(arm, {})
            cells = [_fmt(figs.get(k)) for k, _ in FIGURES]
            if d == base:
                cells += [""] * len(RATIOS)
            else:
                r = {label: _ratio(rows[base][arm][k], figs.get(k)) for k, label in RATIOS}
                ratios.setdefault(arm, {})[d] = {label: None if v is None else round(v, 4) for label, v in r.items()}
                cells += ["-" if v is None else f"{v:.2f}x" for v in r.values()]
            print(f"| {arm} | {d} | {precisions[d]} | " + " | ".join(cells) + " |")
    summary = {"bench": "step_breakdown", "preset": args.preset, "seeds": args.seeds, "steps": args.steps, "output_dir": str(out),
               "precisions": precisions, "rows": rows, "ratios": ratios}
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
