"""OPPO's overlaps against OPPO off, side by side in one run on the long-tailed workload.

Same preset, seed and long-tailed embedded task (``data.long_tail_frac``) per setting. Two paths:

* ``--path grpo`` (default): settings "off" and "inter" (the GRPO path has no scoring model, so
  no intra-step overlap);
* ``--path ppo``: the tiny-ppo settings (GAE + critic + KL against the frozen warm start),
  settings "off", "intra", "inter", "both" (intra + inter).

``--max-staleness`` (default 0) is the staleness bound of the loglinear variant every setting
runs: 0 is synchronous PPO (generate -> score -> train in turn, the paper's and TRL's baseline:
the latency OPPO hides is on the step's critical path); 1 or more lets the producer run ahead of
the trainer (asynchronous: generation already overlaps training, and OPPO can only hide what is
left). Every setting runs with ``update_threads: 1`` (one intra-op thread per Python thread),
so the comparison is the overlap alone, not a thread count (the default gives a synchronous
update every core, oppo.inter not). The table says which side bounds each setting's step.

``--chunk`` (default 16) pins intra's chunk size and ``--delta`` (default 8) pins inter's Delta: a
run of a dozen steps would otherwise spend most of them probing chunk sizes (1 and 2 cost twice a
step on CPU) or walking Delta up from 2 (too few spare groups to cut the tail); ``--chunk 0`` and
``--delta -1`` measure the online tuner and the reward-slope rule instead.

Per setting: median step latency (trainer period = wait + train), trainer and generator busy
fractions (and the scorer threads' with intra), reward mean, answer lengths. ``--warmstart-cache
DIR`` starts RL from the preset's supervised warm start on the same long-tailed data (built there
once, reused after: without the long problems in its data the warm start answers them in one line
and there is no tail), else from a random init. On the PPO path, where TRL 1.12 is importable,
TRL's PPOTrainer runs the "off" setting's work too (same config, start, prompts and lengths;
``bench.peer_trl_ppo``) and gets a row, with its ratio to off and each setting's to it; elsewhere
the JSON says why it was not run. TRL 1.12 is the last release with PPO, so it has a venv of its
own, ``.venv-trl-ppo`` (``make setup-trl-ppo``; ``A3PO_TRL_PPO_VENV`` for one elsewhere), which
``python -m bench.oppo --path ppo`` finds and re-runs itself in (``--no-trl`` skips TRL)::

    python -m bench.oppo                       # micro model, 12 steps per setting
    python -m bench.oppo --preset tiny --steps 20 --long-tail 0.3
    python -m bench.oppo --path ppo --preset tiny --warmstart-cache runs/ws-long-tail --steps 12   # + TRL's PPO
    python -m bench.oppo --path ppo --preset smol --steps 6 --max-new-tokens 96 --no-trl           # the pretrained 135M model

On ``smol`` (make setup-smol) the policy is the pretrained SmolLM2-135M-Instruct (its Q4_1 file
dequantised to float32) with no warm start, the critic a copy of it (``critic_lr`` 10x the
policy's), the reference the frozen start, the long tail the word problems' multi-step chains,
the grader the preset's.

Prints a table, then as the very last line one JSON object with the key figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from a3po.config import ConfigError
from a3po.training.loop import rl_train
from bench._peer_venvs import TRL_PPO
from bench._ppo_workload import SETTINGS, parse_args, setting_config, setting_model
from bench.peer_trl_ppo import run_trl_ppo, trl_ppo_missing


def run_setting(args: argparse.Namespace, oppo: dict) -> dict:
    try:
        cfg = setting_config(args, oppo)
    except ConfigError as e:
        return {"refused": str(e)}
    model, tok, train, held = setting_model(args, cfg)
    res = rl_train(cfg, model, tok, train, held[:4], warmstart_acc=0.0)
    h = res.history[1:]  # the first step has nothing to overlap with
    period = [x["perf/train_s"] + x["perf/idle_s"] for x in h]
    scorer = [sum(v for k, v in x.items() if k.startswith("oppo/scorer_busy_s/")) / p for x, p in zip(h, period, strict=False)]
    trainer_busy = statistics.mean(x["perf/trainer_busy_frac"] for x in h)
    return {
        "step_s_median": statistics.median(period),
        "generate_s_median": statistics.median(x["perf/generate_s"] for x in h),
        "train_s_median": statistics.median(x["perf/train_s"] for x in h),
        "trainer_busy": trainer_busy,
        "generator_busy": statistics.mean(x["perf/generator_busy_frac"] for x in h),
        "scorer_busy": statistics.mean(scorer),
        # Synchronous: generation and training take turns, the step is their sum. Asynchronous: the
        # busier side bounds the step (the trainer never waits: training; it mostly waits: generation).
        "bound_by": "in turn" if args.max_staleness == 0 else ("training" if trainer_busy > 0.9 else "generation"),
        "reward_mean": statistics.mean(x["reward/mean"] for x in res.history),
        "response_len": statistics.mean(x["response/length_mean"] for x in res.history),
        "carried_mean": statistics.mean(x.get("oppo/carried", 0.0) for x in h),
        "chunk_sizes": sorted({int(x["oppo/chunk_size"]) for x in res.history if "oppo/chunk_size" in x}),
    }


def trl_ppo_side(args: argparse.Namespace) -> dict | str:
    """TRL's PPOTrainer on the "off" setting's work (bench.peer_trl_ppo), or why it was not run."""
    if args.path != "ppo":
        return "not run (PPO path only: --path ppo)"
    if args.no_trl:
        return "not run (--no-trl)"
    missing = trl_ppo_missing()
    if missing:
        return f"not run: {missing}"
    cfg = setting_config(args, {})
    model, tok, train, _ = setting_model(args, cfg)
    return run_trl_ppo(cfg, model, tok, train, args.steps, threads=args.trl_threads or None)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv, description=__doc__.split("\n\n")[0])
    figures = {name: run_setting(args, oppo) for name, oppo in SETTINGS[args.path].items()}
    trl = trl_ppo_side(args)
    print(f"loglinear, max_staleness {args.max_staleness} ({'synchronous' if args.max_staleness == 0 else 'asynchronous'}), "
          f"long_tail_frac {args.long_tail}, max_new_tokens {args.max_new_tokens}, "
          f"chunk {args.chunk or 'tuned'}, Delta {args.delta if args.delta >= 0 else 'reward-slope rule'}")
    print(f"{'setting':8} {'step_s':>8} {'speedup':>8} {'gen_s':>7} {'train_s':>8} {'trainer_busy':>13} {'gen_busy':>9} "
          f"{'scorer_busy':>12} {'bound_by':>10} {'reward':>7} {'resp_len':>9}")
    off = figures["off"]["step_s_median"]
    for name, f in figures.items():
        if "refused" in f:
            print(f"{name:8} refused: {f['refused']}")
            continue
        print(f"{name:8} {f['step_s_median']:8.3f} {off / f['step_s_median']:8.2f} {f['generate_s_median']:7.3f} {f['train_s_median']:8.3f} "
              f"{f['trainer_busy']:13.2f} {f['generator_busy']:9.2f} {f['scorer_busy']:12.2f} {f['bound_by']:>10} "
              f"{f['reward_mean']:7.3f} {f['response_len']:9.1f}")
    if isinstance(trl, dict):  # speedup column: off / TRL; then each setting against TRL
        print(f"{'TRL PPO':8} {trl['step_s_median']:8.3f} {off / trl['step_s_median']:8.2f} {'-':>7} {'-':>8} {trl['trainer_busy']:13.2f} "
              f"{trl['generator_busy']:9.2f} {trl['scorer_busy']:12.2f} {'in turn':>10} {trl['reward_mean']:7.3f} {trl['response_len']:9.1f}")
        vs_trl = {name: trl["step_s_median"] / f["step_s_median"] for name, f in figures.items() if "refused" not in f}
        print("vs TRL PPO (TRL step_s / setting step_s): " + ", ".join(f"{k} {v:.2f}x" for k, v in vs_trl.items()))
    else:
        print(f"TRL PPO  {trl}")
    speedup = {f"speedup_{name}": off / f["step_s_median"] for name, f in figures.items() if name != "off" and "refused" not in f}
    out = {"bench": "oppo", "path": args.path, "max_staleness": args.max_staleness, "chunk": args.chunk, "delta": args.delta,
           **speedup, "settings": figures,
           **({"intra": "not run (PPO path: --path ppo)"} if args.path == "grpo" else {}), "trl_ppo": trl,
           **({"vs_trl_ppo": vs_trl} if isinstance(trl, dict) else {}),
           "command": "python -m bench.oppo " + " ".join(argv if argv is not None else sys.argv[1:])}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    cli = parse_args(sys.argv[1:])
    if cli.path == "ppo" and not cli.no_trl and trl_ppo_missing():
        TRL_PPO.rerun_here("bench.oppo", sys.argv[1:])
    main()
