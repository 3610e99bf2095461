"""A neural reward model trained offline from the grader's labels.

The embedded task has an exact grader; the reward model is the PPO path's other reward source
(``ppo.reward: model``), as RLHF trains one from labelled samples:

1. :func:`sample_labelled`: the warm-started policy samples completions of training prompts; the
   grader labels each 1 (correct) or 0. Examples keep the token ids exactly as a rollout holds
   them (prompt, completion, EOS when it stopped), so the model scores what it was trained on.
2. :func:`build_reward_model`: a causal LM with a scalar head (``AutoModelForSequenceClassification``,
   ``num_labels=1``; its logit at the last non-pad token) sharing the policy's backbone weights.
3. :func:`train_reward_model`: binary cross-entropy on the labels; held-out accuracy on samples of
   prompts it never saw, beside the majority-class baseline it must beat, balanced accuracy and
   AUC (:func:`classification_figures`; both 0.5 for a constant guess, which accuracy can hide
   when most samples are wrong).
4. :func:`prepare_reward_model`: all of it once per (warm start, settings), cached in a folder
   named by a key, like the warm start (``a3po.training.run.prepare_warmstart``).

Its reward is ``sigmoid(logit)`` (``a3po.models.critic.reward_model_scores``): P(correct), the grader's scale.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from a3po.algorithms.checks import require_same_shape
from a3po.devices import autocast_for, model_device, sampling_generator
from a3po.grading.rewards import score_completions
from a3po.models.logprobs import position_ids_from_mask
from a3po.rollout.torch_engine import RolloutEngine
from a3po.rollout.types import SamplingParams
from a3po.storage.atomic import atomic_write_text, save_pretrained_atomic
from a3po.storage.content import folder_hashes, record_problem


@dataclass(frozen=True)
class RewardModelSettings:
    """How the reward model is sampled for and trained (part of its cache key)."""

    n_prompts: int = 800
    """Training prompts sampled (the first ``heldout_frac`` of them, shuffled, are held out)."""
    samples_per_prompt: int = 8
    """Several answers per prompt, some right, some near misses: the contrast the model learns
    from (600 x 4 samples and 300 steps gave a constant guess: held-out AUC 0.50)."""
    heldout_frac: float = 0.2
    steps: int = 1000
    batch_size: int = 64
    lr: float = 5e-4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n_prompts < 2 or self.samples_per_prompt < 1 or self.steps < 1 or self.batch_size < 1:
            raise ValueError("reward model: n_prompts >= 2, samples_per_prompt, steps and batch_size >= 1")
        if not 0 < self.heldout_frac < 1:
            raise ValueError(f"reward model: heldout_frac must be in (0, 1), got {self.heldout_frac}")
        if self.lr <= 0:
            raise ValueError(f"reward model: lr must be > 0, got {self.lr}")


@dataclass(frozen=True)
class Example:
    ids: list[int]  # prompt + completion (+ EOS when it stopped): what a rollout row holds
    label: float  # the grader's score, 0 or 1
    group: str  # the prompt's id (held-out split by prompt)


@torch.no_grad()
def sample_labelled(
    policy, tokenizer, rows: list[dict], task: str, samples_per_prompt: int, params: SamplingParams, seed: int,
    batch_size: int = 64
) -> list[Example]:
    """Completions of ``rows`` by ``policy``, labelled by the task's grader."""
    engine = RolloutEngine(policy, tokenizer.eos_token_id, tokenizer.pad_token_id)
    gen = sampling_generator(model_device(policy), seed)
    flat = [r for r in rows for _ in range(samples_per_prompt)]
    out: list[Example] = []
    for start in range(0, len(flat), batch_size):
        chunk = flat[start : start + batch_size]
        prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in chunk]
        batch = engine.generate(prompts, params, generator=gen)
        texts = [tokenizer.decode([t for t in resp if t != tokenizer.eos_token_id], skip_special_tokens=True)
                 for resp in batch.responses]
        scores = score_completions(task, texts, [r["gold"] for r in chunk], [r["id"] for r in chunk])
        for p, resp, s, r in zip(prompts, batch.responses, scores, chunk, strict=True):
            out.append(Example(list(p) + resp, float(s), str(r["id"])))
    return out


