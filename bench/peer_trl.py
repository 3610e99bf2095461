"""The project against TRL's GRPOTrainer on the same work, side by side in one run: seconds per
cycle and rollout tokens/s of each variant and of TRL.

    make setup-trl                        # once: .venv-trl, TRL 1.16 (the 'bench' extra)
    python -m bench.peer_trl --cycles 20  # both sides, in .venv-trl (re-runs itself there when it exists)
    python -m bench.peer_trl --no-trl     # the project's side only

The work: the tiny preset's warm start (from the warm-start cache, built once when
missing), its embedded prompts and grader, 16 prompts x 8 samples per batch, at most 24 new
tokens at T = 0.7, 4 optimizer updates of 32 samples per batch at lr 1e-4 (constant, no
warm-up), no KL term, token-mean loss, gradient clipping at 1.0. A *cycle* is one batch
generated, scored and trained on. Project: the time between two consecutive training steps'
ends, i.e. what a step costs once the loop runs (the first and the last step, with start-up and
the final evaluation, are left out). TRL: the time between two consecutive ends of every 4th
optimizer step (one generation each, ``steps_per_generation = 4``), the first cycle left out.
With ``--rollout-workers N`` (default 1) each asynchronous variant also runs with its rollouts
in N processes of their own (``distributed.rollout_workers``, torchrun; row ``<variant>+Nw``):
the same batches and updates bit for bit (docs/distributed.md), without the in-process producer
thread's share of the trainer's interpreter lock. Medians over ``--cycles`` cycles; beside the
wall time, the process's CPU time per cycle (all its threads: on a shared machine the work done,
less sensitive to other processes than wall time; on one core it is what the wall time would be
on a quiet one; not for the ``+Nw`` rows, whose work is spread over processes). Rollout
tokens/s: generated tokens (EOS included) over the time of the generation call (the project's
engine, without scoring; TRL's ``_generate_single_turn``, i.e. ``transformers.generate``), median
over batches.

TRL's settings: ``per_device_train_batch_size 32``, ``steps_per_generation 4`` (a generation batch
of 128 = 16 prompts x ``num_generations 8``), ``num_iterations 1``, ``beta 0``, ``loss_type bnpo``
(token mean over the 32-sample update: the project's loss normalisation), ``scale_rewards group``,
``epsilon 0.2``, fp32, no gradient checkpointing, every core this process may use. TRL is the
optional ``bench`` extra, in a venv of its own: ``.venv-trl`` (``make setup-trl``;
``A3PO_TRL_VENV=DIR`` for one elsewhere). Without it the bench says how to build it and runs the
project's side alone. Prints a table, then
as the very last line one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from a3po.config import TrainConfig, Variant, preset, with_overrides
from a3po.data.datasets import load_rows, prompt_style
from a3po.grading.rewards import score_completions
from a3po.models.factory import load_pretrained
from a3po.placement.cores import usable_cores
from a3po.training.run import prepare_warmstart, train_variant
from bench._peer_venvs import TRL

UPDATES_PER_BATCH = 4


def work_config(cycles: int, torch_threads: int | None, update_threads: int | None = None, preset_name: str = "tiny") -> TrainConfig:
    """The tiny preset (the comparison's work; another for a quick check) as the comparison runs it:
    constant lr 1e-4 as TRL's, no evaluation or checkpoint inside the timed steps (one of each at
    the last, untimed step)."""
    steps = cycles + 2  # the first step (producer start-up) and the last (final evaluation) are not timed
    rl = {"steps": steps, "lr": 1e-4, "lr_schedule": "constant", "lr_warmup_steps": 0, "minibatches": UPDATES_PER_BATCH,
          "eval_every": steps, "checkpoint_every": steps}
    extra = {k: v for k, v in (("torch_threads", torch_threads), ("update_threads", update_threads)) if v is not None}
    return with_overrides(preset(preset_name), rl=rl, **extra)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def project_side(cfg: TrainConfig, variant: str, ws_dir: Path, ws_acc: float, out: Path) -> dict:
    cfg = with_overrides(cfg, rl={"variant": variant})
    ends: list[float] = []
    cpu_ends: list[float] = []
    rewards: list[float] = []
    tok_s: list[float] = []
    batch = cfg.rl.batch_prompts * cfg.rl.group_size

    def progress(step: int, m: dict[str, float]) -> None:
        ends.append(time.perf_counter())
        cpu_ends.append(time.process_time())
        rewards.append(m["reward/mean"])
        gen_s = m["perf/gen_time_s"] - m.get("perf/score_s", 0.0)  # the engine's time, scoring aside
        tok_s.append(m["response/length_mean"] * batch / max(gen_s, 1e-9))

    train_variant(cfg, out / variant, ws_dir, ws_acc, progress=progress)
    cycles = [b - a for a, b in zip(ends[:-2], ends[1:-1], strict=False)]  # steps 2 .. steps-1
    cpu = [b - a for a, b in zip(cpu_ends[:-2], cpu_ends[1:-1], strict=False)]
    return {"cycle_s": median(cycles), "cycle_cpu_s": median(cpu), "cycles": len(cycles), "rollout_tok_s": median(tok_s[1:-1]),
            "reward_curve": [round(r, 4) for r in rewards[1:-1]], "reward_mean": statistics.fmean(rewards[1:-1])}


def launched_side(args: argparse.Namespace, variant: str, workers: int, ws_dir: Path, ws_acc: float, out: Path) -> dict:
    """:func:`project_side` with generation and scoring in ``workers`` processes of their own
    (``distributed.rollout_workers``; bit for bit the in-process run under the deterministic
    schedule, docs/distributed.md): torchrun starts the trainer rank and the workers, each runs
    this module with ``--rank-of``, and the trainer rank writes its figures. The CPU time of a
    cycle is then spread over processes and is not reported."""
    from infra.launch import LaunchSpec, launch

    own = out / f"workers-{workers}"  # a run folder of its own (the in-process run's would be resumed, finished)
    own.mkdir(parents=True, exist_ok=True)
    result = own / f"{variant}.json"
    argv = ["-m", "bench.peer_trl", "--rank-of", variant, "--rollout-workers", str(workers), "--cycles", str(args.cycles), "--preset", args.preset,
            "--warm-start", str(ws_dir), "--warm-start-acc", repr(ws_acc), "--result", str(result)]
    for flag, val in (("--torch-threads", args.torch_threads), ("--update-threads", args.update_threads)):
        if val is not None:
            argv += [flag, str(val)]
    launch(LaunchSpec(mode="torchrun", nproc_per_node=1 + workers), argv, cwd=own)
    return {**json.loads(result.read_text()), "cycle_cpu_s": None, "rollout_workers": workers}


def rank_main(args: argparse.Namespace) -> int:
    """One rank of :func:`launched_side`: the trainer rank (0) writes ``--result``."""
    cfg = with_overrides(work_config(args.cycles, args.torch_threads, args.update_threads, args.preset),
                         distributed={"rollout_workers": args.rollout_workers})
    ws_dir, ws_acc, out = Path(args.warm_start), float(args.warm_start_acc), Path(args.result).parent
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.result).write_text(json.dumps(project_side(cfg, args.rank_of, ws_dir, ws_acc, out)))
    else:  # a rollout worker: it generates and scores, the trainer rank times the cycles
        train_variant(with_overrides(cfg, rl={"variant": args.rank_of}), out / args.rank_of, ws_dir, ws_acc)
    return 0


def trl_missing() -> str | None:
    try:
        import trl  # noqa: F401
    except ImportError as e:
        return f"TRL is not installed ({e}); to compare with it: {TRL.install_hint('bench.peer_trl')}"
    return None


def trl_side(cfg: TrainConfig, cycles: int, ws_dir: Path, out: Path) -> dict:
    """TRL's GRPOTrainer on the same model, prompts, grader and settings."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(usable_cores())  # one thread of work: it may use every core
    rl = cfg.rl
    model, tok = load_pretrained(ws_dir, dtype=torch.float32, device=torch.device("cpu"))
    train_rows, _, _ = load_rows(cfg.data, tok)
    style = prompt_style(cfg.data)
    dataset = Dataset.from_list([{"prompt": style.render(r["prompt"], tok), "gold": r["gold"], "row_id": r["id"]} for r in train_rows])
    task = cfg.data.task

    def grader_reward(prompts, completions, gold, row_id, **_):
        return score_completions(task, completions, list(gold), list(row_id))

    args = GRPOConfig(
        output_dir=str(out / "trl"), max_steps=UPDATES_PER_BATCH * (cycles + 1), learning_rate=rl.lr,
        lr_scheduler_type="constant", warmup_steps=0, per_device_train_batch_size=rl.batch_prompts * rl.group_size // UPDATES_PER_BATCH,
        gradient_accumulation_steps=1, steps_per_generation=UPDATES_PER_BATCH, num_generations=rl.group_size,
        num_iterations=1, max_completion_length=rl.max_new_tokens, temperature=rl.temperature, top_p=1.0, top_k=0,
        beta=0.0, loss_type="bnpo", scale_rewards="group", epsilon=rl.eps_clip, max_grad_norm=rl.grad_clip,
        bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=True, report_to="none", save_strategy="no",
        logging_steps=10**6, disable_tqdm=True, seed=rl.seed, dataloader_num_workers=0, log_completions=False,
    )
    ends: list[float] = []
    cpu_ends: list[float] = []
    rewards: list[float] = []
    tok_s: list[float] = []

    class CycleTimer(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step % UPDATES_PER_BATCH == 0:
                ends.append(time.perf_counter())
                cpu_ends.append(time.process_time())

    trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=grader_reward, args=args, train_dataset=dataset,
                          callbacks=[CycleTimer()])
    generate = trainer._generate_single_turn

    def timed_generate(*a, **kw):  # TRL's generation call, timed as the project's engine is
        t0 = time.perf_counter()
        completion_ids, logprobs = generate(*a, **kw)
        tok_s.append(sum(map(len, completion_ids)) / max(time.perf_counter() - t0, 1e-9))
        return completion_ids, logprobs

    trainer._generate_single_turn = timed_generate
    score = trainer._calculate_rewards

    def recorded_rewards(*a, **kw):
        r = score(*a, **kw)
        rewards.append(float(r.sum(dim=1).mean()))  # one reward function: its mean over the batch
        return r

    trainer._calculate_rewards = recorded_rewards
    trainer.train()
    cycles_s = [b - a for a, b in zip(ends[:-1], ends[1:], strict=False)]
    cpu = [b - a for a, b in zip(cpu_ends[:-1], cpu_ends[1:], strict=False)]
    return {"cycle_s": median(cycles_s), "cycle_cpu_s": median(cpu), "cycles": len(cycles_s), "rollout_tok_s": median(tok_s[1:]),
            "reward_curve": [round(r, 4) for r in rewards[1:]], "reward_mean": statistics.fmean(rewards[1:]) if rewards[1:] else float("nan")}


