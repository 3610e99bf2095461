"""OPPO's inter-step overlap against OPPO off, side by side in one run on the long-tailed workload.

Same preset, seed and long-tailed embedded task (``data.long_tail_frac``), the GRPO path (intra-step
overlap needs the PPO path's scorers wired into its trainer, not done yet, so only "off" and
"inter" run here). Per setting: median step latency (trainer
period = wait + train), trainer and generator busy fractions, reward mean. TRL's PPO trainer
is not run yet (it needs its own environment with TRL 1.12).

    python -m bench.oppo                       # micro model, 12 steps per setting
    python -m bench.oppo --preset tiny --steps 20 --long-tail 0.3

Prints a table, then as the very last line one JSON object with the key figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from a3po.arithmetic import WORDS
from a3po.config import preset, with_overrides
from a3po.data import load_rows
from a3po.models import build_tiny_model
from a3po.trainer import rl_train

SETTINGS = {"off": {"inter": False}, "inter": {"inter": True}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.oppo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="micro", choices=["micro", "tiny"])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--long-tail", type=float, default=0.25, help="data.long_tail_frac")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be >= 2")
    return args


def run_setting(args: argparse.Namespace, oppo: dict) -> dict:
    cfg = with_overrides(preset(args.preset), data={"long_tail_frac": args.long_tail},
                         rl={"steps": args.steps, "seed": args.seed, "max_new_tokens": args.max_new_tokens,
                             "eval_every": 10**6, "checkpoint_every": 10**6},
                         oppo=oppo)
    model, tok = build_tiny_model(cfg.model.name, WORDS, seed=cfg.model.init_seed)
    train, held, _ = load_rows(cfg.data, tok)
    res = rl_train(cfg, model, tok, train, held[:4], warmstart_acc=0.0)
    h = res.history[1:]  # the first step has nothing to overlap with
    return {
        "step_s_median": statistics.median(x["perf/train_s"] + x["perf/idle_s"] for x in h),
        "trainer_busy": statistics.mean(x["perf/trainer_busy_frac"] for x in h),
        "generator_busy": statistics.mean(x["perf/generator_busy_frac"] for x in h),
        "reward_mean": statistics.mean(x["reward/mean"] for x in res.history),
        "response_len": statistics.mean(x["response/length_mean"] for x in res.history),
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    figures = {name: run_setting(args, oppo) for name, oppo in SETTINGS.items()}
    print(f"{'setting':8} {'step_s':>8} {'trainer_busy':>13} {'gen_busy':>9} {'reward':>7} {'resp_len':>9}")
    for name, f in figures.items():
        print(f"{name:8} {f['step_s_median']:8.3f} {f['trainer_busy']:13.2f} {f['generator_busy']:9.2f} {f['reward_mean']:7.3f} {f['response_len']:9.1f}")
    out = {"bench": "oppo", "path": "grpo", "speedup_inter": figures["off"]["step_s_median"] / figures["inter"]["step_s_median"],
           "settings": figures, "intra": "not run (PPO path)", "trl_ppo": "not run",
           "command": "python -m bench.oppo " + " ".join(argv if argv is not None else sys.argv[1:])}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
