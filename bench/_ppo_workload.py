"""The workload bench.oppo measures and bench.peer_trl_ppo gives TRL: the settings (OPPO's
overlaps per path), the command line both take, each setting's config and its starting model.
Kept apart from both so neither bench imports the other for it."""

from __future__ import annotations

import argparse

import torch

from a3po.config import PRESETS, preset, with_overrides
from a3po.data.arithmetic import WORDS
from a3po.data.datasets import load_rows
from a3po.models.factory import load_model, load_pretrained
from bench._peer_venvs import TRL_PPO

# The PPO parts per preset: tiny-ppo's on the built-in models; on the pretrained 135M model the
# critic is a copy of the policy too, and tiny's critic step (1e-3) would wreck its pretrained
# features: 10x the policy's lr instead, the ratio RLHF trainers commonly use.
PPO_PARTS = {
    "micro": PRESETS["tiny-ppo"],
    "tiny": PRESETS["tiny-ppo"],
    "smol": {"rl": {"advantage": "gae"},
             "ppo": {**PRESETS["tiny-ppo"]["ppo"], "critic_lr": 10 * PRESETS["smol"]["rl"]["lr"]}},
}

SETTINGS = {
    "grpo": {"off": {"inter": False}, "inter": {"inter": True}},
    "ppo": {"off": {}, "intra": {"intra": True}, "inter": {"inter": True}, "both": {"intra": True, "inter": True}},
}


def parse_args(argv: list[str] | None = None, prog: str = "python -m bench.oppo", description: str | None = None) -> argparse.Namespace:
    hint = TRL_PPO.install_hint(prog.removeprefix("python -m "))
    ap = argparse.ArgumentParser(prog=prog, description=description, epilog=f"TRL's PPO (PPO path) needs TRL 1.12, in a venv of its own: {hint}")
    ap.add_argument("--preset", default="micro", choices=sorted(PPO_PARTS),
                    help="micro / tiny: the built-in models; smol: the pretrained SmolLM2-135M-Instruct (make setup-smol)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--long-tail", type=float, default=0.25, help="data.long_tail_frac")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--path", default="grpo", choices=sorted(SETTINGS))
    ap.add_argument("--max-staleness", type=int, default=0, help="rl.max_staleness of the loglinear variant (0: synchronous)")
    ap.add_argument("--chunk", type=int, default=16, help="intra: pin the streamed chunk size (0: the online tuner, oppo.chunk_min..chunk_max)")
    ap.add_argument("--delta", type=int, default=8, help="inter: pin Delta, the extra groups admitted per step (-1: the reward-slope rule)")
    ap.add_argument("--warmstart-cache", default=None, help="start RL from the preset's warm start, cached in this folder")
    ap.add_argument("--no-trl", action="store_true", help="skip TRL's PPO row (PPO path; run where TRL 1.12 is importable)")
    ap.add_argument("--trl-threads", type=int, default=0, help="TRL's intra-op threads (0: every usable core)")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be >= 2")
    if args.max_staleness < 0 or args.chunk < 0 or args.delta < -1 or args.trl_threads < 0:
        ap.error("--max-staleness, --chunk and --trl-threads must be >= 0, --delta >= -1")
    return args


def oppo_overrides(args: argparse.Namespace, oppo: dict) -> dict:
    """A setting's ``oppo:`` section with the bench's pins (chunk size, Delta)."""
    out = dict(oppo)
    if oppo.get("intra") and args.chunk:
        out.update(chunk_min=args.chunk, chunk_max=args.chunk)
    if oppo.get("inter") and args.delta >= 0:
        out.update(delta_init=args.delta, delta_min=args.delta, delta_max=args.delta)
    return out


def setting_config(args: argparse.Namespace, oppo: dict):
    """One setting's config (ConfigError when the combination is refused)."""
    ppo = PPO_PARTS[args.preset] if args.path == "ppo" else {}
    return with_overrides(preset(args.preset), data={"long_tail_frac": args.long_tail},
                          rl={**ppo.get("rl", {}), "steps": args.steps, "seed": args.seed, "max_new_tokens": args.max_new_tokens,
                              "variant": "loglinear", "max_staleness": args.max_staleness,
                              "eval_every": 10**6, "checkpoint_every": 10**6},
                          ppo=ppo.get("ppo", {}), oppo=oppo_overrides(args, oppo), update_threads=1)


def setting_model(args: argparse.Namespace, cfg):
    """The starting policy, tokenizer, training and held-out rows of a setting."""
    # As a3po.training.run does: every thread on cfg.torch_threads (without a warm start nothing else sets
    # it, and two OpenMP threads per Python thread on 2 busy cores cost many times a step).
    torch.set_num_threads(cfg.torch_threads)
    if args.warmstart_cache:
        from a3po.training.run import prepare_warmstart

        ws_cfg = with_overrides(preset(args.preset), data={"long_tail_frac": args.long_tail})
        ws_dir, _ = prepare_warmstart(ws_cfg, args.warmstart_cache, log=lambda s: None)
        model, tok = load_pretrained(ws_dir)
    else:
        # a built-in size, or the named pretrained model
        model, tok = load_model(cfg.model.name, seed=cfg.model.init_seed, words=WORDS)
    train, held, _ = load_rows(cfg.data, tok)
    return model, tok, train, held
