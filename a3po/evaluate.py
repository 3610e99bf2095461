"""Held-out accuracy during training: greedy decoding through the rollout engine, scored by
the same grader as the reward."""

from __future__ import annotations

import torch

from a3po.rewards import score_completions
from a3po.rollout import SamplingParams, generate_text


@torch.no_grad()
def heldout_accuracy(model, tokenizer, rows: list[dict], task: str, max_new_tokens: int, batch_size: int = 64) -> float:
    completions = generate_text(model, tokenizer, [r["prompt"] for r in rows], SamplingParams(max_new_tokens, temperature=0.0), batch_size=batch_size)
    scores = score_completions(task, completions, [r["gold"] for r in rows], [r["id"] for r in rows])
    return sum(scores) / len(scores)
