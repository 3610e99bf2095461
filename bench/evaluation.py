"""A checkpoint evaluation's wall time on each thread count and dtype, side by side: the held-out
set (the trainer's measure, sampled and greedy) and the benchmark slices, as the flows'
``evaluate_checkpoint`` runs them (:func:`tasks.evaluation.evaluate`) after each training.

    python -m bench.evaluation --data-dir ../shared/data          # smol's step-0 model (make setup-smol), 1 and 2 threads,
                                                                  # 20 GSM8K + 20 MATH500 problems at 256 tokens: make demo-real's slices
    python -m bench.evaluation --data-dir ../shared/data --threads 2 --dtypes float32,auto   # fp32 beside the bf16 engine copy
    python -m bench.evaluation --preset micro --benchmarks ''     # smoke: the held-out set alone

The model is the preset's warm start (prepared once under ``--cache``; ``smol``'s is the model as
shipped). Per thread count (``--threads``, the first the baseline) the same evaluation runs with the
config's ``generate_threads`` set to it, which is what an evaluation decodes on
(:func:`a3po.config.plan.evaluation_threads`), and per dtype (``--dtypes``, default the preset's) with
the config's ``dtype`` set to it, which sets the weights it decodes from on this machine
(:func:`tasks.evaluation.evaluation_dtype`, the row's "weights"), one after the other in
this process, the first (dtype, threads) the baseline. Each row: the benchmark slices' seconds (their
generation and grading, the runner's own figure), the rest (loading the checkpoint, the held-out set),
the total, its ratio to the baseline's (above 1: faster), and the figures themselves. Decoding on
another thread count or precision may round differently, so a figure can move by a problem; the table
shows whether it did. Prints the table, then as the very last line one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

FIGURES = ("heldout_acc", "heldout_greedy_acc")


def step0_model(preset: str, cache: Path) -> tuple[str, object]:
    """The preset's warm start (its folder) and the preset's config, whose data section the
    evaluation reads its held-out rows from, as the warm start did."""
    from a3po.config import preset as preset_config
    from a3po.training.run import prepare_warmstart

    cfg = preset_config(preset)
    model_dir, _ = prepare_warmstart(cfg, cache, log=lambda line: print(line, file=sys.stderr))
    return str(model_dir), cfg


def evaluate_on(threads: int, dtype: str, model_dir: str, cfg, args: argparse.Namespace, out: Path) -> dict:
    """One evaluation with ``threads`` intra-op threads in the config's ``dtype``: seconds and figures."""
    from a3po.config import with_overrides
    from tasks.evaluation import evaluate

    cfg = with_overrides(cfg, torch_threads=1, generate_threads=threads, dtype=dtype)
    res = evaluate(model_dir, cfg, args.benchmarks, args.data_dir, args.bench_limit, args.bench_max_new_tokens,
                   str(out / f"{dtype}-threads-{threads}"))
    m = res["metrics"]
    bench_s = sum(m[f"eval/final/{b}/seconds"] for b in res["benchmarks"])
    figures = {k: m[f"eval/final/{k}"] for k in FIGURES}
    figures.update({f"{b}/pass_at_1": m[f"eval/final/{b}/pass_at_1"] for b in res["benchmarks"]})
    return {"threads": threads, "dtype": dtype, "weights": res["dtype"], "total_s": round(res["seconds"], 2), "benchmarks_s": round(bench_s, 2),
            "rest_s": round(res["seconds"] - bench_s, 2), "benchmarks": res["benchmarks"], "skipped": res["skipped"],
            "figures": figures}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.evaluation", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="smol", help="a built-in config (default smol: make setup-smol)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts, the first the baseline (default 1,2)")
    ap.add_argument("--dtypes", default=None, help="comma-separated config dtypes (float32, bfloat16, auto), each on every "
                                                  "thread count, the first the baseline (default: the preset's)")
    ap.add_argument("--benchmarks", default="gsm8k,math500", help="comma-separated (default gsm8k,math500; '' for none)")
    ap.add_argument("--data-dir", default=None, help="the benchmarks' folder (<dir>/<name>/test.jsonl); none: held-out only")
    ap.add_argument("--bench-limit", type=int, default=20, help="problems per benchmark (default 20, as make demo-real)")
    ap.add_argument("--bench-max-new-tokens", type=int, default=256, help="default 256, as make demo-real")
    ap.add_argument("--cache", default=None, help="where the warm start is prepared (default: a new temporary folder)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        threads = [int(t) for t in args.threads.split(",") if t.strip()]
    except ValueError:
        ap.error(f"--threads: comma-separated integers, got {args.threads!r}")
    if not threads or min(threads) < 1 or len(set(threads)) != len(threads):
        ap.error(f"--threads: one or more different counts >= 1, got {args.threads!r}")
    from a3po.devices import DType

    dtypes = [d.strip() for d in (args.dtypes or "").split(",") if d.strip()] if args.dtypes is not None else None
    if dtypes is not None and (not dtypes or len(set(dtypes)) != len(dtypes) or not set(dtypes) <= {d.value for d in DType}):
        ap.error(f"--dtypes: one or more different names of {', '.join(d.value for d in DType)}, got {args.dtypes!r}")
    if args.bench_limit < 1 or args.bench_max_new_tokens < 1:
        ap.error("--bench-limit and --bench-max-new-tokens: give 1 or more")
    args.benchmarks = [b for b in args.benchmarks.split(",") if b]
    out = Path(args.cache or tempfile.mkdtemp(prefix="a3po-bench-evaluation-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_dir, cfg = step0_model(args.preset, out)
    rows = [evaluate_on(t, d, model_dir, cfg, args, out) for d in (dtypes or [cfg.dtype.value]) for t in threads]

    base = rows[0]["total_s"]
    names = list(rows[0]["figures"])
    skipped = rows[0]["skipped"]
    print(f"\nevaluation of {args.preset}'s step-0 model, benchmarks {rows[0]['benchmarks'] or 'none'} "
          f"({args.bench_limit} problems, {args.bench_max_new_tokens} tokens)"
          + (f"; skipped {skipped}" if skipped else "") + "\n")
    print("| dtype | weights | threads | benchmarks (s) | held-out + load (s) | total (s) | vs first | " + " | ".join(names) + " |")
    print("|---|---|---|---|---|---|---|" + "---|" * len(names))
    for r in rows:
        r["speedup"] = round(base / r["total_s"], 4)
        print(f"| {r['dtype']} | {r['weights']} | {r['threads']} | {r['benchmarks_s']:.1f} | {r['rest_s']:.1f} | {r['total_s']:.1f} | "
              f"{r['speedup']:.2f}x | " + " | ".join(f"{r['figures'][k]:.3f}" for k in names) + " |")
    summary = {"bench": "evaluation", "preset": args.preset, "bench_limit": args.bench_limit,
               "bench_max_new_tokens": args.bench_max_new_tokens, "cache": str(out), "rows": rows}
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
