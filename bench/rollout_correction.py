"""Rollout correction against an engine that differs from the trainer: the tiny preset trained
with a bf16 torch engine beside the fp32 trainer, once per ``rl.rollout_correction`` method,
from one warm start; the engine-vs-trainer mismatch, what each method masks or truncates, and the
final reward and held-out accuracy against ``none``.

    python -m bench.rollout_correction                          # tiny preset, shortened (~1 min a run on 2 cores)
    python -m bench.rollout_correction --steps 150 --batch-prompts 16   # the whole tiny run per method
    python -m bench.rollout_correction --methods none,tis --variant sync
    python -m bench.rollout_correction --preset smol --dtype auto --methods metrics,tis,icepop \
        --steps 10 --batch-prompts 4 --threads 2                # the pretrained model computing in bf16 (make setup-smol)

``--dtype`` is the config's ``dtype``: ``float32`` (the default) trains in fp32 beside the bf16 engine;
``auto`` computes the trainer's forward and backward under bf16 autocast where the CPU has native bf16 (what
``smol`` runs), so the mismatch is then between two bf16 computations with different kernels and caches
(the engine's bf16 copy decoding token by token, the trainer's autocast forward over whole sequences).

Rows: ``none fp32`` samples with an fp32 engine (under ``--dtype float32`` the trainer's numerics: no
mismatch to correct); every other row samples with ``rollout.dtype: bfloat16``. ``none`` measures no
mismatch (nothing re-scores its batches); ``metrics`` is ``none`` with ``rl.proximal: metrics``: no
correction, each batch re-scored by a trainer-precision copy to measure the mismatch, and the update on
recompute's exact anchor (so its reward is recompute's, whatever ``--variant``). ``mis-geo`` is ``mis`` with
``rl.rollout_correction_level: geometric`` (verl's tight default 1.001). Columns, each a mean over
the run's steps unless said: ``|dlogp|`` the mean |engine - trainer| log-prob of the behaviour
version (``rollout/behav_logp_abs_err``), ``ratio p99|max`` the token ratio rho (max: over the
run), ``masked`` / ``trunc`` the fractions of tokens dropped / truncated, ``seq masked`` the
fraction of sequences dropped whole, ``reward`` the mean batch reward of the last quarter of the
steps, ``heldout`` the final sampled held-out accuracy (mean@``rl.eval_samples``), ``s`` the run's
wall time. Prints a table, then as the very last line one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from a3po.config import preset, with_overrides
from a3po.data.datasets import load_rows
from a3po.devices import DType, autocasts, machine_precision, model_dtype, resolve_device
from a3po.models.factory import load_pretrained
from a3po.training.loop import rl_train
from a3po.training.run import prepare_warmstart

# name -> (rl overrides, rollout overrides)
METHODS: dict[str, tuple[dict, dict]] = {
    "none-fp32": ({"rollout_correction": "none"}, {}),
    "none": ({"rollout_correction": "none"}, {"dtype": "bfloat16"}),
    "metrics": ({"rollout_correction": "none", "proximal": "metrics"}, {"dtype": "bfloat16"}),
    "tis": ({"rollout_correction": "tis"}, {"dtype": "bfloat16"}),
    "mis": ({"rollout_correction": "mis"}, {"dtype": "bfloat16"}),
    "mis-geo": ({"rollout_correction": "mis", "rollout_correction_level": "geometric"}, {"dtype": "bfloat16"}),
    "icepop": ({"rollout_correction": "icepop"}, {"dtype": "bfloat16"}),
}


def _mean(history: list[dict], key: str) -> float | None:
    """The mean over the steps that logged ``key``; None when none did (``none`` measures no ratio)."""
    vals = [h[key] for h in history if key in h]
    return sum(vals) / len(vals) if vals else None


def _cell(v: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{width}.{digits}f}"


def run_one(name: str, args, ws_dir, ws_acc: float) -> dict:
    rl_over, rollout_over = METHODS[name]
    cfg = with_overrides(
        preset(args.preset),
        rl={"variant": args.variant, "steps": args.steps, "batch_prompts": args.batch_prompts, "lr_warmup_steps": min(20, args.steps // 5),
            "eval_every": args.steps, "checkpoint_every": args.steps, "seed": args.seed, **rl_over},
        rollout=rollout_over, torch_threads=args.threads, update_threads=args.threads, dtype=args.dtype,
    )
    torch.manual_seed(args.seed)
    model, tok = load_pretrained(ws_dir)
    train, held, _ = load_rows(cfg.data, tok)
    t0 = time.perf_counter()
    res = rl_train(cfg, model, tok, train, held, warmstart_acc=ws_acc)
    wall = time.perf_counter() - t0
    computes_in = "bf16-autocast" if autocasts(model) else str(model_dtype(model)).removeprefix("torch.")
    h = res.history
    tail = h[-max(1, len(h) // 4):]
    return {
        "method": name,
        "engine_dtype": rollout_over.get("dtype", "float32"),
        "trainer_computes_in": computes_in,  # as the run set its policy up
        "logp_abs_err": _mean(h, "rollout/behav_logp_abs_err"),
        "ratio_p99": _mean(h, "correction/ratio_p99"),
        "ratio_max": max((x["correction/ratio_max"] for x in h if "correction/ratio_max" in x), default=None),
        "masked_frac": _mean(h, "correction/masked_frac"),
        "truncated_frac": _mean(h, "correction/truncated_frac"),
        "seq_masked_frac": _mean(h, "correction/seq_masked_frac"),
        "reward_last_quarter": _mean(tail, "reward/mean"),
        "heldout_acc": res.final_acc,
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default=",".join(m for m in METHODS if m != "metrics"), help=f"comma-separated, of {list(METHODS)}")
    ap.add_argument("--preset", default="tiny", help="a built-in config (default tiny; smol: make setup-smol)")
    ap.add_argument("--dtype", default="float32", choices=[d.value for d in DType],
                    help="the config's dtype: float32 (default) or auto (bf16 compute where the CPU has it)")
    ap.add_argument("--variant", default="loglinear", choices=["sync", "recompute", "loglinear"])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--batch-prompts", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warmstart-cache", default=None, help="the tiny warm start's cache folder (default: a temporary one)")
    args = ap.parse_args(argv)
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        ap.error(f"unknown methods {unknown}; valid: {list(METHODS)}")
    torch.set_num_threads(args.threads)
    cache = args.warmstart_cache or tempfile.mkdtemp(prefix="a3po-bench-correction-")
    base_cfg = with_overrides(preset(args.preset), torch_threads=args.threads, dtype=args.dtype)
    computes_in = machine_precision(base_cfg.dtype, resolve_device(base_cfg.device)).name
    ws_dir, ws_acc = prepare_warmstart(base_cfg, cache, log=lambda s: None)
    rows = [run_one(m, args, ws_dir, ws_acc) for m in methods]
    base = next((r for r in rows if r["method"] == "none"), None)
    print(f"{args.preset} preset, {args.variant}, {args.steps} steps x {args.batch_prompts} prompts, seed {args.seed}; "
          f"dtype {args.dtype} (the trainer computes in {computes_in}); warm start held-out {ws_acc:.3f}")
    print(f"\n{'method':<10} {'engine':<9} {'|dlogp|':>8} {'ratio p99':>9} {'max':>7} {'masked':>7} {'trunc':>7} "
          f"{'seq masked':>10} {'reward':>7} {'heldout':>8} {'s':>6}")
    for r in rows:
        print(f"{r['method']:<10} {r['engine_dtype']:<9} {_cell(r['logp_abs_err'], 8, 4)} {_cell(r['ratio_p99'], 9, 4)} "
              f"{_cell(r['ratio_max'], 7, 3)} {_cell(r['masked_frac'], 7, 4)} {_cell(r['truncated_frac'], 7, 4)} "
              f"{_cell(r['seq_masked_frac'], 10, 4)} {r['reward_last_quarter']:>7.3f} {r['heldout_acc']:>8.3f} {r['wall_s']:>6.1f}")
    out = {"bench": "rollout_correction", "preset": args.preset, "dtype": args.dtype, "trainer_computes_in": computes_in,
           "variant": args.variant, "steps": args.steps, "batch_prompts": args.batch_prompts,
           "seed": args.seed, "warmstart_acc": ws_acc,
           "rows": [{k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()} for r in rows]}
    if base is not None:
        out["heldout_vs_none"] = {r["method"]: round(r["heldout_acc"] - base["heldout_acc"], 4) for r in rows}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
