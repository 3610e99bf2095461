"""``a3po`` command line: ``a3po train`` runs one variant on a preset or YAML config;
``a3po eval`` evaluates a checkpoint on GSM8K / MATH500 / AIME24 (see ``eval/cli.py``).
Every command ends with one JSON line of its key figures."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _train(argv: list[str]) -> int:
    from a3po.config import Variant, merge_yaml, preset, with_overrides

    ap = argparse.ArgumentParser(prog="a3po train", description="Train one variant (sync, recompute, loglinear) with async RL.")
    ap.add_argument("--variant", choices=[v.value for v in Variant], default="loglinear")
    ap.add_argument("--preset", default="tiny", help="built-in preset: tiny (embedded default) or micro (seconds)")
    ap.add_argument("--config", help="YAML TrainConfig; its values override the preset")
    ap.add_argument("--steps", type=int, help="RL steps (overrides the config)")
    ap.add_argument("--seed", type=int, default=None, help="RL seed (overrides the config)")
    ap.add_argument("--max-staleness", type=int, default=None)
    ap.add_argument("--schedule", choices=["deterministic", "threaded"], default=None)
    ap.add_argument("--output-dir", default=None, help="default: runs/<preset>")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    from a3po.runlock import hold_run_folder

    cfg = preset(args.preset)
    if args.config:
        cfg = merge_yaml(cfg, args.config)
    rl = {"variant": args.variant}
    for key, val in (("steps", args.steps), ("seed", args.seed), ("max_staleness", args.max_staleness), ("schedule", args.schedule)):
        if val is not None:
            rl[key] = val
    cfg = with_overrides(cfg, rl=rl)
    out = Path(args.output_dir or (cfg.output_dir if args.config else f"runs/{args.preset}"))
    run_dir = out / f"{cfg.rl.variant.value}-seed{cfg.rl.seed}"
    # One writer per run folder, taken before anything is written (released at any exit).
    with hold_run_folder(run_dir, log=lambda msg: print(f"note: {msg}", file=sys.stderr)):
        return _train_locked(args, cfg, out, run_dir)


def _train_locked(args: argparse.Namespace, cfg, out: Path, run_dir: Path) -> int:
    from tqdm import tqdm
    from transformers.utils import logging as hf_logging

    from a3po.metrics import JsonlLogger
    from a3po.pipeline import prepare_warmstart, train_variant

    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    ws_dir, ws_acc = prepare_warmstart(cfg, out / "cache")
    print(f"warm-start held-out accuracy: {ws_acc:.3f}  ({ws_dir})")
    bar = tqdm(total=cfg.rl.steps, desc=f"{cfg.rl.variant.value}", disable=args.no_progress, dynamic_ncols=True)

    def progress(step: int, m: dict[str, float]) -> None:
        bar.n = step
        post = {"reward": f"{m['reward/mean']:.2f}", "stale": f"{m['staleness/mean']:.1f}"}
        if "eval/heldout_acc" in m:
            post["acc"] = f"{m['eval/heldout_acc']:.3f}"
        bar.set_postfix(post, refresh=True)

    result = train_variant(cfg, run_dir, ws_dir, ws_acc, logger=JsonlLogger(run_dir / "metrics.jsonl"), progress=progress)
    bar.n = cfg.rl.steps
    bar.close()
    wall = time.perf_counter() - t0
    print(f"\nvariant {result.variant}  seed {result.seed}  steps {result.steps}")
    print("held-out accuracy by step: " + ", ".join(f"{s}:{a:.3f}" for s, a in result.eval_curve))
    print(f"warm start {result.warmstart_acc:.3f} -> final {result.final_acc:.3f}  "
          f"(RL {result.wall_s:.0f} s, command {wall:.0f} s; run dir {run_dir})")
    # wall_s: the whole command (warm start included); rl_wall_s: the RL loop with its evaluations.
    print(json.dumps({**result.summary(), "rl_wall_s": round(result.wall_s, 2), "wall_s": round(wall, 2), "run_dir": str(run_dir)}))
    return 0


def _eval(argv: list[str]) -> int:
    from eval.cli import main as eval_main  # eval/ imports a3po, so only on demand

    return eval_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"train": _train, "eval": _eval}
    if not argv or argv[0] not in commands:
        print(f"usage: a3po {{{','.join(commands)}}} [options]   (a3po <command> --help)", file=sys.stderr)
        return 2
    from a3po.runlock import RunFolderBusy

    try:
        return commands[argv[0]](argv[1:])
    except RunFolderBusy as e:
        print(f"a3po {argv[0]}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
