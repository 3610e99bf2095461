"""``a3po train``: one variant (sync, recompute, loglinear) on a preset or YAML config, ending
with one JSON line of its key figures.

    python -m a3po.training.command --preset micro --variant loglinear --output-dir runs/micro

The ``a3po`` console script (``cli/``) dispatches ``a3po train ...`` here; launched ranks run this
module directly (``torchrun ... -m a3po.training.command ...``: ``tasks/launched.py``,
``infra/launch.py``), so training needs the library alone. The config is built and checked before
anything heavy is imported; under a launcher every rank runs it and rank 0 alone warm-starts,
writes and prints.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    """Run ``a3po train`` with ``argv`` (default ``sys.argv[1:]``); the exit status."""
    from a3po.storage.runlock import RunFolderBusy

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _train(argv)
    except RunFolderBusy as e:  # another process writes this run folder: say who, change nothing
        print(f"a3po train: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the checkpoints written so far are whole (atomic): say how to go on
        print("a3po train: interrupted; the same command resumes from the run's last checkpoint", file=sys.stderr)
        return 130


def _train(argv: list[str]) -> int:
    from a3po.config import PRESETS, ConfigError, Variant, merge_yaml, preflight, preset, with_overrides
    from a3po.config.loading import replaced_file_values
    from a3po.devices import Device, DType

    ap = argparse.ArgumentParser(prog="a3po train",
                                 description="Train one variant (sync, recompute, loglinear) with async RL.")
    # Every option defaults to None (unset): only what the user gave replaces the preset's or --config's value.
    ap.add_argument("--variant",
                    choices=[v.value for v in Variant], default=None, help="overrides the config (default loglinear)")
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                    help="built-in preset: tiny (embedded default) or micro (seconds)")
    ap.add_argument("--config", help="YAML TrainConfig; its values override the preset")
    ap.add_argument("--steps", type=int, help="RL steps (overrides the config)")
    ap.add_argument("--seed", type=int, default=None, help="RL seed (overrides the config)")
    ap.add_argument("--max-staleness", type=int, default=None)
    ap.add_argument("--schedule", choices=["deterministic", "threaded"], default=None)
    ap.add_argument("--device", choices=[d.value for d in Device], default=None,
                    help="auto (cuda when available), cpu or cuda (overrides the config; default auto)")
    ap.add_argument("--dtype",
                    choices=[d.value for d in DType], default=None,
                    help="float32, bfloat16 (weights) or auto (bf16 compute on fp32 weights where the CPU or GPU has "
                         "native bf16, else fp32); overrides the config; default float32")
    ap.add_argument("--output-dir", default=None, help="default: runs/<preset>")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    # The config is built (and checked) before anything heavy is imported or written.
    try:
        cfg = preset(args.preset)
        if args.config:
            cfg = merge_yaml(cfg, args.config)
        from_file = cfg
        given = (("variant", args.variant), ("steps", args.steps), ("seed", args.seed),
                 ("max_staleness", args.max_staleness),
                 ("schedule", args.schedule))
        rl = {key: val for key, val in given if val is not None}
        runtime = {k: v for k, v in (("device", args.device), ("dtype", args.dtype)) if v is not None}
        cfg = with_overrides(cfg, rl=rl, **runtime)
        for line in replaced_file_values(args.config, from_file, cfg) if args.config else []:
            print(f"a3po train: warning: {line}", file=sys.stderr)  # set twice: the option wins, said aloud
        cfg = preflight(cfg)  # and what it needs of this machine
        from a3po.data.arithmetic import WORDS
        from a3po.models.checks import check_model

        out = Path(args.output_dir or (cfg.output_dir if args.config else f"runs/{args.preset}"))
        run_dir = out / f"{cfg.rl.variant.value}-seed{cfg.rl.seed}"
        # its model's shapes (LoRA targets, memory, the run folder's disk) without its weights: before the warm start
        cfg = check_model(cfg, WORDS, run_dir)
    except ConfigError as e:
        print(f"a3po train: error: {e}", file=sys.stderr)
        return 2

    from a3po.parallel.ranks import ranks_from_env
    from a3po.storage.runlock import hold_run_folder

    # One writer per run folder, taken before anything is written and released at any exit;
    # under a launcher, rank 0 holds it for all the ranks.
    if not ranks_from_env().is_main:
        return _train_locked(args, cfg, out, run_dir)
    with hold_run_folder(run_dir, log=lambda msg: print(f"note: {msg}", file=sys.stderr)):
        return _train_locked(args, cfg, out, run_dir)


def _train_locked(args: argparse.Namespace, cfg, out: Path, run_dir: Path) -> int:
    from tqdm import tqdm
    from transformers.utils import logging as hf_logging

    from a3po.algorithms.checks import NonFiniteError
    from a3po.config.preflight import read_deepspeed_json, zero_stage
    from a3po.data.datasets import BadRowError
    from a3po.parallel.ranks import close_ranks, init_ranks
    from a3po.training.loop import SignalDrained
    from a3po.training.metrics import JsonlLogger, NullLogger
    from a3po.training.run import prepare_warmstart, train_variant

    hf_logging.disable_progress_bar()
    # Under torchrun every rank runs this command; rank 0 alone warm-starts, writes and prints.
    ds_path = cfg.distributed.deepspeed_config
    try:
        ranks = init_ranks(ds_path, cfg.distributed.rollout_workers)
    except (ValueError, RuntimeError) as e:  # the launch does not fit the config's topology
        print(f"a3po train: error: {e}", file=sys.stderr)
        return 2
    say = print if ranks.is_main else (lambda *a, **k: None)

    t0 = time.perf_counter()
    try:
        ws = prepare_warmstart(cfg, out / "cache") if ranks.is_main else None
        ws_dir, ws_acc = ranks.share([str(ws[0]), ws[1]] if ws is not None else None)
    except BadRowError as e:  # a dataset row named by file and line, read before any training
        print(f"a3po train: error: {e}", file=sys.stderr)
        return 2
    except NonFiniteError as e:  # the step and what was NaN or inf; nothing of the warm start is saved
        print(f"a3po train: {e}", file=sys.stderr)
        return 1
    say(f"warm-start held-out accuracy: {ws_acc:.3f}  ({ws_dir})")
    from a3po.devices import machine_precision, resolve_device

    precision = machine_precision(cfg.dtype, resolve_device(cfg.device))
    if not precision.slow:  # the slow case is the library's warning, said once on stderr
        say(f"precision: {precision.reason}")
    bar = tqdm(total=cfg.rl.steps, desc=f"{cfg.rl.variant.value}", disable=args.no_progress or not ranks.is_main,
               dynamic_ncols=True)

    def progress(step: int, m: dict[str, float]) -> None:
        bar.n = step
        post = {"reward": f"{m['reward/mean']:.2f}", "stale": f"{m['staleness/mean']:.1f}"}
        if "eval/heldout_acc" in m:
            post["acc"] = f"{m['eval/heldout_acc']:.3f}"
        bar.set_postfix(post, refresh=True)

    from a3po.storage.atomic import DiskFullError
    from a3po.storage.checkpoint import CheckpointError

    logger = JsonlLogger(run_dir / "metrics.jsonl") if ranks.is_main else NullLogger()
    try:
        result = train_variant(cfg, run_dir, ws_dir, ws_acc, logger=logger, progress=progress, ranks=ranks)
    except CheckpointError as e:  # damaged checkpoints: say which and why, without a traceback
        bar.close()
        print(f"a3po train: {e}", file=sys.stderr)
        return 1
    except BadRowError as e:  # the data read again for RL (e.g. a warm start cached before a file changed)
        bar.close()
        print(f"a3po train: error: {e}", file=sys.stderr)
        return 2
    except NonFiniteError as e:  # the step and what was NaN or inf; the checkpoints before it are left as they are
        bar.close()
        print(f"a3po train: {e}", file=sys.stderr)
        return 1
    except DiskFullError as e:  # the file and the limit it hit; what was committed before is whole
        bar.close()
        print(f"a3po train: {e.strerror}", file=sys.stderr)
        return 1
    except SignalDrained as e:  # the group filter found nothing to train on; the steps before are kept
        bar.close()
        print(f"a3po train: {e}", file=sys.stderr)
        return 1
    bar.n = cfg.rl.steps
    bar.close()
    close_ranks()
    wall = time.perf_counter() - t0
    if not ranks.is_main:
        return 0
    print(f"\nvariant {result.variant}  seed {result.seed}  steps {result.steps}")
    print("held-out accuracy by step: " + ", ".join(f"{s}:{a:.3f}" for s, a in result.eval_curve))
    print(f"warm start {result.warmstart_acc:.3f} -> final {result.final_acc:.3f}  "
          f"(RL {result.wall_s:.0f} s, command {wall:.0f} s; run dir {run_dir})")
    # wall_s: the whole command (warm start included); rl_wall_s: the RL loop with its evaluations.
    stage = zero_stage(read_deepspeed_json(ds_path, cfg.rl.grad_clip)) if ds_path else None
    print(json.dumps({**result.summary(), "rl_wall_s": round(result.wall_s, 2), "wall_s": round(wall, 2),
                      "run_dir": str(run_dir),
                      "world_size": ranks.world_size, "zero_stage": stage, "rollout_workers": ranks.rollout_workers}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
