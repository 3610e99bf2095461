"""``train_reward_model``: the embedded default's neural reward model, a thin task over
:func:`a3po.training.reward_model.prepare_reward_model`.

Trained offline once per (warm start, settings) from samples of the warm-started policy that
the grader labelled, cached like the warm start (the library's folder key + Prefect's cache
record); its held-out accuracy, beside the majority-class baseline, balanced accuracy and AUC,
is logged on the flow's MLflow parent run as ``reward_model/*``. Use its ``dir`` as ``ppo.reward_model_path``.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

from prefect import task

from a3po.config import TrainConfig
from a3po.rollout.types import SamplingParams
from a3po.storage.content import record_problem
from a3po.training.reward_model import REWARD_MODEL_RECORD, RewardModelSettings, prepare_reward_model, reward_model_key
from tasks.runtime import run_logger
from tasks.tracking import TrackingRef, client_for, log_metrics_now
from tasks.training import WarmStart


@dataclass(frozen=True)
class RewardModel:
    dir: str  # an HF sequence-classification model directory (ppo.reward_model_path)
    heldout_acc: float
    heldout_majority_acc: float  # the baseline: always the commoner label
    key: str
    seconds: float = 0.0  # time in the library call (0 when it found the cache)


def reward_model_dir(cfg: TrainConfig, warmstart: WarmStart, cache_root: str | Path, settings: RewardModelSettings) -> Path:
    params = SamplingParams(cfg.rl.max_new_tokens, cfg.rl.temperature)
    return Path(cache_root).resolve() / f"reward-model-{reward_model_key(warmstart.dir, cfg.data.task, settings, params)}"


def reward_model_ready(cfg: TrainConfig, warmstart: WarmStart, cache_root: str | Path, settings: RewardModelSettings = RewardModelSettings()) -> bool:
    """The folder is on disk and its files hash as recorded when written (callers refresh
    Prefect's cache record when not, so a damaged folder is trained again)."""
    return record_problem(reward_model_dir(cfg, warmstart, cache_root, settings), REWARD_MODEL_RECORD) is None


def _cache_key(context, inputs) -> str:
    folder = reward_model_dir(inputs["cfg"], inputs["warmstart"], inputs["cache_root"], inputs.get("settings") or RewardModelSettings())
    return "reward-model-" + hashlib.sha256(str(folder).encode()).hexdigest()[:24]


@task(cache_key_fn=_cache_key, persist_result=True)
def train_reward_model(
    cfg: TrainConfig, warmstart: WarmStart, cache_root: str, tracking: TrackingRef | None = None,
    settings: RewardModelSettings | None = None,
) -> RewardModel:
    """Train (or find) the reward model of ``warmstart``; log its held-out accuracy on the parent run.
    Call it with ``.with_options(refresh_cache=not reward_model_ready(...))``."""
    settings = settings or RewardModelSettings()
    t0 = time.perf_counter()
    out, figures = prepare_reward_model(cfg, warmstart.dir, cache_root, settings, log=run_logger().info)
    seconds = time.perf_counter() - t0
    run_logger().info(f"reward model: held-out accuracy {figures['reward_model/heldout_acc']:.3f} "
                      f"(majority baseline {figures['reward_model/heldout_majority_acc']:.3f}, "
                      # .get: a model cached before these figures existed has only the first two
                      f"balanced {figures.get('reward_model/heldout_balanced_acc', float('nan')):.3f}, "
                      f"AUC {figures.get('reward_model/heldout_auc', float('nan')):.3f})")
    if tracking is not None:
        log_metrics_now(client_for(tracking.tracking_uri), tracking.parent_run_id, figures)
    return RewardModel(
        dir=str(Path(out).resolve()),
        heldout_acc=figures["reward_model/heldout_acc"],
        heldout_majority_acc=figures["reward_model/heldout_majority_acc"],
        key=Path(out).name.removeprefix("reward-model-"),
        seconds=seconds,
    )
