"""``a3po eval``: evaluate a checkpoint (or the random ``tiny`` model) on math benchmarks.

    a3po eval --model PATH --benchmarks gsm8k,math500,aime24 --data-dir DIR --limit N

Prints a table, then, as the very last line of stdout, one JSON object of the key figures
(``{"model": ..., "gsm8k/pass@1": ..., ...}``) for scripts and CI to parse. Writes
``results.json`` and ``records.jsonl`` (one line per completion) under ``--out``.
``--data-dir`` is a folder laid out like the offline copies (``gsm8k/test.jsonl``,
``math500/test.jsonl``, ``aime24/test.jsonl``; flat ``<benchmark>.jsonl`` also works, e.g.
``eval/fixtures``); without it the hub datasets are used. ``--lm-eval`` also runs lm-eval's own
tasks on the same model and data and adds their figures under ``lm_eval/``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_BENCHMARKS = "gsm8k,math500,aime24"


def build_parser() -> argparse.ArgumentParser:
    from eval.runner import EvalConfig

    d = EvalConfig()
    p = argparse.ArgumentParser(prog="a3po eval", description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint folder, hub name, or 'tiny' (random tiny model, offline smoke runs)")
    p.add_argument("--benchmarks", default=DEFAULT_BENCHMARKS, help="comma-separated: gsm8k, math500, aime24, arith")
    p.add_argument("--data-dir", default=None, help="folder with <benchmark>/test.jsonl (or <benchmark>.jsonl); default: the hub")
    p.add_argument("--limit", type=int, default=None, help="first N problems of each benchmark")
    p.add_argument("--out", default=None, help="output folder (default: runs/eval/<model>-<time>)")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--n-samples", type=int, default=d.n_samples, help="sampled completions per problem for mean@n / pass@k (0 = greedy only)")
    p.add_argument("--temperature", type=float, default=d.temperature, help="for the sampled completions")
    p.add_argument("--top-p", type=float, default=d.top_p, help="for the sampled completions")
    p.add_argument("--k", default="", help="comma-separated k for pass@k (default: powers of two up to n-samples)")
    p.add_argument("--no-greedy", action="store_true", help="skip the greedy pass@1 decode")
    p.add_argument("--template", default="auto", help="prompt template: auto | chat | qa | raw")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--grading-timeout", type=float, default=5.0, help="seconds per math-verify comparison")
    p.add_argument("--lm-eval", action="store_true", help="also run lm-eval's own tasks on the same model and data")
    p.add_argument("--lm-eval-max-gen-toks", type=int, default=None, help="max_gen_toks for lm-eval (default: --max-new-tokens)")
    return p


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4f}"
    return str(v)


def key_figures(results: dict[str, Any]) -> dict[str, Any]:
    """The flat ``{"model", "<benchmark>/<metric>": value, ...}`` summary printed last."""
    out: dict[str, Any] = {"model": results["model"]}
    for bench, metrics in results["benchmarks"].items():
        for k, v in metrics.items():
            if k.startswith(("pass@", "mean@")) or k in ("n_problems", "grading_timeouts", "grading_errors", "grading_too_long"):
                out[f"{bench}/{k}"] = v
    for bench, metrics in results.get("lm_eval", {}).items():
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and "stderr" not in k and k != "sample_len":
                out[f"lm_eval/{bench}/{k}"] = v
    out["grading/timeouts"] = results.get("grading", {}).get("timeouts", 0)
    out["grading/errors"] = results.get("grading", {}).get("errors", 0)
    if "paths" in results:
        out["results"] = results["paths"]["results"]
    return out


def table(results: dict[str, Any]) -> str:
    rows = [(bench, k, _fmt(v)) for bench, m in results["benchmarks"].items() for k, v in m.items()]
    rows += [(f"lm_eval/{b}", k, _fmt(v)) for b, m in results.get("lm_eval", {}).items() for k, v in m.items() if "stderr" not in k]
    w0 = max([len("benchmark")] + [len(r[0]) for r in rows])
    w1 = max([len("metric")] + [len(r[1]) for r in rows])
    lines = [f"model: {results['model']}", f"{'benchmark':<{w0}}  {'metric':<{w1}}  value", f"{'-' * w0}  {'-' * w1}  -----"]
    lines += [f"{a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.lm_eval and importlib.util.find_spec("lm_eval") is None:  # before the evaluation, not after it
        print("a3po eval: error: --lm-eval needs the 'eval' extra (lm-eval is not installed): "
              "pip install -e '.[eval]' in the checkout, or pip install 'a3po[eval]'", file=sys.stderr)
        return 2
    from a3po import grading
    from eval.prompts import PromptConfig
    from eval.runner import EvalConfig, load_model, run_eval

    benchmarks = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
    try:
        cfg = EvalConfig(
            max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, greedy=not args.no_greedy,
            n_samples=args.n_samples, temperature=args.temperature, top_p=args.top_p,
            ks=tuple(int(k) for k in args.k.split(",") if k.strip()), seed=args.seed, limit=args.limit,
            prompt=PromptConfig(template=args.template),
        )
        grading.set_config(grading.GradingConfig(timeout_s=args.grading_timeout))
    except (ValueError, KeyError) as e:
        print(f"a3po eval: error: {e}", file=sys.stderr)
        return 2
    try:
        model, tokenizer, name = load_model(args.model)
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")[-60:] or "model"
        out = Path(args.out) if args.out else Path("runs/eval") / f"{slug}-{time.strftime('%Y%m%d-%H%M%S')}"
        results = run_eval((model, tokenizer), benchmarks, cfg, data_dir=args.data_dir, out_dir=out, model_name=name)
    except (FileNotFoundError, KeyError, ValueError, RuntimeError) as e:  # bad path, name, schema, or no hub
        print(f"a3po eval: error: {e}", file=sys.stderr)
        return 2
    if args.lm_eval:
        from eval.lm_eval_bridge import run_lm_eval

        supported = [b for b in benchmarks if b != "arith"]
        results["lm_eval"] = run_lm_eval(
            model, tokenizer, supported, source=args.data_dir, limit=args.limit,
            max_gen_toks=args.lm_eval_max_gen_toks or args.max_new_tokens, batch_size=args.batch_size,
        )
        Path(results["paths"]["results"]).write_text(json.dumps(results, indent=2, default=float) + "\n")
    print(table(results))
    print(json.dumps(key_figures(results), default=float), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
