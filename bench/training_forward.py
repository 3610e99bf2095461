"""One training update's forward + backward, by minibatch split and forward kind, side by side.

On one rollout batch of the tiny preset's warm start (16 prompts x 8 samples, <= 24 new tokens at
T = 0.7, as the trainer gets it; ``--preset`` for another), for each ``rl.minibatch_split`` (rows, groups) and
``rl.shared_prompt_forward`` (off, on): the seconds of the forward (``token_logprobs`` as
``train_step`` calls it, entropy included) and backward of the batch's 4 minibatches, per
minibatch, median over repeats with the settings' order rotated; the token positions the model
runs per minibatch; and the largest log-prob difference from the plain forward of the same rows.

    python -m bench.training_forward --cache runs/ws     # warm start from the cache (built when missing)

Prints a table, then as the very last line one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from a3po.algorithms.minibatches import MINIBATCH_SPLITS
from a3po.config import preset
from a3po.data.datasets import load_rows
from a3po.devices import model_device, sampling_generator
from a3po.models.factory import load_pretrained
from a3po.models.logprobs import token_logprobs
from a3po.rollout.torch_engine import RolloutEngine
from a3po.rollout.types import SamplingParams
from a3po.training.run import prepare_warmstart

SETTINGS = [("rows", False), ("rows", True), ("groups", False), ("groups", True)]


def positions(ids: torch.Tensor, attn: torch.Tensor, start: int, shared: bool) -> int:
    """Token positions one forward runs: every row's columns, or each distinct prompt once."""
    if not shared:
        return ids.numel()
    k = len(torch.unique(torch.cat([ids[:, :start], attn[:, :start]], 1), dim=0))
    return k * start + ids.shape[0] * (ids.shape[1] - start) if k < ids.shape[0] else ids.numel()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.training_forward", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny", help="config preset whose warm start and batch shape to use (default tiny)")
    ap.add_argument("--cache", default=None, help="warm-start cache folder (default: a temporary one, so a warm start is trained)")
    ap.add_argument("--repeats", type=int, default=7, help="timed rounds over the settings (default 7)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1, as the trainer thread of an asynchronous run)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.repeats < 1 or args.threads < 1:
        ap.error("--repeats and --threads must be >= 1")
    cfg = preset(args.preset)
    cache = Path(args.cache) if args.cache else Path(tempfile.mkdtemp(prefix="a3po-training-forward-"))
    ws_dir, _ = prepare_warmstart(cfg, cache, log=lambda s: print(s, file=sys.stderr))
    torch.set_num_threads(args.threads)
    model, tok = load_pretrained(ws_dir, dtype=torch.float32, device=torch.device("cpu"))
    rl = cfg.rl
    rows, _, _ = load_rows(cfg.data, tok)
    prompts, groups = [], []
    for g, row in enumerate(rows[: rl.batch_prompts]):
        prompts += [tok(row["prompt"], add_special_tokens=False)["input_ids"]] * rl.group_size
        groups += [g] * rl.group_size
    engine = RolloutEngine(model, tok.eos_token_id, tok.pad_token_id)
    b = engine.generate(prompts, SamplingParams(rl.max_new_tokens, rl.temperature), generator=sampling_generator(model_device(model), 0))
    group_ids = torch.tensor(groups)
    model.train()

    def minibatches(split: str) -> list[torch.Tensor]:
        return list(MINIBATCH_SPLITS.get(split)(group_ids, torch.Generator().manual_seed(0)).chunk(rl.minibatches))

    def update(split: str, shared: bool) -> None:
        for mb in minibatches(split):
            logp, _ = token_logprobs(model, b.input_ids[mb], b.attention_mask[mb], rl.temperature, return_entropy=True,
                                     start=b.prompt_len, share_prompt=shared)
            (logp * b.response_mask[mb]).sum().backward()
        model.zero_grad(set_to_none=True)

    times: dict[tuple[str, bool], list[float]] = {s: [] for s in SETTINGS}
    for r in range(args.repeats + 1):  # r == 0 warms up (not timed)
        for s in SETTINGS[r % len(SETTINGS):] + SETTINGS[: r % len(SETTINGS)]:
            t0 = time.perf_counter()
            update(*s)
            if r:
                times[s].append((time.perf_counter() - t0) / rl.minibatches)
    results = {}
    for split, shared in SETTINGS:
        diff, pos = 0.0, []
        with torch.no_grad():
            for mb in minibatches(split):
                ids, attn, m = b.input_ids[mb], b.attention_mask[mb], b.response_mask[mb]
                plain = token_logprobs(model, ids, attn, rl.temperature, start=b.prompt_len)
                got = token_logprobs(model, ids, attn, rl.temperature, start=b.prompt_len, share_prompt=shared)
                diff = max(diff, (got - plain)[m].abs().max().item())
                pos.append(positions(ids, attn, b.prompt_len, shared))
        results[f"{split}/{'shared' if shared else 'plain'}"] = {
            "s_per_update": statistics.median(times[(split, shared)]), "positions": statistics.fmean(pos), "max_abs_logp_diff": diff}
    base = results["rows/plain"]["s_per_update"]
    print(f"training_forward: batch {len(b)} x {b.input_ids.shape[1]} columns ({b.prompt_len} prompt), "
          f"{int(b.response_mask.sum())} generated tokens, {rl.minibatches} minibatches; {args.threads} thread(s); "
          f"median of {args.repeats}")
    head = f"{'split/forward':<16} {'ms / update':>12} {'vs rows/plain':>14} {'positions':>10} {'max |dlogp|':>12}"
    print(head + "\n" + "-" * len(head))
    for name, r in results.items():
        r["speedup"] = base / r["s_per_update"]
        print(f"{name:<16} {r['s_per_update'] * 1e3:>12.1f} {r['speedup']:>13.2f}x {r['positions']:>10.0f} {r['max_abs_logp_diff']:>12.1e}")
    summary = {"bench": "training_forward", "threads": args.threads, "repeats": args.repeats, "settings": results}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
