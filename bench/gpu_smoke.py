"""GPU smoke bench: a few RL steps of each variant on a real-size Qwen2 model.

The model has the Qwen2.5-0.5B shape (hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, vocab 151936, tied embeddings; ~494M parameters), built from a config with
random weights: no download, no tokenizer, prompts are random token ids. Each variant (sync,
recompute, loglinear) runs ``--steps`` RL steps through the library's own rollout engine
(``a3po.rollout.torch_engine.RolloutEngine``, sampling from a lagging copy of the weights, so async batches
are ``--staleness`` versions old) and ``a3po.training.step.train_step``. Rewards are seeded uniform
numbers (a random model solves nothing; timings do not depend on what is rewarded).

    python -m bench.gpu_smoke                    # real size; cuda + bfloat16 when available
    python -m bench.gpu_smoke --size small       # a small model: on 2 CPU cores in about a minute
    python -m bench.gpu_smoke --dtype float32 --batch 32 --steps 5 --max-new-tokens 256

Prints a table (rollout tokens/s, train step time, proximal log-prob time per variant; the
recompute / loglinear ratio of the proximal time), then as the very last line one JSON object.
Timings are medians over the steps after the first (the first pays for lazy initialisation).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from a3po.algorithms.proximal import PROXIMAL_METHODS
from a3po.config import RLConfig, Variant, effective_max_staleness, proximal_method_name
from a3po.devices import Device, DType, model_device, resolve_device, sampling_generator, synchronize
from a3po.models.factory import count_parameters
from a3po.producer.producer import batch_seed
from a3po.producer.weight_store import clone_state
from a3po.rollout.torch_engine import RolloutEngine
from a3po.rollout.types import SamplingParams
from a3po.training.step import train_step
from bench.prox_logp import with_seeded_rewards


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    # Defaults of the bench at this size: (batch, group size, steps, max new tokens, prompt length)
    defaults: tuple[int, int, int, int, int]


SIZES: dict[str, Size] = {
    # Qwen2.5-0.5B's shape (its config.json), random weights.
    "full": Size(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936, defaults=(64, 4, 4, 128, 64)),
    # The same architecture (grouped-query attention, tied embeddings) small enough for a CPU.
    "small": Size(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=4096, defaults=(16, 4, 3, 16, 16)),
}


def build_random_qwen2(size: Size, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 causal LM of ``size``, built on ``device`` (no CPU copy of a
    real-size model) and cast to ``dtype``. EOS is the last id and padding the one before it."""
    config = Qwen2Config(
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        intermediate_size=size.intermediate,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        eos_token_id=size.vocab - 1,
        pad_token_id=size.vocab - 2,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    return model.to(dtype=dtype).eval()


def random_prompts(n_prompts: int, group_size: int, prompt_len: int, vocab: int, seed: int, step: int) -> tuple[list[list[int]], list[dict]]:
    """``n_prompts`` random prompts of lengths in [prompt_len / 2, prompt_len] (left padding is
    exercised), each repeated ``group_size`` times; special ids (the last two) never appear."""
    g = torch.Generator().manual_seed(batch_seed(seed, step))
    prompts, meta = [], []
    for p in range(n_prompts):
        length = int(torch.randint(max(1, prompt_len // 2), prompt_len + 1, (1,), generator=g))
        ids = torch.randint(0, vocab - 2, (length,), generator=g).tolist()
        for _ in range(group_size):
            prompts.append(ids)
            meta.append({"id": f"s{step}p{p}", "gold": "", "group": step * n_prompts + p})
    return prompts, meta


def run_variant(policy, engine: RolloutEngine, init: dict, variant: Variant, args: argparse.Namespace) -> dict[str, list[float]]:
    """``args.steps`` RL steps of ``variant`` from ``init``; per-step rollout tokens/s, train
    step seconds and proximal log-prob seconds."""
    device = model_device(policy)
    policy.load_state_dict(init)
    cfg = RLConfig(
        variant=variant, steps=args.steps, batch_prompts=args.batch // args.group_size, group_size=args.group_size,
        minibatches=args.minibatches, max_staleness=args.staleness, max_new_tokens=args.max_new_tokens, seed=args.seed,
    )
    s = effective_max_staleness(cfg)
    method = PROXIMAL_METHODS.get(proximal_method_name(cfg))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0)
    params = SamplingParams(cfg.max_new_tokens, cfg.temperature, cfg.top_p)
    versions = {0: init}
    out: dict[str, list[float]] = {"tokens_per_s": [], "step_s": [], "prox_s": [], "staleness": []}
    for step in range(args.steps):
        # The engine samples batch `step` with the weights of version step - s (the bound).
        v = max(0, step - s)
        engine.model.load_state_dict(versions[v])
        engine.version = v
        prompts, meta = random_prompts(cfg.batch_prompts, cfg.group_size, args.prompt_len, policy.config.vocab_size, args.seed, step)
        synchronize(device)
        t0 = time.perf_counter()
        rollout = engine.generate(prompts, params, generator=sampling_generator(device, batch_seed(args.seed, step)), meta=meta)
        synchronize(device)
        gen_s = time.perf_counter() - t0
        scored = with_seeded_rewards(rollout, seed=batch_seed(args.seed, step) + 1, index=step, gen_time_s=gen_s)
        t0 = time.perf_counter()
        metrics = train_step(policy, optimizer, scored, step, cfg, method)
        synchronize(device)
        out["step_s"].append(time.perf_counter() - t0)
        out["tokens_per_s"].append(int(rollout.response_mask.sum()) / gen_s)
        out["prox_s"].append(metrics["prox/time_s"])
        out["staleness"].append(metrics["staleness/mean"])
        versions[step + 1] = clone_state(policy)
        versions.pop(step + 1 - (s + 1), None)  # the engine never needs more than s versions back
    return out


def _timed(values: list[float]) -> float:
    """Median over the steps after the first (warm-up), or the only one."""
    return statistics.median(values[1:] if len(values) > 1 else values)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_smoke", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="full", help="full: Qwen2.5-0.5B shape (default); small: CPU-sized")
    ap.add_argument("--device", choices=[d.value for d in Device], default="auto", help="auto (cuda when available), cpu, cuda")
    ap.add_argument("--dtype", choices=[d.value for d in DType if d is not DType.AUTO], default=None,
                    help="weights; default bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--batch", type=int, default=None, help="sequences per batch (prompts x group size); default 64 full, 16 small")
    ap.add_argument("--group-size", type=int, default=None, help="samples per prompt (must divide --batch); default 4")
    ap.add_argument("--steps", type=int, default=None, help="RL steps per variant (first one untimed); default 4 full, 3 small")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="generated tokens per sequence; default 128 full, 16 small")
    ap.add_argument("--prompt-len", type=int, default=None, help="longest random prompt; default 64 full, 16 small")
    ap.add_argument("--minibatches", type=int, default=4, help="optimizer steps per train_step (default 4)")
    ap.add_argument("--staleness", type=int, default=1, help="rl.max_staleness of the async variants (default 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU (default 1; 0 keeps torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    size = SIZES[args.size]
    for name, default in zip(("batch", "group_size", "steps", "max_new_tokens", "prompt_len"), size.defaults, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if min(args.batch, args.group_size, args.steps, args.max_new_tokens, args.prompt_len, args.minibatches) < 1 or args.staleness < 0:
        ap.error("--batch, --group-size, --steps, --max-new-tokens, --prompt-len and --minibatches must be >= 1; --staleness >= 0")
    if args.batch % args.group_size or args.batch % args.minibatches:
        ap.error("--group-size and --minibatches must divide --batch")
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    device = resolve_device(args.device)
    dtype = DType(args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if device.type == "cpu" and args.threads > 0:
        torch.set_num_threads(args.threads)
    size = SIZES[args.size]
    t_build = time.perf_counter()
    policy = build_random_qwen2(size, device, dtype.torch, seed=args.seed)
    engine_model = build_random_qwen2(size, device, dtype.torch, seed=args.seed)  # weights overwritten per step
    engine = RolloutEngine(engine_model, size.vocab - 1, size.vocab - 2)
    init = clone_state(policy)
    build_s = time.perf_counter() - t_build
    n_params = count_parameters(policy)

    results = {v.value: run_variant(policy, engine, init, v, args) for v in (Variant.SYNC, Variant.RECOMPUTE, Variant.LOGLINEAR)}
    summary = {v: {k: _timed(r[k]) for k in ("tokens_per_s", "step_s", "prox_s")} for v, r in results.items()}
    prox_ratio = summary["recompute"]["prox_s"] / summary["loglinear"]["prox_s"]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak_gib = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None

    print(f"model: Qwen2 {args.size} ({n_params:,} parameters, random weights) on {device}"
          f"{f' ({gpu})' if gpu else ''} in {dtype.value}; built in {build_s:.1f} s")
    print(f"batch {args.batch} = {args.batch // args.group_size} prompts x {args.group_size}, prompts <= {args.prompt_len} tokens, "
          f"{args.max_new_tokens} new tokens, {args.minibatches} minibatches, staleness {args.staleness} (async variants); "
          f"{args.steps} steps per variant, median of steps 2..{args.steps}")
    print(f"\n  {'variant':<11}{'rollout tok/s':>15}{'step s':>10}{'prox s':>12}{'staleness':>11}")
    for v, t in summary.items():
        print(f"  {v:<11}{t['tokens_per_s']:>15.1f}{t['step_s']:>10.3f}{t['prox_s']:>12.5f}{statistics.mean(results[v]['staleness']):>11.2f}")
    print(f"\n  proximal log-probs: recompute {summary['recompute']['prox_s']:.5f} s / loglinear "
          f"{summary['loglinear']['prox_s']:.5f} s = {prox_ratio:.1f} x")
    print(f"  train step: recompute / loglinear = {summary['recompute']['step_s'] / summary['loglinear']['step_s']:.3f} x"
          + (f"; peak GPU memory {peak_gib:.1f} GiB" if peak_gib is not None else "") + "\n")
    figures = {
        "size": args.size,
        "params": n_params,
        "device": str(device),
        "gpu": gpu,
        "dtype": dtype.value,
        "batch": args.batch,
        "max_new_tokens": args.max_new_tokens,
        "steps": args.steps,
        **{f"{v}/{k}": round(t[k], 6) for v, t in summary.items() for k in ("tokens_per_s", "step_s", "prox_s")},
        "prox_ratio_recompute_vs_loglinear": round(prox_ratio, 3),
        "peak_gpu_mem_gib": None if peak_gib is None else round(peak_gib, 2),
        "command": " ".join(["python -m bench.gpu_smoke", *argv]),
    }
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
