"""What the group filter costs and what it trains on: the same preset and seeds with
``rl.filter_groups`` off and on, one run after another (nothing else should run beside it).

Per run: the fraction of drawn groups without signal (``filter/filtered_frac``; off, the fraction
the filter would have dropped, counted on the trained batch), the prompts drawn per step and per
trained group with signal, the refills' share of the generation time, the groups with signal per
batch, the generation and step time, the trained batch's reward against every generated sample's,
and the held-out accuracy at the end.

    python -m bench.group_filter --preset tiny --steps 60 --seeds 0,1,2
    python -m bench.group_filter --preset smol --steps 10 --seeds 0       # the pretrained model (make setup-smol)

Each run is ``python -m a3po.training.command`` in a folder of ``--output-dir`` (re-running reuses
the finished ones). Prints a table, then as the very last line one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

FIGURES = (("filtered_frac", "no-signal frac"), ("prompts_per_step", "prompts/step"),
           ("prompts_per_signal_group", "prompts/signal grp"), ("signal_groups", "signal grps/batch"),
           ("refill_share", "refill share of gen"), ("gen_s", "gen s/step"), ("step_s", "step s"),
           ("trained_reward", "trained reward"), ("generated_reward", "generated reward"), ("final_acc", "final held-out"))


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def no_signal_frac(history: list[dict], batch_groups: int) -> float:
    """An unfiltered run's fraction of trained groups whose rewards were all equal, from its
    ``reward/groups_all_equal`` (or, for runs before it, not measurable: NaN)."""
    values = [h["reward/groups_all_equal"] / batch_groups for h in history if "reward/groups_all_equal" in h]
    return statistics.fmean(values) if values else float("nan")


def figures(run_dir: Path, batch_groups: int) -> dict:
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    result = json.loads((run_dir / "result.json").read_text())
    on = any("filter/prompts_drawn" in h for h in history)
    gen = [h["perf/generate_s"] for h in history]
    out = {
        "filtered_frac": _mean([h["filter/filtered_frac"] for h in history]) if on else no_signal_frac(history, batch_groups),
        "prompts_per_step": _mean([h["filter/prompts_drawn"] for h in history]) if on else float(batch_groups),
        "prompts_per_signal_group": (sum(h["filter/prompts_drawn"] for h in history)
                                     / max(sum(h["filter/signal_groups"] for h in history), 1)) if on else None,
        "signal_groups": _mean([h["filter/signal_groups"] for h in history]) if on else
        batch_groups * (1 - no_signal_frac(history, batch_groups)),
        "refill_share": sum(h["filter/refill_gen_s"] for h in history) / sum(gen) if on else 0.0,
        "gen_s": _mean(gen), "step_s": _mean([h["perf/step_time_s"] for h in history]),
        "trained_reward": _mean([h["reward/mean"] for h in history]),
        "generated_reward": _mean([h.get("filter/generated_reward_mean", h["reward/mean"]) for h in history]),
        "final_acc": result["final_acc"], "eval_curve": result["eval_curve"],
    }
    return out


def run_one(args: argparse.Namespace, seed: int, filtered: bool, out: Path) -> Path:
    folder = out / f"{'filtered' if filtered else 'plain'}-seed{seed}"
    run_dir = folder / f"{args.variant}-seed{seed}"
    if (run_dir / "result.json").exists():
        return run_dir
    config = folder / "config.yaml"
    folder.mkdir(parents=True, exist_ok=True)
    config.write_text(f"rl:\n  filter_groups: {'true' if filtered else 'false'}\n")
    cmd = [sys.executable, "-m", "a3po.training.command", "--preset", args.preset, "--variant", args.variant,
           "--seed", str(seed), "--config", str(config), "--output-dir", str(folder), "--no-progress"]
    if args.steps:
        cmd += ["--steps", str(args.steps)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return run_dir


def main(argv: list[str] | None = None) -> int:
    from a3po.config import preset

    ap = argparse.ArgumentParser(prog="python -m bench.group_filter", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--variant", default="loglinear")
    ap.add_argument("--steps", type=int, default=None, help="RL steps (default: the preset's)")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds")
    ap.add_argument("--output-dir", default=None, help="default: a new temporary folder")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    out = Path(args.output_dir or tempfile.mkdtemp(prefix="a3po-filter-")).resolve()
    groups = preset(args.preset).rl.batch_prompts
    rows = []
    for seed in seeds:
        for filtered in (False, True):
            rows.append({"filter": "on" if filtered else "off", "seed": seed,
                         **figures(run_one(args, seed, filtered, out), groups)})
    print(f"\ngroup filter, preset {args.preset}, variant {args.variant}, seeds {seeds}, runs in {out}\n")
    print(f"{'filter':<6} {'seed':>4} " + " ".join(f"{label:>19}" for _, label in FIGURES))
    for r in rows:
        print(f"{r['filter']:<6} {r['seed']:>4} " + " ".join(
            f"{'-' if r[k] is None else format(r[k], '.4g'):>19}" for k, _ in FIGURES))
    print(json.dumps({"bench": "group_filter", "preset": args.preset, "variant": args.variant, "seeds": seeds,
                      "steps": args.steps, "output_dir": str(out), "rows": rows}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
