"""Supervised warm start: next-token cross-entropy on worked solutions, prompt tokens masked,
so RL starts from partial competence instead of from random outputs."""

from __future__ import annotations

import math
import random

import torch

from a3po.algorithms.checks import NonFiniteError, require_finite_update
from a3po.config import WarmStartConfig
from a3po.data.prompts import PromptStyle
from a3po.devices import autocast_for, model_device
from a3po.models.logprobs import position_ids_from_mask
from a3po.rollout.padding import left_pad


def sft_batch(tokenizer, rows: list[dict],
              style: PromptStyle = PromptStyle()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded ``prompt + solution + eos`` (the prompt formatted by ``style``, as RL will
    see it); labels are -100 outside the solution."""
    seqs, targets = [], []
    for r in rows:
        p = tokenizer(style.render(r["prompt"], tokenizer), add_special_tokens=False)["input_ids"]
        s = tokenizer(r["solution"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(p + s)
        targets.append([-100] * len(p) + s)
    ids, mask = left_pad(seqs, tokenizer.pad_token_id)
    labels, _ = left_pad(targets, -100)
    return ids, mask, labels


def warm_start(
    model: torch.nn.Module, tokenizer, rows: list[dict], cfg: WarmStartConfig, progress=None,
    style: PromptStyle = PromptStyle()
) -> dict[str, float]:
    """Train ``model`` in place for ``cfg.steps`` steps; returns the final loss. ``cfg.steps ==
    0`` leaves the model as it is (and rows need no solution)."""
    if cfg.steps == 0:
        return {"warmstart/steps": 0.0}
    lacking = next((r for r in rows if "solution" not in r), None)
    if lacking is not None:
        raise ValueError(f"warm start needs a 'solution' in every training row; row {lacking.get('id')!r} has none "
                         "(set warm_start.steps: 0 to skip the warm start)")
    rng = random.Random(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    # Linear warm-up, then cosine decay to 10%: a tiny model trained at a high rate ends noisy otherwise.
    warm = max(1, min(20, cfg.steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.55 + 0.45 * math.cos(math.pi * min(s, cfg.steps) / cfg.steps))
    )
    model.train()
    device = model_device(model)
    loss_val = float("nan")
    for step in range(cfg.steps):
        batch = sft_batch(tokenizer, rng.sample(rows, min(cfg.batch_size, len(rows))), style)
        ids, mask, labels = (t.to(device) for t in batch)
        with autocast_for(model):
            logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
        logits = logits.float()  # the loss in fp32 whatever the weights (a no-op in fp32)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 labels[:, 1:].reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        try:  # before the step: a NaN or infinite update would be saved as the warm start
            require_finite_update(loss, grad_norm, "warm start")
        except NonFiniteError as e:
            raise NonFiniteError(f"warm-start step {step + 1}: non-finite training, {e} (likely: "
                                 f"warm_start.lr, or model {type(model).__name__}'s "
                                 "weights already hold NaN/inf)") from None
        opt.step()
        sched.step()
        loss_val = loss.item()
        if progress is not None:
            progress(step, loss_val)
    model.eval()
    return {"warmstart/final_loss": loss_val, "warmstart/steps": float(cfg.steps)}
