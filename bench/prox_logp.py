"""What A-3PO's loglinear proximal log-probs save against recomputing them.

On one rollout batch and from the same starting weights, side by side in one run:

(a) the proximal log-probs themselves: ``loglinear`` (the ``PROXIMAL_METHODS`` call, given the
    theta log-probs the training forward already produced) against ``recompute`` (the extra
    no-grad forward pass, ``token_logprobs``), median over repeats;
(b) the whole ``a3po.training.step.train_step`` for the variants sync / recompute / loglinear, weights
    re-loaded before every step, the order rotated each repeat (fair on a noisy machine).

    python -m bench.prox_logp                    # "small" model (~8M params), batch 64, ~2.5 min on 2 cores
    python -m bench.prox_logp --batch 16 --repeats 9 --seq-len 64

Prints a table, then as the very last line one JSON object with the key figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from a3po.algorithms.proximal import PROXIMAL_METHODS, ProxInputs
from a3po.config import RLConfig, Variant, proximal_method_name
from a3po.data.arithmetic import WORDS, generate_split
from a3po.devices import model_device, sampling_generator, synchronize
from a3po.models.factory import TINY_ARCHS, build_tiny_model, count_parameters
from a3po.models.logprobs import token_logprobs
from a3po.producer.producer import ScoredBatch
from a3po.producer.weight_store import clone_state
from a3po.rollout.torch_engine import RolloutEngine
from a3po.rollout.types import RolloutBatch, SamplingParams
from a3po.training.step import train_step

MIN_BENCH_PARAMS = 5_000_000  # below this a forward pass is too cheap to show what loglinear saves


def make_scored_batch(
    model: torch.nn.Module,
    tokenizer,
    n_prompts: int,
    group_size: int,
    max_new_tokens: int,
    seed: int = 0,
    version: int = 0,
    temperature: float = 1.0,
    top_p: float = 1.0,
) -> ScoredBatch:
    """A ``ScoredBatch`` as the controller delivers it: ``n_prompts`` embedded-task prompts, each
    sampled ``group_size`` times by the rollout engine at policy ``version``. Rewards are seeded
    uniform numbers (varied within every group, so GRPO advantages are non-zero); what they
    reward does not matter to timings or to the identities the tests check."""
    rows = generate_split(n_prompts, "train", seed)
    prompts, meta = [], []
    for g, row in enumerate(rows):
        ids = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        for _ in range(group_size):
            prompts.append(ids)
            meta.append({"id": row["id"], "gold": row["gold"], "group": g})
    engine = RolloutEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, version=version)
    gen = sampling_generator(model_device(model), seed)
    rollout = engine.generate(prompts, SamplingParams(max_new_tokens, temperature, top_p), generator=gen, meta=meta)
    return with_seeded_rewards(rollout, seed + 1)


def with_seeded_rewards(rollout: RolloutBatch, seed: int, index: int = 0, gen_time_s: float = 0.0) -> ScoredBatch:
    """``rollout`` scored with seeded uniform rewards (drawn on the CPU, so the same on every
    device, then moved to the rollout's device)."""
    rewards = torch.rand(len(rollout), generator=torch.Generator().manual_seed(seed)).to(rollout.input_ids.device)
    return ScoredBatch(index=index, rollout=rollout, rewards=rewards, completions=[""] * len(rollout), gen_time_s=gen_time_s)


def _median_time(fn, inner: int = 1, device: torch.device = torch.device("cpu")) -> float:
    """Seconds per call of ``fn``, averaged over ``inner`` back-to-back calls (queued device
    work included)."""
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    synchronize(device)
    return (time.perf_counter() - t0) / inner


def time_proximal(model, scored: ScoredBatch, version: int, cfg: RLConfig, repeats: int, inner: int) -> dict[str, float]:
    """Median seconds of the loglinear and recompute proximal methods on the full batch."""
    temperature = cfg.temperature
    b = scored.rollout
    resp = b.response_mask
    staleness = torch.where(resp, version - b.versions, torch.full_like(b.versions, -1))
    # theta log-probs as the training forward produces them (with grad), computed once: loglinear
    # only reads them, which is the point.
    model.train()
    theta = token_logprobs(model, b.input_ids, b.attention_mask, temperature)

    def recompute() -> torch.Tensor:
        with torch.no_grad():  # exactly what train_step does for methods that need a forward
            return token_logprobs(model, b.input_ids, b.attention_mask, temperature, start=b.prompt_len,
                                  share_prompt=cfg.shared_prompt_forward)

    def call(name: str) -> torch.Tensor:
        inp = ProxInputs(behav_logp=b.behav_logp, theta_logp=theta.detach(), staleness=staleness, mask=resp, recompute_logp=recompute)
        return PROXIMAL_METHODS.get(name)(inp)[0]

    call("loglinear"), call("recompute")  # warm-up (allocator, lazy init)
    t_ll, t_rc = [], []
    device = model_device(model)
    for _ in range(repeats):
        t_ll.append(_median_time(lambda: call("loglinear"), inner, device))
        t_rc.append(_median_time(lambda: call("recompute"), 1, device))
    model.eval()
    return {"loglinear": statistics.median(t_ll), "recompute": statistics.median(t_rc)}


def time_steps(model, scored: ScoredBatch, version: int, rl_kwargs: dict, repeats: int, warmup: int) -> dict[str, dict[str, float]]:
    """Median wall seconds of ``train_step`` per variant (and its own ``prox/time_s``)."""
    init = clone_state(model)
    variants = [Variant.SYNC, Variant.RECOMPUTE, Variant.LOGLINEAR]
    walls: dict[str, list[float]] = {v.value: [] for v in variants}
    prox: dict[str, list[float]] = {v.value: [] for v in variants}
    for r in range(warmup + repeats):
        order = variants[r % 3 :] + variants[: r % 3]  # rotate: no variant always runs first
        for v in order:
            model.load_state_dict(init)
            cfg = RLConfig(variant=v, **rl_kwargs)
            opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
            method = PROXIMAL_METHODS.get(proximal_method_name(cfg))
            t0 = time.perf_counter()
            metrics = train_step(model, opt, scored, version, cfg, method)
            wall = time.perf_counter() - t0
            if r >= warmup:
                walls[v.value].append(wall)
                prox[v.value].append(metrics["prox/time_s"])
    model.load_state_dict(init)
    return {v: {"step_s": statistics.median(walls[v]), "prox_s": statistics.median(prox[v])} for v in walls}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.prox_logp", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small", choices=sorted(TINY_ARCHS), help="built-in architecture (default: small, ~8M params)")
    ap.add_argument("--batch", type=int, default=64, help=(
        "sequences per batch (prompts x group size; default 64, half the tiny preset's 128-sequence "
        "training batch: the recompute cost grows with it, the loglinear cost hardly does)"))
    ap.add_argument("--group-size", type=int, default=4, help="samples per prompt (GRPO group; must divide --batch)")
    ap.add_argument("--seq-len", type=int, default=48, help="max generated tokens per sequence (default 48)")
    ap.add_argument("--minibatches", type=int, default=4, help="optimizer steps per train_step (default 4)")
    ap.add_argument("--staleness", type=int, default=2, help="trainer version minus the batch's version (default 2)")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement (default 5)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds of train_step first (default 1)")
    ap.add_argument("--prox-inner", type=int, default=20, help="loglinear calls averaged per timing sample (default 20)")
    ap.add_argument("--threads", type=int, default=1, help=(
        "torch intra-op threads (default 1: on a shared 2-core machine two threads contend and "
        "inflate every timing several-fold; 0 keeps torch's default)"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.batch < 1 or args.group_size < 1 or args.batch % args.group_size:
        ap.error("--group-size must divide --batch")
    if args.batch % args.minibatches:
        ap.error("--minibatches must divide --batch")
    if min(args.seq_len, args.repeats, args.prox_inner) < 1 or min(args.warmup, args.staleness, args.threads) < 0:
        ap.error("--seq-len, --repeats and --prox-inner must be >= 1; --warmup, --staleness and --threads >= 0")
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, tokenizer = build_tiny_model(args.model, WORDS, seed=args.seed)
    params = count_parameters(model)
    if args.model == "small" and params < MIN_BENCH_PARAMS:
        raise SystemExit(f"bench model has {params:,} parameters, expected >= {MIN_BENCH_PARAMS:,}")
    n_prompts = args.batch // args.group_size
    rl_kwargs = dict(batch_prompts=n_prompts, group_size=args.group_size, minibatches=args.minibatches, max_new_tokens=args.seq_len, seed=args.seed)
    temperature = RLConfig(**rl_kwargs).temperature
    # Sampled at the training temperature, as the controller would.
    scored = make_scored_batch(model, tokenizer, n_prompts, args.group_size, args.seq_len, seed=args.seed, temperature=temperature)
    b = scored.rollout
    n_gen = int(b.response_mask.sum())

    prox = time_proximal(model, scored, args.staleness, RLConfig(**rl_kwargs), args.repeats, args.prox_inner)
    steps = time_steps(model, scored, args.staleness, rl_kwargs, args.repeats, args.warmup)

    prox_speedup = prox["recompute"] / prox["loglinear"]
    step_speedup = steps["recompute"]["step_s"] / steps["loglinear"]["step_s"]
    print(f"model {args.model}: {params:,} parameters; batch {len(b)} x {b.input_ids.shape[1]} tokens "
          f"({b.prompt_len} prompt columns, {n_gen} generated tokens); torch threads {torch.get_num_threads()}")
    print(f"\nproximal log-probs, full batch, median of {args.repeats} (loglinear: mean of {args.prox_inner} calls each)")
    print(f"  {'loglinear (no forward)':<26}{prox['loglinear']:>12.6f} s")
    print(f"  {'recompute (no-grad fwd)':<26}{prox['recompute']:>12.6f} s")
    print(f"  {'speedup':<26}{prox_speedup:>12.0f} x")
    print(f"\ntrain_step, {args.minibatches} minibatches, staleness {args.staleness}, median of {args.repeats}, order rotated")
    print(f"  {'variant':<12}{'step s':>10}{'prox s':>12}")
    for v, t in steps.items():
        print(f"  {v:<12}{t['step_s']:>10.4f}{t['prox_s']:>12.6f}")
    print(f"  loglinear vs recompute step speedup: {step_speedup:.3f} x\n")
    figures = {
        "params": params,
        "prox_time_loglinear_s": prox["loglinear"],
        "prox_time_recompute_s": prox["recompute"],
        "prox_speedup": prox_speedup,
        "step_time_sync_s": steps["sync"]["step_s"],
        "step_time_recompute_s": steps["recompute"]["step_s"],
        "step_time_loglinear_s": steps["loglinear"]["step_s"],
        "step_speedup_loglinear_vs_recompute": step_speedup,
        "model": args.model,
        "batch": len(b),
        "seq_len": args.seq_len,
        "generated_tokens": n_gen,
        "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "command": " ".join(["python -m bench.prox_logp", *argv]),
    }
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