def table(rows: dict[str, dict], trl: dict | None) -> str:
    head = f"{'side':<12} {'s/cycle':>8} {'vs TRL':>7} {'CPU s/cycle':>12} {'rollout tok/s':>14} {'vs TRL':>7} {'reward':>7}"
    lines = [head, "-" * len(head)]
    for name, r in ([("TRL GRPO", trl)] if trl else []) + list(rows.items()):
        vs = f"{r['vs_trl']:.2f}x" if "vs_trl" in r else "-"
        vs_tok = f"{r['rollout_vs_trl']:.2f}x" if "rollout_vs_trl" in r else "-"
        cpu = "-" if r["cycle_cpu_s"] is None else f"{r['cycle_cpu_s']:.3f}"
        lines.append(f"{name:<12} {r['cycle_s']:>8.3f} {vs:>7} {cpu:>12} {r['rollout_tok_s']:>14.0f} {vs_tok:>7} {r['reward_mean']:>7.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=20, help="timed cycles per side (median over them)")
    ap.add_argument("--preset", default="tiny", help="config preset of the work (default tiny, the comparison's; micro for a quick check)")
    ap.add_argument("--variants", default="sync,loglinear", help="project variants, comma-separated")
    ap.add_argument("--cache", default=None, help="warm-start cache folder (default: a temporary one, so a warm start is trained)")
    ap.add_argument("--torch-threads", type=int, default=None, help="config torch_threads (default: the config's)")
    ap.add_argument("--update-threads", type=int, default=None, help="config update_threads (default: the config's, 0 = every core)")
    ap.add_argument("--no-trl", action="store_true", help="the project's side only")
    ap.add_argument("--rollout-workers", type=int, default=1,
                    help="also run each asynchronous variant with its rollouts in this many processes of their own "
                         "(distributed.rollout_workers, under torchrun; row '<variant>+<N>w'); 0: in-process rows only (default 1)")
    ap.add_argument("--rank-of", default=None, help=argparse.SUPPRESS)  # a rank of launched_side
    ap.add_argument("--warm-start", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--warm-start-acc", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.cycles < 1:
        ap.error("--cycles must be >= 1")
    if args.rollout_workers < 0:
        ap.error("--rollout-workers must be >= 0")
    if args.rank_of:
        return rank_main(args)
    cfg = work_config(args.cycles, args.torch_threads, args.update_threads, args.preset)
    out = Path(tempfile.mkdtemp(prefix="a3po-peer-trl-"))
    ws_dir, ws_acc = prepare_warmstart(cfg, Path(args.cache) if args.cache else out / "cache", log=lambda s: print(s, file=sys.stderr))
    missing = None if args.no_trl else trl_missing()
    if missing:
        print(f"peer_trl: {missing}", file=sys.stderr)
    trl = None if (args.no_trl or missing) else trl_side(cfg, args.cycles, ws_dir, out)
    rows = {}
    for v in [v.strip() for v in args.variants.split(",") if v.strip()]:
        rows[v] = {**project_side(cfg, v, ws_dir, ws_acc, out), "rollout_workers": 0}
        # A synchronous run's producer idles while the trainer trains: a worker process would only
        # take the second core from the update (a3po.placement.cores).
        if args.rollout_workers and Variant(v).is_async:
            rows[f"{v}+{args.rollout_workers}w"] = launched_side(args, v, args.rollout_workers, ws_dir, ws_acc, out)
    for r in rows.values() if trl else ():
        r["vs_trl"] = trl["cycle_s"] / r["cycle_s"]
        r["rollout_vs_trl"] = r["rollout_tok_s"] / trl["rollout_tok_s"]
    print(f"peer_trl: {args.cycles} cycles per side, medians; {usable_cores()} cores; warm start {ws_dir}")
    print(table(rows, trl))
    summary = {"bench": "peer_trl", "cycles": args.cycles, "cores": usable_cores(), "trl": trl,
               "trl_missing": missing, "variants": rows}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    if "--no-trl" not in sys.argv[1:] and "--rank-of" not in sys.argv[1:] and trl_missing():
        TRL.rerun_here("bench.peer_trl", sys.argv[1:])
    sys.exit(main())
