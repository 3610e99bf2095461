"""End-to-end training for one variant: model -> data -> warm start (cached) -> RL -> export.

This is what ``a3po train`` and the Prefect tasks call. The warm start is keyed by a hash of
the configs that determine it, so every variant and seed of a comparison starts from the very
same weights and pays for it once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Callable

import torch

from a3po.config import RunPlan, TrainConfig, preflight, warmstart_key
from a3po.config.plan import evaluation_threads
from a3po.data.arithmetic import WORDS
from a3po.data.datasets import load_rows, prompt_style, require_batch_rows
from a3po.devices import (
    NATIVE_BF16_FLAGS,
    DType,
    machine_precision,
    model_device,
    native_bf16,
    resolve_device,
    set_autocast,
)
from a3po.models.checks import check_disk, check_model
from a3po.models.factory import load_model, load_pretrained
from a3po.models.lora import is_lora, merged_model
from a3po.oppo.intra import IntraScoring
from a3po.parallel.ranks import Ranks, init_ranks
from a3po.parallel.updaters import plain_model
from a3po.placement.cores import own_cores, usable_cores
from a3po.placement.worker_loop import serve_rollouts
from a3po.producer.weight_store import Retention
from a3po.storage.atomic import atomic_write_text, save_pretrained_atomic
from a3po.storage.content import folder_hashes, record_problem
from a3po.training.actions import FILE as ACTIONS_FILE
from a3po.training.heldout import evaluate_heldout
from a3po.training.inputs import input_hashes
from a3po.training.loop import TrainResult, checked_rollout_inputs, rl_train
from a3po.training.metrics import MetricLogger
from a3po.training.ppo_parts import build_ppo_parts
from a3po.training.records import FINAL_DIR, RECORD_FILE, seal
from a3po.training.warmstart import warm_start

log = logging.getLogger(__name__)


def build_model(cfg: TrainConfig):
    """A built-in architecture name (over the embedded task's vocabulary), or a path / hub name of
    a pretrained causal LM, on the configured device and dtype."""
    return load_model(cfg.model.name, seed=cfg.model.init_seed, device=resolve_device(cfg.device),
                      dtype=cfg.dtype.torch, words=WORDS)


# Written last into a warm-start folder: its held-out figures and the sha256 of each of its files.
WARMSTART_RECORD = "a3po_warmstart.json"


def warmstart_folder(cfg: TrainConfig, cache_root: str | Path) -> Path:
    """Where the warm start of ``cfg`` is cached: ``warmstart-<key>``, keyed by the configs that
    determine it and the content of the model and data files they name."""
    return Path(cache_root) / f"warmstart-{warmstart_key(cfg, input_hashes(cfg))}"


def warmstart_problem(folder: str | Path) -> str | None:
    """Why the cached warm start ``folder`` cannot be reused (no record, a record without the
    files' hashes, a file missing or damaged, named), or None when every file is as written."""
    return record_problem(folder, WARMSTART_RECORD)


def prepare_warmstart(cfg: TrainConfig, cache_root: str | Path,
                      log: Callable[[str], None] = print) -> tuple[Path, float]:
    """Warm-start once per (model, data, warm_start) config and input contents; returns (model dir,
    held-out acc). A cached one is reused only when its files hash as recorded when it was written
    (else it is trained again, deterministically: the same seed gives the same weights)."""
    torch.set_num_threads(cfg.torch_threads)
    out = warmstart_folder(cfg, cache_root)
    meta = out / WARMSTART_RECORD
    problem = warmstart_problem(out)
    if problem is None:
        return out, json.loads(meta.read_text())["heldout_acc"]
    if out.exists():
        log(f"warm start {out.name}: {problem}; training it again")
    check_model(cfg, WORDS)  # the model's shapes against the config and this machine, before the warm start
    model, tokenizer = build_model(cfg)
    set_autocast(model, machine_precision(cfg.dtype, model_device(model)).autocast)  # as the RL run will compute
    train_rows, heldout_rows, _ = load_rows(cfg.data, tokenizer, require_solution=cfg.warm_start.steps > 0)
    require_batch_rows(train_rows, cfg.data, cfg.rl.batch_prompts)  # before the warm start trains
    torch.manual_seed(cfg.warm_start.seed)
    if cfg.warm_start.steps:
        log(f"warm start: {cfg.warm_start.steps} supervised steps on {len(train_rows)} problems")
    else:
        log("warm start: skipped (warm_start.steps = 0); RL starts from the model as it is")
    ws = warm_start(model, tokenizer, train_rows, cfg.warm_start, style=prompt_style(cfg.data))
    torch.set_num_threads(evaluation_threads(cfg, usable_cores()))  # the step-0 figure, measured as each final one is
    held = evaluate_heldout(model, tokenizer, heldout_rows, cfg)
    acc = held["eval/heldout_acc"]
    save_pretrained_atomic(model, tokenizer, out)
    files = folder_hashes(out, exclude=(WARMSTART_RECORD,))  # checked when the cache is reused
    atomic_write_text(meta, json.dumps({"heldout_acc": acc, **held, **ws, "files": files}))
    return out, acc


def _worker_scoring(cfg: TrainConfig, model: torch.nn.Module, pad_token_id: int) -> Callable[[Retention], IntraScoring]:
    """OPPO intra in a rollout worker: its scorers on the PPO parts built from the warm start, as
    the trainer builds its own (the critic's weights then come from the trainer, a3po.oppo.intra)."""
    parts = build_ppo_parts(cfg.ppo, model, cfg.rl.temperature)
    parts.critic_optimizer = None  # the trainer trains the critic; the scorers copy its versions
    return lambda retention: IntraScoring(parts, cfg.oppo, pad_token_id, retention)


class FinishedRunError(RuntimeError):
    """A run folder holds a finished run that has no checkpoint left to resume from."""


def refuse_finished_without_checkpoints(run_dir: Path) -> None:
    """Refuse a run folder whose run finished (``result.json``, written last) but whose checkpoints
    are gone (deleted to save disk): with nothing to resume, training would start again at step 0
    and rewrite the finished run's metrics. Naming the files, and how to train it again."""
    result = run_dir / "result.json"
    if result.is_file() and not any((run_dir / "checkpoints").glob("step_*")):
        raise FinishedRunError(
            f"{result} records a finished run, and {run_dir / 'checkpoints'} holds no checkpoint to resume "
            f"from: training would start again at step 0 and overwrite its metrics (metrics.jsonl, "
            f"history.jsonl). Its results are in {result} and {run_dir / 'final'}; to train it again, "
            f"move {result} away (or the folder)")


def train_variant(
    cfg: TrainConfig,
    run_dir: str | Path,
    warmstart_dir: str | Path,
    warmstart_acc: float,
    logger: MetricLogger | None = None,
    progress: Callable[[int, dict[str, float]], None] | None = None,
    ranks: Ranks | None = None,
) -> TrainResult | None:
    """RL-train one variant/seed from the warm start; resumes from ``run_dir/checkpoints``,
    writes the completion tables to ``run_dir/completions`` (a3po.training.completions), the guard's
    and the staleness controller's actions to ``run_dir/actions.jsonl`` (a3po.training.actions) and
    exports the final weights to ``run_dir/final`` (an HF model directory; with ``model.lora``
    the adapters merged into the base weights, so it loads like any model of the base's class). On a rollout
    worker's rank (``distributed.rollout_workers``) this serves the trainer batches until the run
    ends and returns None.

    The run is resolved here, once per process: ``ranks`` (joined by
    :func:`~a3po.parallel.ranks.init_ranks` unless the caller already did, as ``a3po train`` does)
    and the run's :class:`~a3po.config.plan.RunPlan`, both handed down."""
    run_dir = Path(run_dir)
    refuse_finished_without_checkpoints(run_dir)
    preflight(cfg)  # a worker given a config built elsewhere: the engine's package, DeepSpeed and its JSON are here
    torch.set_num_threads(cfg.torch_threads)
    model, tokenizer = load_pretrained(warmstart_dir, dtype=cfg.dtype.torch, device=resolve_device(cfg.device))
    check_disk(cfg, run_dir, model)  # the run folder's checkpoints fit, before any step (every flow task's run)
    train_rows, heldout_rows, _ = load_rows(cfg.data, tokenizer)
    require_batch_rows(train_rows, cfg.data, cfg.rl.batch_prompts)
    if ranks is None:
        ranks = init_ranks(cfg.distributed.deepspeed_config, cfg.distributed.rollout_workers)
    cores = own_cores(cfg, ranks)
    if cores is not None:  # this role's own cores: as many threads, every phase
        cfg = dataclasses.replace(cfg, torch_threads=len(cores), update_threads=len(cores), generate_threads=len(cores))
        torch.set_num_threads(len(cores))
    device, native = model_device(model), native_bf16(model_device(model))
    # after pinning: the thread budgets count this process's cores
    plan = RunPlan.of(cfg, usable_cores(), native, device.type)
    # Said once at start; a warning where bf16 was asked for and is emulated here (several times slower).
    log.log(logging.WARNING if plan.precision.slow else logging.INFO, f"precision: {plan.precision.reason}")
    if plan.engine_dtype is DType.BFLOAT16 and native is None and device.type == "cpu" and not plan.precision.slow:
        log.warning(f"rollout.dtype bfloat16: this CPU reports neither {' nor '.join(NATIVE_BF16_FLAGS)}, so the "
                    "engine's bf16 is emulated, several times slower than float32")
    set_autocast(model, plan.precision.autocast)  # a rollout worker's re-scoring copy computes as the trainer
    if ranks.is_rollout_worker:
        scoring = _worker_scoring(cfg, model, tokenizer.pad_token_id) if cfg.oppo.intra else None
        serve_rollouts(checked_rollout_inputs(cfg, plan, model, tokenizer, train_rows), ranks, intra=scoring)
        return None
    result = rl_train(
        cfg, model, tokenizer, train_rows, heldout_rows,
        ckpt_dir=str(run_dir / "checkpoints"), logger=logger, warmstart_acc=warmstart_acc, progress=progress,
        completions_dir=str(run_dir / "completions"), ranks=ranks, plan=plan, actions_path=str(run_dir / ACTIONS_FILE),
    )
    if not ranks.is_main:
        return result  # trainer ranks other than 0 write nothing
    if result.final_weights is not None:  # the module is ZeRO-3 partitioned: export the gathered weights
        model = plain_model(model, result.final_weights)
    elif is_lora(model):  # the adapters merged into the base: a plain folder of the base's class
        model = merged_model(model)
    save_pretrained_atomic(model, tokenizer, run_dir / FINAL_DIR)
    # Written last, whole or not at all, with the digests a flow's re-run checks before it takes the
    # finished run's record from it (a3po.training.records).
    record = seal(result.record(), result.history, run_dir / FINAL_DIR)
    atomic_write_text(run_dir / RECORD_FILE, json.dumps(record))
    return result