def build_reward_model(policy, pad_token_id: int):
    """A one-label sequence classifier with the policy's backbone (copied) and a fresh head."""
    from transformers import AutoModelForSequenceClassification

    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    config.pad_token_id = pad_token_id  # how it finds each row's last token
    param = next(policy.parameters())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        rm = AutoModelForSequenceClassification.from_config(config, trust_remote_code=False)
    rm.to(device=param.device, dtype=param.dtype)
    rm.base_model.load_state_dict(policy.base_model.state_dict())
    return rm.eval()


def _batch(examples: list[Example], pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(examples):  # left padding: the last column is every row's last token
        ids[i, width - len(e.ids) :] = torch.tensor(e.ids)
        mask[i, width - len(e.ids) :] = 1
    labels = torch.tensor([e.label for e in examples], dtype=torch.float32)
    return ids.to(device), mask.to(device), labels.to(device)


def _logits(rm, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with autocast_for(rm):
        out = rm(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=False)
    return out.logits[:, 0].float()


@torch.no_grad()
def example_logits(rm, examples: list[Example], pad_token_id: int, batch_size: int = 128) -> torch.Tensor:
    """The model's logit per example ``(n,)``, fp32, on the CPU."""
    rm.eval()
    device = model_device(rm)
    return torch.cat([_logits(rm, *_batch(examples[s : s + batch_size], pad_token_id, device)[:2]).cpu()
                      for s in range(0, len(examples), batch_size)])


def classification_figures(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """How well ``logits`` ``(n,)`` (class 1 when > 0) separate binary ``labels`` ``(n,)``::

        acc          = mean(1[logit > 0] == label)
        majority_acc = max(p, 1 - p),  p = mean(label)      (always the commoner label)
        balanced_acc = (TPR + TNR) / 2                       (0.5 for any constant guess)
        auc          = P(logit_i > logit_j | label_i = 1, label_j = 0), ties count 1/2
                       (Mann-Whitney U / (n_pos n_neg), from ranks; threshold-free; nan with one class)
    """
    require_same_shape(logits=logits, labels=labels)
    y, pred = labels > 0.5, logits > 0
    pos, neg = logits[y], logits[~y]
    p = y.float().mean().item() if len(y) else 0.0
    tpr = (pred & y).sum().item() / max(len(pos), 1)
    tnr = (~pred & ~y).sum().item() / max(len(neg), 1)
    if len(pos) and len(neg):
        # By ranks (average ranks for ties): U = sum of the positives' ranks - n_pos (n_pos + 1) / 2.
        _, inv, counts = torch.unique(logits.double(), return_inverse=True, return_counts=True)
        ranks = (counts.cumsum(0) - (counts - 1) / 2)[inv]  # 1-based
        auc = ((ranks[y].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg))).item()
    else:
        auc = float("nan")
    return {"acc": (pred == y).float().mean().item() if len(y) else 0.0, "majority_acc": max(p, 1 - p),
            "balanced_acc": (tpr + tnr) / 2, "auc": auc, "positive_frac": p}


def train_reward_model(
    rm, train: list[Example], heldout: list[Example], pad_token_id: int, steps: int, batch_size: int,
    lr: float, seed: int
) -> dict[str, float]:
    """Binary cross-entropy of ``sigmoid(logit)`` against the grader's labels, ``steps`` AdamW
    steps on random batches of ``train``; returns the figures (``reward_model/*``)."""
    if not train or not heldout:
        raise ValueError("reward model training needs train and held-out examples")
    rng = random.Random(seed)
    opt = torch.optim.AdamW(rm.parameters(), lr=lr, weight_decay=0.0)
    device, loss_val = model_device(rm), float("nan")
    rm.train()
    for _ in range(steps):
        ids, mask, labels = _batch(rng.sample(train, min(batch_size, len(train))), pad_token_id, device)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(_logits(rm, ids, mask), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(rm.parameters(), 1.0)
        opt.step()
        loss_val = loss.item()
    rm.eval()
    held = classification_figures(example_logits(rm, heldout, pad_token_id), torch.tensor([e.label for e in heldout]))
    tr = classification_figures(example_logits(rm, train, pad_token_id), torch.tensor([e.label for e in train]))
    return {
        "reward_model/heldout_acc": held["acc"],
        "reward_model/heldout_majority_acc": held["majority_acc"],  # the baseline of always guessing the commoner label
        "reward_model/heldout_balanced_acc": held["balanced_acc"],
        "reward_model/heldout_auc": held["auc"],
        "reward_model/heldout_positive_frac": held["positive_frac"],
        "reward_model/train_acc": tr["acc"],
        "reward_model/train_auc": tr["auc"],
        "reward_model/train_loss": loss_val,
        "reward_model/n_train": float(len(train)),
        "reward_model/n_heldout": float(len(heldout)),
    }


def split_by_group(examples: list[Example], heldout_frac: float, seed: int) -> tuple[list[Example], list[Example]]:
    """Held-out examples are those of a random ``heldout_frac`` of the prompts (never seen in training)."""
    groups = sorted({e.group for e in examples})
    random.Random(seed).shuffle(groups)
    held = set(groups[: max(1, int(len(groups) * heldout_frac))])
    return [e for e in examples if e.group not in held], [e for e in examples if e.group in held]


def reward_model_key(warmstart_dir: str | Path, task: str, settings: RewardModelSettings,
                     sampling: SamplingParams) -> str:
    """Cache key: the warm start (its folder name is its own key), the task, the settings."""
    parts = {"warmstart": Path(warmstart_dir).name, "task": task, "settings": asdict(settings),
             "sampling": asdict(sampling)}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


# Written last into a reward-model folder: its held-out figures and the sha256 of each of its files.
REWARD_MODEL_RECORD = "a3po_reward_model.json"


def prepare_reward_model(
    cfg, warmstart_dir: str | Path, cache_root: str | Path, settings: RewardModelSettings = RewardModelSettings(),
    log: Callable[[str], None] = print,
) -> tuple[Path, dict[str, float]]:
    """Train the reward model of a :class:`a3po.config.TrainConfig`'s warm start once; returns
    ``(model dir, figures)``. The folder (``reward-model-<key>``) is written atomically and reused
    only while its files hash as recorded when it was written (else it is trained again)."""
    from a3po.data.datasets import load_rows
    from a3po.devices import resolve_device
    from a3po.models.factory import load_pretrained

    params = SamplingParams(cfg.rl.max_new_tokens, cfg.rl.temperature)
    out = Path(cache_root) / f"reward-model-{reward_model_key(warmstart_dir, cfg.data.task, settings, params)}"
    meta = out / REWARD_MODEL_RECORD
    problem = record_problem(out, REWARD_MODEL_RECORD)
    if problem is None:
        return out, {k: v for k, v in json.loads(meta.read_text()).items() if k != "files"}
    if out.exists():
        log(f"reward model {out.name}: {problem}; training it again")
    torch.set_num_threads(cfg.torch_threads)
    policy, tokenizer = load_pretrained(warmstart_dir, dtype=cfg.dtype.torch, device=resolve_device(cfg.device))
    train_rows, _, _ = load_rows(cfg.data, tokenizer)
    rows = random.Random(settings.seed).sample(train_rows, min(settings.n_prompts, len(train_rows)))
    log(f"reward model: sampling {len(rows)} x {settings.samples_per_prompt} completions, labelled by "
        f"the {cfg.data.task} grader")
    examples = sample_labelled(policy, tokenizer, rows, cfg.data.task, settings.samples_per_prompt, params,
                               settings.seed)
    train, heldout = split_by_group(examples, settings.heldout_frac, settings.seed)
    rm = build_reward_model(policy, tokenizer.pad_token_id)
    torch.manual_seed(settings.seed)
    log(f"reward model: {settings.steps} steps on {len(train)} examples, {len(heldout)} held out")
    figures = train_reward_model(rm, train, heldout, tokenizer.pad_token_id, settings.steps, settings.batch_size,
                                 settings.lr, settings.seed)
    save_pretrained_atomic(rm, tokenizer, out)
    atomic_write_text(meta, json.dumps({**figures, "files": folder_hashes(out, exclude=(REWARD_MODEL_RECORD,))}))
    return out, figures
